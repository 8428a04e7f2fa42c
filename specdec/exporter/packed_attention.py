"""GroupQueryAttention over the packed q/k/v projection, rotary applied inside the op.

After `shared_kv.py` and a q/k/v fusion, each layer still goes projection -> Split ->
Reshape -> Transpose -> RotaryEmbedding -> Transpose -> Reshape -> GroupQueryAttention:
about 25 small nodes a layer whose per-node cost is a large share of an int4 step
(docs/INT4.md). onnxruntime-genai's graphs feed the packed [batch, seq, (H + 2 Hkv) * D]
projection straight into the op with `do_rotary=1` and the cos/sin caches; this rewrite
does the same. The op's rotary positions are `seqlens_k + 1 - seq_len + i` (the past
length plus i), what the runtime passes as position_ids, so the graph's interface is
unchanged (position_ids stays an input, now unused).
"""

from __future__ import annotations

import onnx
from onnx import helper

from specdec.exporter.grouped_attention import constant_values, producers_and_consumers, remove_dead_nodes

_PASS_THROUGH = ("Reshape", "Transpose", "RotaryEmbedding")


def _trace(name: str, producers: dict[str, onnx.NodeProto]) -> tuple[str, list[onnx.NodeProto]]:
    """Return (the tensor reached walking back through reshapes/transposes/rotaries, the rotaries met)."""
    rotaries = []
    node = producers.get(name)
    while node is not None and node.op_type in _PASS_THROUGH:
        if node.op_type == "RotaryEmbedding":
            rotaries.append(node)
        name = node.input[0]
        node = producers.get(name)
    return name, rotaries


def _rotary_ok(node: onnx.NodeProto) -> bool:
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return (node.domain == "com.microsoft" and attrs.get("interleaved", 0) == 0
            and attrs.get("rotary_embedding_dim", 0) == 0 and attrs.get("is_packed_batching", 0) == 0
            and float(attrs.get("scale", 1.0)) == 1.0)


def pack_attention_inputs(model: onnx.ModelProto) -> int:
    """Feed each GroupQueryAttention its packed q/k/v projection with rotary inside (in place).

    Returns the layers rewritten: all of them, or 0 (model untouched) when any layer's
    q/k/v do not come from one Split of one tensor in q, k, v order, with the same full,
    non-interleaved rotary on q and k and none on v.
    """
    graph = model.graph
    producers, _ = producers_and_consumers(graph)
    constants = constant_values(graph)
    plans = []
    for node in graph.node:
        if node.op_type != "GroupQueryAttention" or node.domain != "com.microsoft":
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("do_rotary", 0) or len(node.input) < 7 or not all(node.input[:3]):
            return 0
        traced = [_trace(name, producers) for name in node.input[:3]]
        sources = {id(producers.get(t)) for t, _ in traced}
        split = producers.get(traced[0][0])
        if len(sources) != 1 or split is None or split.op_type != "Split" or len(split.output) != 3:
            return 0
        if [t for t, _ in traced] != list(split.output):
            return 0
        (_, q_rot), (_, k_rot), (_, v_rot) = traced
        if len(q_rot) != 1 or len(k_rot) != 1 or v_rot or not (_rotary_ok(q_rot[0]) and _rotary_ok(k_rot[0])):
            return 0
        if q_rot[0].input[2:4] != k_rot[0].input[2:4]:
            return 0
        heads, kv_heads = attrs["num_heads"], attrs["kv_num_heads"]
        widths = constants.get(split.input[1]) if len(split.input) > 1 else None
        if widths is None or len(widths) != 3 or widths[1] != widths[2] or widths[0] * kv_heads != widths[1] * heads:
            return 0
        plans.append((node, split.input[0], list(q_rot[0].input[2:4])))
    for node, packed, (cos, sin) in plans:
        inputs = list(node.input)
        inputs[0:3] = [packed, "", ""]
        inputs = (inputs + ["", ""])[:9]
        inputs[7:9] = [cos, sin]
        del node.input[:]
        node.input.extend(inputs)
        kept = [a for a in node.attribute if a.name not in ("do_rotary", "rotary_interleaved")]
        del node.attribute[:]
        node.attribute.extend(kept + [helper.make_attribute("do_rotary", 1),
                                      helper.make_attribute("rotary_interleaved", 0)])
    if plans:
        remove_dead_nodes(graph)
    return len(plans)
