"""One preallocated KV buffer per layer: attention as onnxruntime's GroupQueryAttention.

optimum's graphs return `present = Concat(past, new)`: every step copies the whole cache
into a new tensor, and a rejected draft needs another copy to crop it. onnxruntime's
GroupQueryAttention (com.microsoft) instead writes the new positions into the past buffer
in place when past and present are bound to the same memory, attends over the first
`seqlens_k + 1` positions, and ignores whatever lies beyond them. A rollback is then only
a shorter length on the next call; nothing is copied.

The rewrite keeps the graph's projections, rotary embedding and MLP, and replaces, per
layer, everything from the rotated Q/K and the new V to the attention output
(concat, repeat_kv, scores, mask, softmax, weighted sum) with one GroupQueryAttention node
(rotary off: it is already applied). The graph gains two inputs, `seqlens_k` (int32 [batch]:
each row's total length - 1) and `total_sequence_length` (int32 scalar), and loses `attention_mask`.
The causal mask is the op's own. Batch 1 takes any number of new tokens; a batch of several rows
takes one new token per row (onnxruntime's CPU kernel refuses more with a past), each row with its
own length: the batch engine's decode rows (specdec/runtime/batch.py). Layers must all match, or
nothing is rewritten.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from specdec.exporter.grouped_attention import (add_int64_constant, constant_values, producers_and_consumers,
                                                remove_dead_nodes)

SEQLENS_NAME = "seqlens_k"
TOTAL_LENGTH_NAME = "total_sequence_length"


def fuse_shared_kv_attention(model: onnx.ModelProto, num_layers: int, num_heads: int, num_kv_heads: int,
                             past_names: list[list[str]], present_names: list[list[str]],
                             layer_windows: list[int | None] | None = None) -> int:
    """Rewrite every layer's attention into GroupQueryAttention (in place); return the layers rewritten.

    `layer_windows` gives per layer the positions a query attends to, itself included
    (None: the whole past), as transformers' `sliding_window`. The op's `local_window_size`
    takes the same number: checked against PyTorch past the window on onnxruntime 1.32's
    CPU kernel, where one less or one more fails (tests/exporter/test_windows.py; the CUDA
    kernel is unchecked). Returns 0 and leaves the model untouched unless
    all `num_layers` layers match the expected pattern (Concat-built present, repeat_kv,
    scores, softmax, weighted sum).
    """
    graph = model.graph
    producers, consumers = producers_and_consumers(graph)
    constants = constant_values(graph)
    layers = []
    for (past_key, past_value), (present_key, present_value) in zip(past_names, present_names):
        match = _match_layer(past_key, past_value, present_key, present_value, producers, consumers, constants)
        if match is None:
            return 0
        layers.append(match)
    if len(layers) != num_layers or not layers:
        return 0

    windows = layer_windows or [None] * num_layers
    shape_bsd = add_int64_constant(graph, "specdec_kv_packed_shape", [0, 0, -1])
    new_nodes: dict[int, list[onnx.NodeProto]] = {}
    removed: set[int] = set()
    for index, layer in enumerate(layers):
        tag = f"specdec_gqa_layer{index}"
        added = []
        packed = {}
        for part, tensor in (("query", layer["query"]), ("key", layer["key"]), ("value", layer["value"])):
            transposed, flat = f"{tag}_{part}_bsnh", f"{tag}_{part}_packed"
            added.append(helper.make_node("Transpose", [tensor], [transposed], name=transposed, perm=[0, 2, 1, 3]))
            added.append(helper.make_node("Reshape", [transposed, shape_bsd], [flat], name=flat))
            packed[part] = flat
        added.append(helper.make_node(
            "GroupQueryAttention",
            [packed["query"], packed["key"], packed["value"], layer["past_key"], layer["past_value"],
             SEQLENS_NAME, TOTAL_LENGTH_NAME],
            [layer["output"], layer["present_key"], layer["present_value"]],
            name=f"{tag}_attention", domain="com.microsoft",
            num_heads=num_heads, kv_num_heads=num_kv_heads, scale=float(layer["scale"]), do_rotary=0,
            local_window_size=windows[index] if windows[index] else -1))
        new_nodes[id(layer["output_node"])] = added
        removed.update(id(node) for node in layer["concats"])

    ordered = []
    for node in graph.node:
        if id(node) in new_nodes:
            ordered.extend(new_nodes[id(node)])  # the attention output's old producer: replaced
        elif id(node) not in removed:
            ordered.append(node)
    del graph.node[:]
    graph.node.extend(ordered)
    graph.input.extend([helper.make_tensor_value_info(SEQLENS_NAME, TensorProto.INT32, ["batch_size"]),
                        helper.make_tensor_value_info(TOTAL_LENGTH_NAME, TensorProto.INT32, [])])
    remove_dead_nodes(graph)
    used = {name for node in graph.node for name in node.input}
    # The mask (and anything else only the old attention read) is no longer an input.
    kept_inputs = [i for i in graph.input if i.name in used]
    del graph.input[:]
    graph.input.extend(kept_inputs)
    if not any(opset.domain == "com.microsoft" for opset in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return len(layers)


def _match_layer(past_key: str, past_value: str, present_key: str, present_value: str,
                 producers: dict[str, onnx.NodeProto], consumers: dict[str, list[onnx.NodeProto]],
                 constants: dict[str, np.ndarray]) -> dict | None:
    concat_k, concat_v = producers.get(present_key), producers.get(present_value)
    for concat, past in ((concat_k, past_key), (concat_v, past_value)):
        if concat is None or concat.op_type != "Concat" or list(concat.input)[:1] != [past] or len(concat.input) != 2:
            return None
    scores, k_scale = _follow_to_matmul_rhs(present_key, consumers, constants)
    weighted, v_scale = _follow_to_matmul_rhs(present_value, consumers, constants)
    if scores is None or weighted is None or v_scale != 1.0:
        return None
    query, q_scale = scores.input[0], 1.0
    mul = producers.get(query)
    if mul is not None and mul.op_type == "Mul":
        scalar = _scalar_operand(mul, constants)
        if scalar is not None:
            query, q_scale = scalar
    # scores -> (+ mask) -> Softmax -> (NaN guard) -> weighted MatMul, nothing else
    if not _reaches(scores.output[0], weighted.input[0], consumers, {"Add", "Softmax", "IsNaN", "Where"}):
        return None
    # weighted [b, H, n, d] -> Transpose(0, 2, 1, 3) -> Reshape [b, n, H*d]: the attention output
    users = consumers.get(weighted.output[0], [])
    if len(users) != 1 or users[0].op_type != "Transpose":
        return None
    perm = next((list(a.ints) for a in users[0].attribute if a.name == "perm"), None)
    reshape = consumers.get(users[0].output[0], [])
    if perm != [0, 2, 1, 3] or len(reshape) != 1 or reshape[0].op_type != "Reshape":
        return None
    return {"query": query, "key": concat_k.input[1], "value": concat_v.input[1], "past_key": past_key,
            "past_value": past_value, "present_key": present_key, "present_value": present_value,
            "scale": q_scale * k_scale, "output": reshape[0].output[0], "output_node": reshape[0],
            "concats": (concat_k, concat_v)}


def _follow_to_matmul_rhs(tensor: str, consumers: dict[str, list[onnx.NodeProto]],
                          constants: dict[str, np.ndarray]) -> tuple[onnx.NodeProto | None, float]:
    """Return (the MatMul that takes `tensor` as its right-hand side, the scalar scale on the way).

    Walks through a repeat_kv copy (Unsqueeze, Expand, Reshape), a Transpose and scalar
    Muls; a branch leading only to shape arithmetic (Shape) is ignored.
    """
    scale = 1.0
    for _ in range(12):
        users = [u for u in consumers.get(tensor, []) if u.op_type != "Shape"]
        if len(users) != 1:
            return None, scale
        node = users[0]
        if node.op_type == "MatMul":
            return (node, scale) if node.input[1] == tensor else (None, scale)
        if node.op_type == "Mul":
            scalar = _scalar_operand(node, constants)
            if scalar is None:
                return None, scale
            scale *= scalar[1]
        elif node.op_type not in ("Unsqueeze", "Expand", "Reshape", "Transpose"):
            return None, scale
        tensor = node.output[0]
    return None, scale


def _scalar_operand(node: onnx.NodeProto, constants: dict[str, np.ndarray]) -> tuple[str, float] | None:
    """Return (the other input, the scalar) for a Mul by a one-element constant, else None."""
    a, b = node.input[0], node.input[1]
    if b in constants and constants[b].size == 1:
        return a, float(constants[b].reshape(-1)[0])
    if a in constants and constants[a].size == 1:
        return b, float(constants[a].reshape(-1)[0])
    return None


def _reaches(start: str, target: str, consumers: dict[str, list[onnx.NodeProto]], allowed: set[str]) -> bool:
    """Return whether `target` is produced from `start` through a chain of `allowed` ops only."""
    frontier, seen = [start], set()
    while frontier:
        tensor = frontier.pop()
        if tensor == target:
            return True
        if tensor in seen:
            continue
        seen.add(tensor)
        for node in consumers.get(tensor, []):
            if node.op_type in allowed:
                frontier.extend(node.output)
    return False
