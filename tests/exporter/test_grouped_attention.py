"""The grouped-query attention rewrite on a hand-built repeat_kv attention graph."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from specdec.exporter.grouped_attention import regroup_attention
from tests.exporter.helpers import run_graph

HEADS, KV_HEADS, HEAD_DIM = 6, 2, 8


def _attention_graph(num_kv_heads: int = KV_HEADS) -> onnx.ModelProto:
    """Scores and output of GQA attention the way transformers' repeat_kv exports it."""
    group = HEADS // num_kv_heads
    repeat_shape = numpy_helper.from_array(np.array([1, 1, group, 1, 1], dtype=np.int64), "repeat_shape")
    heads_shape = numpy_helper.from_array(np.array([0, HEADS, -1, HEAD_DIM], dtype=np.int64), "heads_shape")
    axes = numpy_helper.from_array(np.array([2], dtype=np.int64), "axes")
    scale = numpy_helper.from_array(np.array(HEAD_DIM ** -0.25, dtype=np.float32), "scale")
    nodes = []
    for name in ("key", "value"):
        nodes += [
            helper.make_node("Unsqueeze", [name, "axes"], [f"{name}_5d"]),
            helper.make_node("Expand", [f"{name}_5d", "repeat_shape"], [f"{name}_expanded"]),
            helper.make_node("Reshape", [f"{name}_expanded", "heads_shape"], [f"{name}_repeated"]),
        ]
    nodes += [
        helper.make_node("Transpose", ["key_repeated"], ["key_t"], perm=[0, 1, 3, 2]),
        helper.make_node("Mul", ["key_t", "scale"], ["key_scaled"]),
        helper.make_node("Mul", ["query", "scale"], ["query_scaled"]),
        helper.make_node("MatMul", ["query_scaled", "key_scaled"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "value_repeated"], ["output"]),
    ]
    graph = helper.make_graph(
        nodes, "gqa",
        [helper.make_tensor_value_info("query", TensorProto.FLOAT, [1, HEADS, "n", HEAD_DIM]),
         helper.make_tensor_value_info("key", TensorProto.FLOAT, [1, num_kv_heads, "L", HEAD_DIM]),
         helper.make_tensor_value_info("value", TensorProto.FLOAT, [1, num_kv_heads, "L", HEAD_DIM])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, HEADS, "n", "L"]),
         helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, HEADS, "n", HEAD_DIM])],
        [repeat_shape, heads_shape, axes, scale],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_regrouped_attention_matches_repeat_kv():
    model = _attention_graph()
    rng = np.random.default_rng(0)
    feeds = {"query": rng.standard_normal((1, HEADS, 3, HEAD_DIM), dtype=np.float32),
             "key": rng.standard_normal((1, KV_HEADS, 11, HEAD_DIM), dtype=np.float32),
             "value": rng.standard_normal((1, KV_HEADS, 11, HEAD_DIM), dtype=np.float32)}
    expected = run_graph(model, feeds)
    assert regroup_attention(model, HEADS, KV_HEADS) == 2
    onnx.checker.check_model(model)
    ops = [node.op_type for node in model.graph.node]
    assert "Expand" not in ops and "Unsqueeze" not in ops  # the copies are gone, not bypassed
    got = run_graph(model, feeds)
    for a, b in zip(expected, got):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("heads, kv_heads", [(HEADS, HEADS), (HEADS, 4), (HEADS, 0)])
def test_no_rewrite_without_whole_query_groups(heads, kv_heads):
    model = _attention_graph()
    before = model.SerializeToString()
    assert regroup_attention(model, heads, kv_heads) == 0
    assert model.SerializeToString() == before
