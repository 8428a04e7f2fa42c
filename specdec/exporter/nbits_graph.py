"""Graph rewrites around MatMulNBits quantization: what makes an int4 decoder step fast on a CPU.

A decode step reads every weight once, so its time follows the weight bytes read. Three
rewrites close the gap to onnxruntime-genai's int4 builds (docs/INT4.md has the figures):
- `fold_transposed_weights`: a tied lm_head is exported as MatMul(x, Transpose(embedding));
  the quantizer only takes initializers, so the 113 MB fp32 lm_head of SmolLM2 stayed fp32
  and dominated the step. Folding the Transpose into an initializer lets it be quantized.
- `tie_embedding`: the embedding then reads its rows from the lm_head's int4 blocks
  (GatherBlockQuantized) instead of keeping a second, fp32 copy: the file shrinks, as genai's.
- `fuse_shared_input_matmuls`: MatMulNBits nodes reading the same activation (q/k/v, gate/up)
  become one node with their output rows stacked, then a Split: fewer, larger kernel calls.
  Each output row keeps its own weights and scales, so the result is the same per column.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from specdec.exporter.grouped_attention import producers_and_consumers

MS_DOMAIN = "com.microsoft"


def _initializers(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    return {init.name: init for init in graph.initializer}


def _attributes(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def fold_transposed_weights(model: onnx.ModelProto) -> dict[str, str]:
    """Replace MatMul(x, Transpose(W)) by MatMul(x, W_t) with W_t a new initializer (in place).

    Returns {new initializer name: name of the W it was transposed from}. A Transpose left
    with no consumer is removed; W itself stays when something else (the embedding) reads it.
    """
    graph = model.graph
    inits = _initializers(graph)
    producers, consumers = producers_and_consumers(graph)
    folded: dict[str, str] = {}
    dead: set[int] = set()
    for node in list(graph.node):
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
            continue
        transpose = producers.get(node.input[1])
        if transpose is None or transpose.op_type != "Transpose" or transpose.input[0] not in inits:
            continue
        source = inits[transpose.input[0]]
        perm = _attributes(transpose).get("perm")
        if len(source.dims) != 2 or perm not in (None, [1, 0]):
            continue
        name = f"{source.name}_transposed_for_{node.name.strip('/').replace('/', '_') or 'matmul'}"
        weight = np.ascontiguousarray(numpy_helper.to_array(source).T)
        graph.initializer.append(numpy_helper.from_array(weight, name))
        node.input[1] = name
        folded[name] = source.name
        if all(c is node for c in consumers.get(transpose.output[0], [])):
            dead.add(id(transpose))
    keep = [n for n in graph.node if id(n) not in dead]
    del graph.node[:]
    graph.node.extend(keep)
    return folded


def tie_embedding(model: onnx.ModelProto, folded: dict[str, str]) -> str | None:
    """Make the embedding Gather read the int4 lm_head blocks its weights were folded into (in place).

    Returns the name of the fp32 embedding dropped, or None when the graph has no such pair
    (untied weights, 8 bits, or a hidden size that is not a whole number of blocks).
    """
    graph = model.graph
    inits = _initializers(graph)
    for node in graph.node:
        if node.op_type != "MatMulNBits" or node.input[1].removesuffix("_Q4") not in folded or len(node.input) > 3:
            continue
        attrs = _attributes(node)
        hidden, vocab, block = attrs["K"], attrs["N"], attrs["block_size"]
        if attrs["bits"] != 4 or hidden % block:
            return None
        embedding = folded[node.input[1].removesuffix("_Q4")]
        gathers = [g for g in graph.node if g.op_type == "Gather" and g.input[0] == embedding]
        users = [n for n in graph.node if embedding in n.input]
        if len(gathers) != 1 or len(users) != 1 or _attributes(gathers[0]).get("axis", 0) != 0:
            return None
        gather = gathers[0]
        shape = f"{node.input[1]}_as_rows_shape"
        rows = f"{node.input[1]}_as_rows"
        graph.initializer.append(numpy_helper.from_array(np.array([vocab, hidden // 2], dtype=np.int64), shape))
        reshape = helper.make_node("Reshape", [node.input[1], shape], [rows], name=f"{gather.name}_rows")
        quantized = helper.make_node(
            "GatherBlockQuantized", [rows, gather.input[1], node.input[2]], list(gather.output),
            name=f"{gather.name}_int4", domain=MS_DOMAIN, bits=4, block_size=block, gather_axis=0, quantize_axis=1)
        position = list(graph.node).index(gather)
        graph.node.remove(gather)
        graph.node.insert(position, quantized)
        graph.node.insert(position, reshape)
        graph.initializer.remove(inits[embedding])
        return embedding
    return None


def fuse_shared_input_matmuls(model: onnx.ModelProto) -> int:
    """Merge MatMulNBits nodes that read the same input with the same settings into one + Split (in place).

    Returns the number of nodes removed. Only nodes with weights and scales as initializers
    and no zero points or bias are merged.
    """
    graph = model.graph
    inits = _initializers(graph)
    groups: dict[tuple, list[onnx.NodeProto]] = {}
    for node in graph.node:
        if node.op_type != "MatMulNBits" or len(node.input) != 3 or not all(i in inits for i in node.input[1:]):
            continue
        attrs = _attributes(node)
        key = (node.input[0], attrs["K"], attrs["bits"], attrs["block_size"], attrs.get("accuracy_level", 0))
        groups.setdefault(key, []).append(node)
    removed = 0
    for nodes in groups.values():
        if len(nodes) < 2:
            continue
        first = nodes[0]
        attrs = _attributes(first)
        widths = [_attributes(n)["N"] for n in nodes]
        tag = f"{first.name}_fused{len(nodes)}"
        weights = np.concatenate([numpy_helper.to_array(inits[n.input[1]]) for n in nodes], axis=0)
        scales = np.concatenate([numpy_helper.to_array(inits[n.input[2]]) for n in nodes], axis=0)
        graph.initializer.extend([numpy_helper.from_array(weights, f"{tag}_Q"),
                                  numpy_helper.from_array(scales, f"{tag}_scales"),
                                  numpy_helper.from_array(np.array(widths, dtype=np.int64), f"{tag}_split")])
        fused = helper.make_node("MatMulNBits", [first.input[0], f"{tag}_Q", f"{tag}_scales"], [f"{tag}_out"],
                                 name=tag, domain=MS_DOMAIN, **{**attrs, "N": int(sum(widths))})
        split = helper.make_node("Split", [f"{tag}_out", f"{tag}_split"], [n.output[0] for n in nodes],
                                 name=f"{tag}_split", axis=-1)
        position = list(graph.node).index(first)
        for node in nodes:
            graph.node.remove(node)
            for name in node.input[1:]:
                graph.initializer.remove(inits[name])
        graph.node.insert(position, split)
        graph.node.insert(position, fused)
        removed += len(nodes) - 1
    return removed
