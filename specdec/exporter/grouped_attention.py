"""Grouped-query attention without repeat_kv: score each KV head against its query-head group.

optimum's graphs of GQA models (llama, mistral, qwen2, phi3 with fewer KV heads than
query heads) copy the whole KV cache every step to repeat each KV head for its group of
query heads (transformers' `repeat_kv`: Unsqueeze -> Expand -> Reshape), once for K and
once for V, in every layer. At SmolLM2's 9 query / 3 KV heads that is three times the
cache read and written per layer per step, the largest cost after the weight MatMuls.

The rewrite leaves the KV cache alone and regroups the queries instead:
    Q [b, H, n, d] -> [b, Hkv, g*n, d]        (g = H / Hkv query heads per KV head)
    scores = Q_grouped @ K^T -> [b, Hkv, g*n, L] -> [b, H, n, L]
    ...mask, softmax: untouched...
    out = P_grouped [b, Hkv, g*n, L] @ V -> [b, Hkv, g*n, d] -> [b, H, n, d]
Query head h uses KV head h // g in both forms, so every score and output element is
the same dot product over the same d (or L) values. The graph keeps its inputs and outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper


@dataclass(frozen=True)
class _RepeatKV:
    """One repeat_kv copy found in the graph: Reshape(Expand(Unsqueeze(source, axis 2)))."""

    source: str  # the KV tensor [b, Hkv, L, d] before the copy
    output: str  # the repeated tensor [b, H, L, d]


def regroup_attention(model: onnx.ModelProto, num_heads: int, num_kv_heads: int) -> int:
    """Rewrite every repeat_kv attention in `model` (in place); return how many MatMuls were rewritten.

    Returns 0, changing nothing, when the model has no grouped-query attention
    (num_kv_heads == num_heads) or no repeat_kv pattern is found.
    """
    if num_kv_heads <= 0 or num_heads <= num_kv_heads or num_heads % num_kv_heads:
        return 0
    graph = model.graph
    producers, consumers = producers_and_consumers(graph)
    constants = constant_values(graph)

    repeats = [r for node in graph.node if node.op_type == "Reshape"
               if (r := _match_repeat_kv(node, producers, constants)) is not None]
    grouped_shape = add_int64_constant(graph, "specdec_gqa_grouped_shape", [0, num_kv_heads, -1, 0])
    heads_shape = add_int64_constant(graph, "specdec_gqa_heads_shape", [0, num_heads, -1, 0])

    rewritten = 0
    new_nodes: dict[int, list[onnx.NodeProto]] = {}  # insert before the node with this id
    for repeat in repeats:
        for user in consumers.get(repeat.output, []):
            chain, matmul = _follow_to_matmul(user, repeat.output, consumers, constants)
            if matmul is None:
                continue
            tag = f"specdec_gqa_{rewritten}"
            added: list[onnx.NodeProto] = []
            # Apply the per-head ops (transpose of the last two axes, scalar scale) to the
            # un-repeated tensor: they commute with repeating heads.
            operand = repeat.source
            for op, through in chain:
                out = f"{tag}_{op.name or op.op_type}"
                inputs = [operand if name == through else name for name in op.input]
                added.append(helper.make_node(op.op_type, inputs, [out], name=out, **_attributes(op)))
                operand = out
            other = matmul.input[0]
            grouped = f"{tag}_grouped_lhs"
            product = f"{tag}_grouped_matmul"
            added.append(helper.make_node("Reshape", [other, grouped_shape], [grouped], name=grouped))
            added.append(helper.make_node("MatMul", [grouped, operand], [product], name=product))
            added.append(helper.make_node("Reshape", [product, heads_shape], [matmul.output[0]],
                                          name=f"{tag}_heads"))
            new_nodes.setdefault(id(matmul), []).extend(added)
            rewritten += 1

    if not rewritten:
        _remove_constants(graph, [grouped_shape, heads_shape])
        return 0
    replaced = set(new_nodes)
    ordered: list[onnx.NodeProto] = []
    for node in graph.node:
        if id(node) in replaced:
            ordered.extend(new_nodes[id(node)])  # the new nodes produce this MatMul's output
        else:
            ordered.append(node)
    del graph.node[:]
    graph.node.extend(ordered)
    remove_dead_nodes(graph)
    return rewritten


def _match_repeat_kv(reshape: onnx.NodeProto, producers: dict[str, onnx.NodeProto],
                     constants: dict[str, np.ndarray]) -> _RepeatKV | None:
    expand = producers.get(reshape.input[0])
    if expand is None or expand.op_type != "Expand":
        return None
    unsqueeze = producers.get(expand.input[0])
    if unsqueeze is None or unsqueeze.op_type != "Unsqueeze":
        return None
    axes = _unsqueeze_axes(unsqueeze, constants)
    if axes != [2]:
        return None
    return _RepeatKV(source=unsqueeze.input[0], output=reshape.output[0])


def _follow_to_matmul(node: onnx.NodeProto, tensor: str, consumers: dict[str, list[onnx.NodeProto]],
                      constants: dict[str, np.ndarray]) -> tuple[list[tuple[onnx.NodeProto, str]],
                                                                  onnx.NodeProto | None]:
    """Return (per-head ops between the repeat and a MatMul, that MatMul) or ([], None).

    Each op comes with the name of its input that carries the repeated tensor. Only ops that commute with repeating heads are followed: a Transpose swapping the last
    two axes and a Mul by a scalar constant. The repeated tensor must be the MatMul's
    right-hand side, as in Q @ K^T and P @ V.
    """
    chain: list[tuple[onnx.NodeProto, str]] = []
    while True:
        if node.op_type == "MatMul":
            return (chain, node) if node.input[1] == tensor and node.input[0] != tensor else ([], None)
        if node.op_type == "Transpose":
            perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
            if perm != [0, 1, 3, 2]:
                return [], None
        elif node.op_type == "Mul":
            other = node.input[1] if node.input[0] == tensor else node.input[0]
            if other not in constants or constants[other].size != 1:
                return [], None
        else:
            return [], None
        users = consumers.get(node.output[0], [])
        if len(users) != 1:  # a tensor used elsewhere keeps its repeated shape: leave it
            return [], None
        chain.append((node, tensor))
        tensor = node.output[0]
        node = users[0]


def _attributes(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _unsqueeze_axes(node: onnx.NodeProto, constants: dict[str, np.ndarray]) -> list[int] | None:
    for attribute in node.attribute:
        if attribute.name == "axes":
            return list(attribute.ints)
    if len(node.input) > 1 and node.input[1] in constants:
        return [int(x) for x in constants[node.input[1]].reshape(-1)]
    return None


def producers_and_consumers(graph: onnx.GraphProto) -> tuple[dict[str, onnx.NodeProto],
                                                             dict[str, list[onnx.NodeProto]]]:
    """Return (tensor name -> the node producing it, tensor name -> the nodes reading it)."""
    producers = {out: node for node in graph.node for out in node.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    return producers, consumers


def constant_values(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    """Return the values of small initializers and Constant nodes, by tensor name."""
    values = {init.name: numpy_helper.to_array(init) for init in graph.initializer
              if init.data_location != onnx.TensorProto.EXTERNAL and _small(init)}
    for node in graph.node:
        if node.op_type == "Constant":
            for attribute in node.attribute:
                if attribute.name == "value":
                    values[node.output[0]] = numpy_helper.to_array(attribute.t)
    return values


def _small(init: onnx.TensorProto) -> bool:
    return int(np.prod(init.dims)) <= 16 if init.dims else True


def add_int64_constant(graph: onnx.GraphProto, name: str, values: list[int]) -> str:
    """Add an int64 initializer (a shape for Reshape, typically); return its name."""
    graph.initializer.append(numpy_helper.from_array(np.asarray(values, dtype=np.int64), name))
    return name


def _remove_constants(graph: onnx.GraphProto, names: list[str]) -> None:
    keep = [init for init in graph.initializer if init.name not in names]
    del graph.initializer[:]
    graph.initializer.extend(keep)


def remove_dead_nodes(graph: onnx.GraphProto) -> None:
    """Drop nodes (the old repeat_kv copies, shape arithmetic) no graph output depends on."""
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in graph.node for a in n.attribute):
        return  # subgraphs may read outer names; dead nodes only cost memory, so keep them
    needed = {output.name for output in graph.output}
    kept: list[onnx.NodeProto] = []
    for node in reversed(graph.node):
        if any(out in needed for out in node.output):
            kept.append(node)
            needed.update(node.input)
    kept.reverse()
    del graph.node[:]
    graph.node.extend(kept)
    used = {name for node in graph.node for name in node.input}
    initializers = [init for init in graph.initializer if init.name in used]
    del graph.initializer[:]
    graph.initializer.extend(initializers)
