"""Give a target graph a per-position hidden-state output: the state that feeds its LM head.

EAGLE-1 taps the hidden state after the final norm, the LM head's own input. In fused
graphs the final norm is a SkipSimplifiedLayerNormalization whose *first* output is the
normed state (its fourth output is the residual stream, one norm off): starting from the
LM head's MatMul and walking back only through shape-preserving glue (Cast, Reshape, a
Slice that trims rows for the LM head) lands on the right tensor whatever the fusions.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from specdec.models.errors import ExportError

HIDDEN_OUTPUT = "specdec_hidden"  # name of the added graph output
_LM_HEAD_OPS = ("MatMul", "MatMulNBits", "Gemm")
_GLUE_OPS = ("Cast", "Reshape", "Slice", "Gather", "Identity")


def find_lm_head_input(model: onnx.ModelProto, logits_name: str = "logits") -> str:
    """Return the name of the tensor the LM head multiplies: the per-position hidden state after the final norm.

    Raises ExportError when no MatMul-like node produces `logits` (through casts).
    """
    producer = {out: node for node in model.graph.node for out in node.output}
    node = producer.get(logits_name)
    while node is not None and node.op_type in ("Cast", "Identity"):
        node = producer.get(node.input[0])
    if node is None or node.op_type not in _LM_HEAD_OPS:
        raise ExportError(f"cannot find the LM head: '{logits_name}' is not made by a MatMul "
                          f"(found {node.op_type if node is not None else 'a graph input'})")
    name = node.input[0]
    # Walk back through glue that keeps the values (a rows-trimming Slice, a Reshape, a Cast).
    while name in producer and producer[name].op_type in _GLUE_OPS:
        name = producer[name].input[0]
    return name


def add_hidden_output(source: Path, destination: Path, logits_name: str = "logits") -> str:
    """Write a copy of the graph at `source` to `destination` with the LM head's input as an extra output.

    External weight files are referenced, not copied (both graphs sit in one folder).
    Returns the added output's name. Idempotent: a graph that has it already is copied as is.
    """
    model = onnx.load(str(source), load_external_data=False)
    outputs = [value.name for value in model.graph.output]
    if HIDDEN_OUTPUT not in outputs:
        tapped = find_lm_head_input(model, logits_name)
        model.graph.node.append(onnx.helper.make_node("Identity", [tapped], [HIDDEN_OUTPUT], name="specdec_hidden_tap"))
        logits = next(value for value in model.graph.output if value.name == logits_name)
        elem = logits.type.tensor_type.elem_type
        model.graph.output.append(onnx.helper.make_tensor_value_info(
            HIDDEN_OUTPUT, elem, ["batch_size", "sequence_length", "hidden_size"]))
    onnx.save(model, str(destination))
    return HIDDEN_OUTPUT


def compare_hidden(onnx_hidden: np.ndarray, torch_hidden: np.ndarray) -> float:
    """Return max |difference| between two hidden-state arrays [seq, hidden] of the same prompt."""
    if onnx_hidden.shape != torch_hidden.shape:
        raise ExportError(f"hidden-state output has shape {onnx_hidden.shape}, PyTorch's is {torch_hidden.shape}")
    return float(np.max(np.abs(onnx_hidden.astype(np.float64) - torch_hidden.astype(np.float64))))
