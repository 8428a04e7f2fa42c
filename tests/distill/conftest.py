"""A tiny target distilled once per test run (about a minute on 2 busy cores)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

# Small enough for the suite; CE weighted up and no noise/unroll so a few dozen steps fit the tiny target.
TINY_DISTILL = dict(minutes=10.0, seed=0, prompts=16, steps=60, max_new_tokens=24, heldout=4, eval_prompts=1,
                    eval_tokens=24, threads=1,
                    # constant: a cosine would spend half of 60 steps decaying (the schedule has its own tests)
                    settings=dict(ce_weight=1.0, lr=3e-3, noise=0.0, unroll_weight=0.0, schedule="constant"))


@pytest.fixture(scope="session")
def distilled_artifact(tiny_target_only_artifact, tmp_path_factory) -> Path:
    """Return a copy of the tiny target-only llama artifact with a trained draft head in it."""
    from specdec.exporter.distill.pipeline import DistillConfig, run_distill

    folder = tmp_path_factory.mktemp("distilled") / "art"
    shutil.copytree(tiny_target_only_artifact, folder)
    run_distill(DistillConfig(artifact=folder, **TINY_DISTILL), progress=lambda message: None)
    return folder


@pytest.fixture(scope="session")
def distilled_layers_artifact(tiny_target_only_artifact, tmp_path_factory) -> Path:
    """Return a copy of the tiny target-only llama artifact with a head that also reads the normed inputs of
    layers 0 and 1 (EAGLE-3's lower taps; layer 0's norm is unfused, layer 1's fused with the residual add)."""
    from specdec.exporter.distill.pipeline import DistillConfig, run_distill

    folder = tmp_path_factory.mktemp("distilled-layers") / "art"
    shutil.copytree(tiny_target_only_artifact, folder)
    run_distill(DistillConfig(artifact=folder, feature_layers=(0, 1), **TINY_DISTILL), progress=lambda message: None)
    return folder
