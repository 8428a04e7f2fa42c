"""What `pip install` pulls in: one onnxruntime build, chosen by the `cpu` or `gpu` extra; and what the wheel holds."""

import fnmatch
import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


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


def test_every_data_file_in_the_package_ships_in_the_wheel():
    # a data file moved to another package without its package-data line would be missing from every install
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    for path in (ROOT / "specdec").rglob("*"):
        if not path.is_file() or path.suffix in (".py", ".pyc") or "__pycache__" in path.parts:
            continue
        package = path.parent
        while not (package / "__init__.py").is_file():
            package = package.parent
        name = ".".join(package.relative_to(ROOT).parts)
        inside = path.relative_to(package).as_posix()
        assert any(fnmatch.fnmatch(inside, pattern) for pattern in package_data.get(name, [])), (
            f"{path.relative_to(ROOT)}: no [tool.setuptools.package-data] pattern of '{name}' matches '{inside}'")
