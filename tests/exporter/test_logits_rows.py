"""Logits for the trailing rows only: the same rows as a full call, fewer computed, old callers unharmed."""

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from specdec.exporter.logits_rows import LOGITS_ROWS_NAME, keep_trailing_logit_rows, keep_trailing_rows_in_last_layer
from specdec.exporter.grouped_attention import producers_and_consumers
from specdec.models.manifest import load_manifest, sha256_of_file
from specdec.runtime.engine import Engine, GenerationConfig
from specdec.runtime.session import ModelSession

TOKENS = [5, 17, 42, 99, 3, 250, 7, 64, 128, 31, 11]


def _session(artifact, **changes):
    spec = load_manifest(artifact).target
    return ModelSession(artifact, replace(spec, **changes), provider="cpu")


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_trailing_rows_equal_the_full_calls_rows(tiny_artifacts, family):
    spec = load_manifest(tiny_artifacts[family]).target
    assert spec.logits_rows_name == LOGITS_ROWS_NAME
    assert any("trailing rows" in step for step in spec.optimization["applied"])
    session = _session(tiny_artifacts[family])
    full = session.forward(session.new_cache(), TOKENS)
    assert full.shape[0] == len(TOKENS)
    for rows in (1, 2, 5, len(TOKENS)):
        cache = session.new_cache()
        got = session.forward(cache, TOKENS, logits_rows=rows)
        assert got.shape == (rows, full.shape[1])
        np.testing.assert_array_equal(got, full[-rows:])  # the same dot products: bit-identical
        assert cache.length == len(TOKENS)  # every position still enters the KV cache
        # the next call over the cache sees the same past as after a full call
        reference = session.new_cache()
        session.forward(reference, TOKENS)
        np.testing.assert_array_equal(session.forward(cache, [9, 8]), session.forward(reference, [9, 8]))


def test_the_graph_computes_only_the_rows_asked_for(tiny_artifacts):
    artifact = tiny_artifacts["gpt2"]  # a concat graph: every input is a plain tensor
    spec = load_manifest(artifact).target
    graph = ort.InferenceSession(str(artifact / spec.graph_file), providers=["CPUExecutionProvider"])
    n = len(TOKENS)
    feeds = {spec.input_ids_name: np.array([TOKENS], dtype=np.int64),
             spec.attention_mask_name: np.ones((1, n), dtype=np.int64)}
    if spec.position_ids_name:
        feeds[spec.position_ids_name] = np.arange(n, dtype=np.int64)[None, :]
    for pair in spec.past_names:
        for name in pair:
            feeds[name] = np.zeros((1, spec.num_kv_heads, 0, spec.head_dim), dtype=np.float32)
    run = lambda rows: graph.run([spec.logits_name], {**feeds, LOGITS_ROWS_NAME: np.array([rows], np.int64)})[0]
    every = run(0)  # 0 means all rows (transformers' logits_to_keep convention)
    assert every.shape[1] == n
    for rows, expected in ((1, 1), (3, 3), (n, n), (n + 4, n)):
        out = run(rows)
        assert out.shape[1] == expected
        np.testing.assert_array_equal(out, every[:, -expected:])


def _strip_rows_input(graph_path: Path) -> None:
    """Undo the rewrite in place: the graph as exported before the input existed."""
    model = onnx.load(str(graph_path))
    graph = model.graph
    cuts = [n for n in graph.node if n.name.startswith(("specdec_logits_rows_slice", "specdec_last_layer_rows_"))]
    for cut in cuts:
        for node in graph.node:
            node.input[:] = [cut.input[0] if name == cut.output[0] else name for name in node.input]
    keep = [n for n in graph.node if not n.name.startswith(("specdec_logits_rows_", "specdec_last_layer_rows_"))]
    del graph.node[:]
    graph.node.extend(keep)
    inputs = [i for i in graph.input if i.name != LOGITS_ROWS_NAME]
    del graph.input[:]
    graph.input.extend(inputs)
    onnx.save(model, str(graph_path))


@pytest.fixture(scope="module")
def old_llama(tiny_artifacts, tmp_path_factory) -> Path:
    """Return a copy of the tiny llama artifact as a v3 export wrote it: no rows input, manifest v3."""
    folder = tmp_path_factory.mktemp("old-rows") / "art"
    shutil.copytree(tiny_artifacts["llama"], folder)
    data = json.loads((folder / "specdec.json").read_text())
    data["version"] = 3
    for role in ("target", "draft"):
        graph = folder / data[role]["files"][0]
        _strip_rows_input(graph)
        data[role].pop("logits_rows_name")
        data[role]["sha256"][data[role]["files"][0]] = sha256_of_file(graph)
    (folder / "specdec.json").write_text(json.dumps(data))
    return folder


def test_graphs_without_the_input_are_cut_on_the_host(tiny_artifacts, old_llama):
    # An artifact exported before the input existed: the runtime drops the extra rows itself.
    old = _session(old_llama)
    assert old.spec.logits_rows_name is None
    new = _session(tiny_artifacts["llama"])
    full = old.forward(old.new_cache(), TOKENS)
    np.testing.assert_array_equal(old.forward(old.new_cache(), TOKENS, logits_rows=3), full[-3:])
    np.testing.assert_array_equal(new.forward(new.new_cache(), TOKENS, logits_rows=3), full[-3:])
    for bad in (0, len(TOKENS) + 1):
        with pytest.raises(ValueError, match="logits_rows must be"):
            new.forward(new.new_cache(), TOKENS, logits_rows=bad)


@pytest.mark.parametrize("drafter, k", [("none", None), ("model", 3), ("ngram", 4)])
def test_greedy_output_unchanged_by_the_rows_input(tiny_artifacts, old_llama, drafter, k):
    rows = Engine.load(tiny_artifacts["llama"], provider="cpu")
    full = Engine.load(old_llama, provider="cpu")  # every row computed, as before the input existed
    for prompt in ("The quick brown fox", "one, two, three, one, two,"):
        config = GenerationConfig(max_new_tokens=24, drafter=drafter, num_draft_tokens=k)
        assert rows.generate(prompt, config).token_ids == full.generate(prompt, config).token_ids


def _graph_without_lm_head() -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "n", 4])
    logits = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "n", 4])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["logits"])], "g", [x], [logits])
    return helper.make_model(graph)


def test_rewrite_refuses_graphs_it_does_not_understand_and_runs_once(tiny_artifacts):
    model = _graph_without_lm_head()
    assert keep_trailing_logit_rows(model) is False and len(model.graph.node) == 1
    rewritten = onnx.load(str(tiny_artifacts["llama"] / "target" / "model.onnx"))
    count = len(rewritten.graph.node)
    assert keep_trailing_logit_rows(rewritten) is False  # the input is there already: nothing added
    assert len(rewritten.graph.node) == count


def test_the_last_layer_after_attention_runs_on_the_kept_rows_only(tiny_artifacts, tmp_path):
    artifact = tiny_artifacts["llama"]
    spec = load_manifest(artifact).target
    assert any("last layer" in step for step in spec.optimization["applied"])
    model = onnx.load(str(artifact / spec.graph_file))
    cuts = sorted((n for n in model.graph.node if n.name.startswith("specdec_last_layer_rows_")),
                  key=lambda n: n.name)
    assert len(cuts) == 2  # the attention's output (slice_0) and the residual stream (slice_1)
    # expose what the MLP reads (the post-attention norm's output) and count its rows
    _, consumers = producers_and_consumers(model.graph)
    (o_proj,) = consumers[cuts[0].output[0]]
    (norm,) = consumers[o_proj.output[0]]
    assert cuts[1].output[0] in norm.input
    mlp_input = norm.output[0]
    model.graph.output.append(helper.make_tensor_value_info(mlp_input, TensorProto.FLOAT, None))
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    n = len(TOKENS)
    capacity = n + 1
    feeds = {spec.input_ids_name: np.array([TOKENS], np.int64),
             spec.seqlens_name: np.array([n - 1], np.int32), spec.total_length_name: np.array(n, np.int32)}
    if spec.position_ids_name:
        feeds[spec.position_ids_name] = np.arange(n, dtype=np.int64)[None, :]
    if spec.long_call_name:
        feeds[spec.long_call_name] = np.array([False])
    for pair in spec.past_names:
        for name in pair:
            feeds[name] = np.zeros((1, spec.num_kv_heads, capacity, spec.head_dim), np.float32)
    for rows, expected in ((1, 1), (3, 3), (0, n)):
        logits, hidden = session.run([spec.logits_name, mlp_input], {**feeds, LOGITS_ROWS_NAME: np.array([rows], np.int64)})
        assert logits.shape[1] == hidden.shape[1] == expected


def test_last_layer_rewrite_refuses_graphs_it_does_not_understand(tiny_artifacts):
    model = _graph_without_lm_head()
    assert keep_trailing_rows_in_last_layer(model) is False  # no rows input
    gpt2 = onnx.load(str(tiny_artifacts["gpt2"] / "target" / "model.onnx"))
    count = len(gpt2.graph.node)
    assert keep_trailing_rows_in_last_layer(gpt2) is False and len(gpt2.graph.node) == count  # no attention op
