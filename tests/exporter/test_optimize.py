"""The optimization stage: recorded in the manifest, and greedy output unchanged."""

import pytest
from click.testing import CliRunner

from specdec.cli.main import main
from specdec.exporter.pipeline import ExportConfig, run_export
from specdec.models.manifest import load_manifest
from specdec.runtime.engine import Engine, GenerationConfig

from tests.runtime.helpers import near_tie_mismatches


@pytest.fixture(scope="module")
def plain_llama(tiny_sources, tmp_path_factory):
    target, draft = tiny_sources["llama"]
    out = tmp_path_factory.mktemp("plain") / "art"
    run_export(ExportConfig(target=str(target), draft=str(draft), output=out, optimize=False), progress=lambda m: None)
    return out


def test_manifest_records_the_optimization(tiny_artifacts, plain_llama):
    optimized = load_manifest(tiny_artifacts["llama"]).target.optimization
    assert optimized["applied"] and optimized["fused_operators"]["SkipSimplifiedLayerNormalization"] > 0
    # attention over one shared KV buffer: a GroupQueryAttention per layer, and no attention mask input
    assert optimized["fused_operators"]["GroupQueryAttention"] == 2
    target = load_manifest(tiny_artifacts["llama"]).target
    assert (target.kv_buffer, target.attention_mask_name) == ("shared", None)
    assert target.seqlens_name and target.total_length_name
    # a shared buffer rolls back by its length alone: no crop graph is shipped
    assert target.kv_slice_file is None and not (tiny_artifacts["llama"] / "target" / "kv_slice.onnx").exists()
    assert not (tiny_artifacts["llama"] / "draft" / "kv_slice.onnx").exists()
    concat = load_manifest(plain_llama).target
    assert concat.kv_slice_file and (plain_llama / concat.kv_slice_file).is_file()
    assert load_manifest(tiny_artifacts["gpt2"]).target.kv_buffer == "concat"
    assert load_manifest(plain_llama).target.kv_buffer == "concat"
    assert optimized["sha256_before"] != optimized["sha256_after"]
    # the last rewrite of the file, after the optimization stage: attention kernels chosen per call
    long_call = optimized["long_call_attention"]
    assert long_call == {"layers": 2, "input": "long_call", "sha256_after": long_call["sha256_after"]}
    assert target.long_call_name == "long_call"
    assert long_call["sha256_after"] != optimized["sha256_after"]
    # the last rewrite of the file: its weights moved to the data file the ragged-rows graph shares
    assert target.sha256["target/model.onnx"] == optimized["ragged_rows"]["sha256_after"]
    gpt2 = load_manifest(tiny_artifacts["gpt2"]).target.optimization
    # gpt2 keeps its layers (no fusion measured to help it); only the lm_head's rows are cut
    assert len(gpt2["applied"]) == 1 and "trailing rows" in gpt2["applied"][0]
    assert gpt2["fused_operators"] == {}
    assert load_manifest(plain_llama).target.optimization["note"] == "--no-optimize"
    shown = CliRunner().invoke(main, ["inspect", str(tiny_artifacts["llama"])])
    assert "optimized: onnxruntime transformers optimizer" in shown.output
    assert "KV cache: one shared preallocated buffer" in shown.output


@pytest.mark.parametrize("drafter, k", [("none", None), ("model", 3), ("ngram", 4)])
def test_optimized_greedy_equals_plain(tiny_artifacts, plain_llama, drafter, k):
    optimized, plain = Engine.load(tiny_artifacts["llama"], provider="cpu"), Engine.load(plain_llama, provider="cpu")
    for prompt in ("The quick brown fox", "one, two, three, one, two,", "def add(a, b):"):
        config = GenerationConfig(max_new_tokens=40, drafter=drafter, num_draft_tokens=k)
        a, b = plain.generate(prompt, config), optimized.generate(prompt, config)
        if not near_tie_mismatches(plain, a.prompt_ids, a.token_ids, b.token_ids):
            assert a.token_ids == b.token_ids


def test_no_shared_kv_keeps_a_concat_cache_with_regrouped_attention(tiny_sources, tiny_artifacts, tmp_path):
    target, draft = tiny_sources["llama"]
    out = tmp_path / "art"
    manifest = run_export(ExportConfig(target=str(target), draft=str(draft), output=out, shared_kv=False),
                          progress=lambda m: None)
    assert manifest.target.kv_buffer == "concat" and manifest.target.attention_mask_name
    assert manifest.target.optimization["fused_operators"]["GroupedQueryMatMul"] == 4
    concat, shared = Engine.load(out, provider="cpu"), Engine.load(tiny_artifacts["llama"], provider="cpu")
    config = GenerationConfig(max_new_tokens=24, drafter="ngram", num_draft_tokens=3)
    a, b = concat.generate("one, two, three, one, two,", config), shared.generate("one, two, three, one, two,", config)
    if not near_tie_mismatches(concat, a.prompt_ids, a.token_ids, b.token_ids):
        assert a.token_ids == b.token_ids


def test_fusions_the_family_turns_off_change_no_node(tiny_sources, plain_llama):
    # The flags only skip passes that find nothing in a llama graph; if one ever found something, this fails.
    import dataclasses
    import json

    from specdec.exporter.optimize import _ort_fusions
    from specdec.models.architectures import architecture_for

    llama = architecture_for("llama")
    assert llama.ort_fusions_off
    config = json.loads((tiny_sources["llama"][0] / "config.json").read_text())
    graph = plain_llama / "target" / "model.onnx"  # the optimum graph, as the optimization stage receives it
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    trimmed, _ = _ort_fusions(graph, llama, heads, hidden)
    every, _ = _ort_fusions(graph, dataclasses.replace(llama, ort_fusions_off=()), heads, hidden)
    assert trimmed.SerializeToString() == every.SerializeToString()
