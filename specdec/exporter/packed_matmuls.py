"""One float MatMul per shared input: q/k/v as one projection, gate/up as one.

optimum's llama graphs run three MatMuls on the attention's normed input (q, k, v) and two
on the MLP's (gate, up). A 1-token step is a string of small GEMVs whose fixed costs
(a kernel call and a thread-pool dispatch each) are a visible share of the step on a CPU;
onnxruntime-genai's builder writes one packed q/k/v projection per layer instead. This
rewrite stacks the weights of MatMuls that read the same tensor along their output
columns and splits the result: each output column is the same dot product as before, so
results are bit-identical (the int4 path does the same for MatMulNBits in `nbits_graph.py`).
After it, `packed_attention.pack_attention_inputs` can feed GroupQueryAttention the packed
projection with rotary inside, as genai's graphs do.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper


def pack_shared_input_matmuls(model: onnx.ModelProto) -> int:
    """Merge plain MatMuls that read the same input with 2-D float initializer weights into one + Split (in place).

    Returns the number of MatMul nodes removed. Weights shared with other nodes, or of
    different row counts or dtypes, are left alone; the merged node sits where the first
    of its group was, its weight columns in graph order, so the Split's outputs keep the
    original names and order (q, k, v as optimum writes them).
    """
    graph = model.graph
    inits = {init.name: init for init in graph.initializer}
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    groups: dict[tuple, list[onnx.NodeProto]] = {}
    for node in graph.node:
        weight = inits.get(node.input[1]) if node.op_type == "MatMul" and node.domain in ("", "ai.onnx") else None
        if weight is None or len(weight.dims) != 2 or readers[weight.name] != 1 or weight.data_location:
            continue
        groups.setdefault((node.input[0], weight.dims[0], weight.data_type), []).append(node)
    removed = 0
    for nodes in groups.values():
        if len(nodes) < 2:
            continue
        first = nodes[0]
        weights = [numpy_helper.to_array(inits[n.input[1]]) for n in nodes]
        tag = f"{first.name.strip('/').replace('/', '_') or 'matmul'}_packed{len(nodes)}"
        graph.initializer.extend([
            numpy_helper.from_array(np.concatenate(weights, axis=1), f"{tag}_weight"),
            numpy_helper.from_array(np.array([w.shape[1] for w in weights], dtype=np.int64), f"{tag}_split")])
        packed = helper.make_node("MatMul", [first.input[0], f"{tag}_weight"], [f"{tag}_out"], name=tag)
        split = helper.make_node("Split", [f"{tag}_out", f"{tag}_split"], [n.output[0] for n in nodes],
                                 name=f"{tag}_split", axis=-1)
        position = list(graph.node).index(first)
        for node in nodes:
            graph.node.remove(node)
            graph.initializer.remove(inits[node.input[1]])
        graph.node.insert(position, split)
        graph.node.insert(position, packed)
        removed += len(nodes) - 1
    return removed
