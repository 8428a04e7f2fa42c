"""What `pip install` pulls in: one onnxruntime build, chosen by the `cpu` or `gpu` extra."""

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

PROJECT = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]


def _names(requirements):
    return {re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower() for requirement in requirements}


def test_onnxruntime_builds_come_only_from_their_own_extras():
    # onnxruntime and onnxruntime-gpu both install the `onnxruntime` module: a requirement on
    # the CPU build anywhere else would be installed beside the GPU build and overwrite it.
    extras = PROJECT["optional-dependencies"]
    assert not _names(PROJECT["dependencies"]) & {"onnxruntime", "onnxruntime-gpu"}
    assert _names(extras["cpu"]) == {"onnxruntime"}
    assert _names(extras["gpu"]) == {"onnxruntime-gpu"}
    for name, requirements in extras.items():
        if name not in ("cpu", "gpu"):
            assert not _names(requirements) & {"onnxruntime", "onnxruntime-gpu"}, name


def test_runtime_dependencies_stay_free_of_the_deep_learning_stack():
    assert not _names(PROJECT["dependencies"]) & {"torch", "transformers", "optimum", "optimum-onnx", "onnx"}
