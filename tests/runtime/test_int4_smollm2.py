"""An int4 SmolLM2 target at MatMulNBits level 4: row-independent multi-row calls, so exact with min_rows 2."""

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
def int4_engine(tmp_path_factory):
    from specdec.exporter.bundled import smollm2_gguf_path
    from specdec.exporter.pipeline import ExportConfig, run_export
    from specdec.models.errors import ExportError

    try:
        gguf = smollm2_gguf_path()
    except ExportError as err:
        pytest.skip(str(err))
    cached = os.environ.get(CACHED_ENV)
    folder = Path(cached) if cached else tmp_path_factory.mktemp("smollm2-int4") / "art"
    if not (folder / "specdec.json").is_file():
        run_export(ExportConfig(target=str(gguf), draft=None, output=folder, weights="int4"), progress=lambda m: None)
    spec = load_manifest(folder).target
    assert spec.optimization["quantization"]["accuracy_level"] == 4 and spec.min_rows == 2
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


def test_multi_row_calls_score_a_position_alike(int4_engine):
    case = next(c for c in load_prompts(PROMPTS_FILE) if c.id == "story")
    ids = int4_engine.prompt_ids(case.prompt, case.chat)
    answer = int4_engine.generate(ids, GenerationConfig(max_new_tokens=33, drafter="none")).token_ids
    assert len(answer) == 33
    whole = _scored(int4_engine, ids, answer, 0)
    for chunk in (2, 3, 5, 8):
        # bit-identical on onnxruntime 1.32 (AVX-512); the bound only leaves room for another build's reductions
        np.testing.assert_allclose(_scored(int4_engine, ids, answer, chunk), whole, atol=1e-4, err_msg=str(chunk))


@pytest.mark.parametrize("k", [4, "auto"])
def test_int4_target_with_prompt_lookup_equals_int4_target_only(int4_engine, k):
    """Needs ModelSession to honour min_rows: at level 4, 1-row steps left 5 of 6 prompts' greedy output."""
    for case in load_prompts(PROMPTS_FILE):
        ids = int4_engine.prompt_ids(case.prompt, case.chat)
        plain = int4_engine.generate(ids, GenerationConfig(max_new_tokens=48, drafter="none"))
        lookup = int4_engine.generate(ids, GenerationConfig(max_new_tokens=48, drafter="ngram", num_draft_tokens=k))
        assert lookup.token_ids == plain.token_ids, case.id
