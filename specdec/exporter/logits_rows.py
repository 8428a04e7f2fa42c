"""Logits for the trailing rows a caller needs, not for every position of the call.

A prefill needs the last row only, a verify call its K+1 rows; optimum's graphs run the
lm_head over every position. For a 300-token prompt on SmolLM2-135M the lm_head alone is
300 x 576 x 49152 multiply-adds, most of the prefill's arithmetic beyond the layers.

The rewrite slices the lm_head's input along the sequence axis before its MatMul:

    hidden [b, n, h] -> Slice(starts = -num_logits_to_keep, ends = end, axis 1) -> lm_head -> logits

`num_logits_to_keep` (int64 [1]) is a required input: 0 keeps every row (transformers'
`logits_to_keep` convention; Slice from -0 = 0), and so does a value larger than the call.
It cannot default to 0 through an initializer of the same name: onnxruntime's IO binding
refuses to bind such an input ("Failed to find NodeArg"), so the manifest names the input
(`logits_rows_name`, manifest v4) and the runtime always binds it. The lm_head computes the
same dot products for the rows it keeps, so those rows are bit-identical to the full call's.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from specdec.exporter.grouped_attention import producers_and_consumers

LOGITS_ROWS_NAME = "num_logits_to_keep"
_PASS_THROUGH = ("Cast", "Identity")  # what may sit between the lm_head and the logits output
_LM_HEADS = ("MatMul", "MatMulNBits", "Gemm")
# The slice's parameters, made by keep_trailing_logit_rows and reused by the last-layer rewrite.
_STARTS, _ENDS, _AXES = (f"specdec_logits_rows_{part}" for part in ("starts", "ends", "axes"))


def keep_trailing_logit_rows(model: onnx.ModelProto, logits_name: str = "logits") -> bool:
    """Add the `num_logits_to_keep` input and slice the lm_head's input by it (in place).

    Returns True when rewritten; False, model untouched, when the graph already has the
    input or `logits_name` does not come from a MatMul (through Casts) whose left input
    is the hidden state [batch, sequence, hidden].
    """
    graph = model.graph
    if any(i.name == LOGITS_ROWS_NAME for i in graph.input):
        return False
    producers, _ = producers_and_consumers(graph)
    node = producers.get(logits_name)
    while node is not None and node.op_type in _PASS_THROUGH:
        node = producers.get(node.input[0])
    if node is None or node.op_type not in _LM_HEADS:
        return False
    hidden = node.input[0]
    sliced = f"{hidden}_trailing_rows"
    graph.initializer.extend([
        numpy_helper.from_array(np.array([np.iinfo(np.int64).max], dtype=np.int64), _ENDS),
        numpy_helper.from_array(np.array([1], dtype=np.int64), _AXES),
    ])
    graph.input.append(helper.make_tensor_value_info(LOGITS_ROWS_NAME, TensorProto.INT64, [1]))
    negate = helper.make_node("Neg", [LOGITS_ROWS_NAME], [_STARTS], name="specdec_logits_rows_neg")
    cut = helper.make_node("Slice", [hidden, _STARTS, _ENDS, _AXES], [sliced], name="specdec_logits_rows_slice")
    position = list(graph.node).index(node)
    graph.node.insert(position, cut)
    graph.node.insert(position, negate)
    node.input[0] = sliced
    return True


_ROW_WISE_NORMS = ("SkipSimplifiedLayerNormalization", "SkipLayerNormalization")


def keep_trailing_rows_in_last_layer(model: onnx.ModelProto, logits_name: str = "logits") -> bool:
    """Run the last layer's output projection and MLP on the kept rows only (in place); return whether rewritten.

    Every layer must see every position, since each one's keys and values go to the cache,
    except the last layer's work after its attention: only the rows whose logits are asked
    for read it. Slices the last attention's output and the residual stream entering the
    post-attention norm by `num_logits_to_keep`, so the o_proj, the MLP and the final norm
    run on those rows (1 in a prefill: ~1/30 of SmolLM2's prefill arithmetic). Row-wise
    work on the same rows gives the same numbers. Needs `keep_trailing_logit_rows` first;
    leaves the graph untouched (False) unless everything after that norm is fed only by
    it, the two sliced tensors, constants and the existing logits slice.
    """
    graph = model.graph
    if not any(i.name == LOGITS_ROWS_NAME for i in graph.input):
        return False
    producers, consumers = producers_and_consumers(graph)
    constants = {init.name for init in graph.initializer}
    for node in graph.node:  # and what is computed from them alone (a tied lm_head's Transpose)
        if node.op_type == "Constant" or (node.input and all(name in constants for name in node.input if name)):
            constants.update(node.output)
    attention = [n for n in graph.node if n.op_type in ("GroupQueryAttention", "MultiHeadAttention", "Attention")]
    if not attention:
        return False
    attention_out = attention[-1].output[0]
    readers = consumers.get(attention_out, [])
    if len(readers) != 1 or readers[0].op_type not in _LM_HEADS:
        return False
    o_proj = readers[0]
    readers = consumers.get(o_proj.output[0], [])
    if len(readers) != 1 or readers[0].op_type not in _ROW_WISE_NORMS:
        return False
    norm = readers[0]
    residual = [name for name in norm.input[:2] if name != o_proj.output[0]]
    if len(residual) != 1 or residual[0] in constants:
        return False
    # Everything downstream of the post-attention norm, which will see the kept rows only.
    downstream, frontier = [], [norm]
    seen = {id(norm)}
    while frontier:
        node = frontier.pop()
        downstream.append(node)
        for out in filter(None, node.output):  # "" marks an unused optional output, not a tensor
            for reader in consumers.get(out, []):
                if id(reader) not in seen:
                    seen.add(id(reader))
                    frontier.append(reader)
    produced = {out for node in downstream for out in node.output} | {o_proj.output[0]}
    allowed = produced | constants | {residual[0], _STARTS, ""}
    if any(name not in allowed for node in downstream for name in node.input):
        return False  # something after the norm reads a full-length tensor: slicing would mix row counts
    if not any(out == logits_name for node in downstream for out in node.output):
        return False
    position = list(graph.node).index(o_proj)
    for k, (name, reader) in enumerate(((attention_out, o_proj), (residual[0], norm))):
        sliced = f"{name}_trailing_rows"
        cut = helper.make_node("Slice", [name, _STARTS, _ENDS, _AXES], [sliced],
                               name=f"specdec_last_layer_rows_slice_{k}")
        graph.node.insert(position, cut)
        reader.input[list(reader.input).index(name)] = sliced
    # The Neg that makes the slices' start sat by the lm_head; it reads a graph input only, so it can go first.
    negate = producers[_STARTS]
    graph.node.remove(negate)
    graph.node.insert(0, negate)
    return True
