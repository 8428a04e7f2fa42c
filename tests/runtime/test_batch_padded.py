"""Batching for targets whose attention never runs on one query row (int4 at accuracy level 4, --exact-steps):
their plain graph cannot batch 1-token rows, so every shared step is one ragged-rows call with each row's
attention padded, and a lone request runs the single-request loop's own calls. Greedy output at any load is
still each prompt's target-only output."""

import pytest
from click.testing import CliRunner

from specdec.cli.main import main
from specdec.exporter.tiny_models import build_perturbed_draft
from specdec.models.errors import GenerationError
from specdec.models.manifest import load_manifest
from specdec.runtime.batch import BatchEngine
from specdec.runtime.engine import Engine, GenerationConfig

from tests.cli.test_bad_inputs import assert_refused_in_one_line
from tests.conftest import _export
from tests.runtime.test_batch import PROMPT_SET, _burst, _concurrently

KINDS = [dict(drafter="none"), dict(drafter="ngram", num_draft_tokens="auto", ngram_min=1),
         dict(drafter="model", num_draft_tokens=3), dict(drafter="ngram+model", num_draft_tokens="auto")]


@pytest.fixture(scope="module", params=["int4", "exact-steps"])
def padded_engine(request, tiny_sources, tmp_path_factory):
    target, _ = tiny_sources["llama"]
    root = tmp_path_factory.mktemp(f"padded-{request.param}")
    draft = build_perturbed_draft(target, root / "draft", noise=0.01, seed=1)
    flags = dict(weights="int4", min_agreement=0.0) if request.param == "int4" else dict(exact_steps=True)
    return Engine.load(_export(target, draft, root / "art", **flags), provider="cpu", threads=1)


def test_the_export_writes_a_padded_ragged_graph_equal_to_batch_1_calls(padded_engine):
    manifest = load_manifest(padded_engine.artifact_dir)
    target = manifest.target
    assert target.attention_pad_rows == 1 and target.ragged_rows == 8 and target.ragged_file
    assert manifest.validation["target"]["ragged_rows_max_diff"] == 0.0
    import onnx

    ragged = onnx.load(str(padded_engine.artifact_dir / target.ragged_file), load_external_data=False)
    attention = [n for n in ragged.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(attention) == 8 * target.num_layers
    query_pad = next(i for i in ragged.graph.initializer if i.name == "ragged_query_pad")
    assert onnx.numpy_helper.to_array(query_pad) == 1  # each row's own op gets the throwaway query row


@pytest.mark.parametrize("clients", [1, 4, 16])
def test_greedy_under_load_equals_each_prompts_own_target_only_output(padded_engine, clients):
    prompts = (PROMPT_SET * 2)[:clients]
    reference = [padded_engine.generate(p, GenerationConfig(max_new_tokens=24, drafter="none")).token_ids
                 for p in prompts]
    configs = [GenerationConfig(max_new_tokens=24, **KINDS[i % len(KINDS)]) for i in range(clients)]
    batch = BatchEngine(padded_engine, max_batch=8, kv_capacity=128)
    batch.time_batch_calls(repeats=1)
    target = padded_engine.target
    plain_batched = target.forward_batch

    def no_batched_decode(*args, **kwargs):  # the plain graph's batched op takes 1-row attention: never here
        raise AssertionError("a batched decode call on a padded graph")

    target.forward_batch = no_batched_decode
    try:
        results = _concurrently(batch, prompts, configs)
    finally:
        target.forward_batch = plain_batched
        batch.shutdown()
    assert [r.token_ids for r in results] == reference
    assert (batch.ragged_calls > 0) == (clients > 1), batch.ragged_calls  # alone: the single-request loop's calls
    if clients > 1:
        assert sum(r.stats.accepted for r in results) > 0


def test_a_burst_prefilled_in_one_ragged_call_keeps_each_prompts_own_output(padded_engine):
    prompts = PROMPT_SET[:8]
    config = GenerationConfig(max_new_tokens=12, drafter="none")
    reference = [padded_engine.generate(p, config).token_ids for p in prompts]
    batch = BatchEngine(padded_engine, max_batch=8, kv_capacity=128)
    try:
        results = _burst(batch, prompts, [config] * 8)
    finally:
        batch.shutdown()
    assert [r.token_ids for r in results] == reference and batch.ragged_prefills == 1


def test_slots_other_than_the_ragged_rows_are_refused_naming_them(padded_engine):
    with pytest.raises(GenerationError, match="use --max-batch 8"):
        BatchEngine(padded_engine, max_batch=4)


def test_serve_refuses_other_slots_in_one_line_before_it_listens(padded_engine):
    result = CliRunner().invoke(main, ["serve", str(padded_engine.artifact_dir), "--max-batch", "16", "--port", "0"])
    assert_refused_in_one_line(result, "use --max-batch 8")
    assert "listening" not in result.output
