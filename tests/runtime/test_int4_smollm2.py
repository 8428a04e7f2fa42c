"""An int4 SmolLM2 target at MatMulNBits level 4: its attention never runs on one query row, so steps score like verify calls."""

import os
from pathlib import Path

import numpy as np
import pytest

from specdec.benchmarks import PROMPTS_FILE
from specdec.models.manifest import load_manifest
from specdec.runtime.engine import Engine, GenerationConfig
from specdec.runtime.prompts import load_prompts

pytestmark = pytest.mark.slow

CACHED_ENV = "SPECDEC_SMOLLM2_INT4_TEST_ARTIFACT"  # an `export --weights int4 --draft none` folder to reuse


@pytest.fixture(scope="module")
def int4_engine(tmp_path_factory, request):
    from specdec.exporter.pipeline import ExportConfig, run_export

    cached = os.environ.get(CACHED_ENV)
    folder = Path(cached) if cached else tmp_path_factory.mktemp("smollm2-int4") / "art"
    if not (folder / "specdec.json").is_file():
        source = request.getfixturevalue("smollm2_folder")  # only when exporting: it dequantizes the GGUF
        run_export(ExportConfig(target=str(source), draft=None, output=folder, weights="int4"), progress=lambda m: None)
    spec = load_manifest(folder).target
    assert spec.optimization["quantization"]["accuracy_level"] == 4
    report = load_manifest(folder).validation["target"]
    # min_rows 2 only where the attention pad alone left 1-row calls scoring differently (AVX2-only CPUs).
    assert spec.attention_pad_rows == 1 and spec.min_rows == (2 if report.get("step_vs_call_max_diff_one_row") else 1)
    assert report["step_vs_call_max_diff"] == 0.0
    return Engine.load(folder, provider="cpu", threads=2)


def _scored(engine, ids, answer, chunk):
    """Return the logits of every answer position, the answer fed in calls of `chunk` tokens (0: one call)."""
    cache = engine.target.new_cache(len(ids) + len(answer) + 8)
    if chunk == 0:
        return engine.target.forward(cache, ids + answer)[len(ids) - 1:-1]
    rows = [engine.target.forward(cache, ids, logits_rows=2)[-1]]
    for start in range(0, len(answer) - 1, chunk):
        rows.extend(engine.target.forward(cache, answer[start:min(start + chunk, len(answer) - 1)]))
    return np.stack(rows)


@pytest.mark.parametrize("chunks", [(1, 0), (2, 3, 5, 8)])
def test_calls_of_any_length_score_a_position_alike(int4_engine, chunks):
    case = next(c for c in load_prompts(PROMPTS_FILE) if c.id == "story")
    ids = int4_engine.prompt_ids(case.prompt, case.chat)
    answer = int4_engine.generate(ids, GenerationConfig(max_new_tokens=33, drafter="none")).token_ids
    assert len(answer) == 33
    whole = _scored(int4_engine, ids, answer, 0)
    for chunk in chunks:
        # bit-identical on onnxruntime 1.32 (AVX-512), 1-token steps included (the attention pad):
        # the bound only leaves room for another build's reductions; unpadded steps were up to 1.2 off
        np.testing.assert_allclose(_scored(int4_engine, ids, answer, chunk), whole, atol=1e-4, err_msg=str(chunk))


@pytest.mark.parametrize("k", [4, "auto"])
def test_int4_target_with_prompt_lookup_equals_int4_target_only(int4_engine, k):
    """Needs the attention pad: at level 4, steps through the op's 1-row path left 5 of 6 prompts' greedy output."""
    for case in load_prompts(PROMPTS_FILE):
        ids = int4_engine.prompt_ids(case.prompt, case.chat)
        plain = int4_engine.generate(ids, GenerationConfig(max_new_tokens=48, drafter="none"))
        lookup = int4_engine.generate(ids, GenerationConfig(max_new_tokens=48, drafter="ngram", num_draft_tokens=k))
        assert lookup.token_ids == plain.token_ids, case.id
