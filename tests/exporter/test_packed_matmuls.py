"""Packed float projections: one MatMul per shared input, bit-identical outputs; in the export, genai's layout."""

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from specdec.exporter.packed_matmuls import pack_shared_input_matmuls
from specdec.models.manifest import load_manifest
from tests.exporter.helpers import run_graph


def _projections() -> onnx.ModelProto:
    """x feeds q, k, v (4, 4, 2 columns); y feeds one MatMul alone; w_shared feeds two nodes."""
    rng = np.random.default_rng(0)
    weights = {name: rng.standard_normal((8, cols)).astype(np.float32)
               for name, cols in (("wq", 4), ("wk", 4), ("wv", 2), ("wy", 3), ("w_shared", 5))}
    nodes = [helper.make_node("MatMul", ["x", "wq"], ["q"], name="q"),
             helper.make_node("MatMul", ["x", "wk"], ["k"], name="k"),
             helper.make_node("MatMul", ["x", "wv"], ["v"], name="v"),
             helper.make_node("MatMul", ["y", "wy"], ["out_y"], name="y"),
             helper.make_node("MatMul", ["y", "w_shared"], ["s1"], name="s1"),
             helper.make_node("MatMul", ["x", "w_shared"], ["s2"], name="s2")]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, "n", 8]) for n in ("x", "y")]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, "n", cols])
               for n, cols in (("q", 4), ("k", 4), ("v", 2), ("out_y", 3), ("s1", 5), ("s2", 5))]
    graph = helper.make_graph(nodes, "proj", inputs, outputs,
                              [numpy_helper.from_array(w, name) for name, w in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_packing_merges_only_private_weights_on_one_input_and_keeps_every_value():
    model = _projections()
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((1, 5, 8), dtype=np.float32),
             "y": rng.standard_normal((1, 5, 8), dtype=np.float32)}
    expected = run_graph(model, feeds)
    assert pack_shared_input_matmuls(model) == 2  # q, k, v -> one; y's pair shares w_shared with s2: untouched
    onnx.checker.check_model(model)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("MatMul") == 4 and ops.count("Split") == 1
    packed = next(n for n in model.graph.node if n.op_type == "MatMul" and n.input[0] == "x" and "shared" not in n.input[1])
    assert numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == packed.input[1])).shape == (8, 10)
    for got, want in zip(run_graph(model, feeds), expected):
        np.testing.assert_array_equal(got, want)  # each column is the same dot product
    assert pack_shared_input_matmuls(model) == 0


def test_export_packs_projections_with_rotary_inside_attention(tiny_artifacts):
    for role in ("target", "draft"):
        spec = getattr(load_manifest(tiny_artifacts["llama"]), role)
        assert spec.optimization["fused_operators"]["PackedMatMul"] == 3 * spec.num_layers  # q/k/v: 2 fewer, gate/up: 1
        assert any(f"rotary inside GroupQueryAttention ({spec.num_layers} layers)" in step
                   for step in spec.optimization["applied"])
        model = onnx.load(str(tiny_artifacts["llama"] / spec.graph_file))
        # each attention sits in an If (specdec/exporter/long_call_attention.py): its short branch is the op as packed
        attention = [n for wrapper in model.graph.node if wrapper.op_type == "If"
                     for n in next(a.g for a in wrapper.attribute if a.name == "else_branch").node
                     if n.op_type == "GroupQueryAttention"]
        assert len(attention) == spec.num_layers and not any(n.op_type == "RotaryEmbedding" for n in model.graph.node)
        assert all(helper.get_attribute_value(next(a for a in n.attribute if a.name == "do_rotary")) == 1
                   for n in attention)
