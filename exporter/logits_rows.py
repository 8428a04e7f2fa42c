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
    starts, ends, axes = (f"specdec_logits_rows_{part}" for part in ("starts", "ends", "axes"))
    sliced = f"{hidden}_trailing_rows"
    graph.initializer.extend([
        numpy_helper.from_array(np.array([np.iinfo(np.int64).max], dtype=np.int64), ends),
        numpy_helper.from_array(np.array([1], dtype=np.int64), axes),
    ])
    graph.input.append(helper.make_tensor_value_info(LOGITS_ROWS_NAME, TensorProto.INT64, [1]))
    negate = helper.make_node("Neg", [LOGITS_ROWS_NAME], [starts], name="specdec_logits_rows_neg")
    cut = helper.make_node("Slice", [hidden, starts, ends, axes], [sliced], name="specdec_logits_rows_slice")
    position = list(graph.node).index(node)
    graph.node.insert(position, cut)
    graph.node.insert(position, negate)
    node.input[0] = sliced
    return True
