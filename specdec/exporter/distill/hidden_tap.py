"""Give a target graph a per-position hidden-state output: the state that feeds its LM head.

EAGLE-1 taps the hidden state after the final norm, the LM head's own input. In fused
graphs the final norm is a SkipSimplifiedLayerNormalization whose *first* output is the
normed state (its fourth output is the residual stream, one norm off): starting from the
LM head's MatMul and walking back only through shape-preserving glue (Cast, Reshape, a
Slice that trims rows for the LM head) lands on the right tensor whatever the fusions.

EAGLE-3 also reads lower layers. Optionally the output holds, after the last feature, the
normed inputs of chosen decoder layers (what their attention projections read): the first
output of a fused norm, or the final Mul of an unfused one (find_layer_input).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from specdec.exporter.greedy_head import ROW_START_NAME as HEAD_ROW_START  # the greedy head's fp32 head reads it too
from specdec.models.errors import ExportError

HIDDEN_OUTPUT = "specdec_hidden"  # name of the added graph output
_LM_HEAD_OPS = ("MatMul", "MatMulNBits", "Gemm")
_GLUE_OPS = ("Cast", "Reshape", "Slice", "Gather", "Identity")


def _lm_head_node(model: onnx.ModelProto, logits_name: str) -> onnx.NodeProto:
    """Return the MatMul-like node that makes `logits` (through casts); raises ExportError if there is none."""
    producer = {out: node for node in model.graph.node for out in node.output}
    node = producer.get(logits_name)
    while node is not None and node.op_type in ("Cast", "Identity"):
        node = producer.get(node.input[0])
    if node is None or node.op_type not in _LM_HEAD_OPS:
        raise ExportError(f"cannot find the LM head: '{logits_name}' is not made by a MatMul "
                          f"(found {node.op_type if node is not None else 'a graph input'})")
    return node


def find_lm_head_input(model: onnx.ModelProto, logits_name: str = "logits") -> str:
    """Return the name of the tensor the LM head multiplies: the per-position hidden state after the final norm.

    Raises ExportError when no MatMul-like node produces `logits` (through casts).
    """
    producer = {out: node for node in model.graph.node for out in node.output}
    name = _lm_head_node(model, logits_name).input[0]
    # Walk back through glue that keeps the values (a rows-trimming Slice, a Reshape, a Cast).
    while name in producer and producer[name].op_type in _GLUE_OPS:
        name = producer[name].input[0]
    return name


def find_layer_input(model: onnx.ModelProto, layer: int) -> str:
    """Return the name of decoder layer `layer`'s normed input: the `input_layernorm` module's output.

    The exporter names a module's tensors after it (/model/layers.{i}/input_layernorm/...), and
    fusions keep the names of the outputs they replace; the module's output is the one of its
    tensors read outside it. (Norm weights are no guide: equal ones are stored once.)
    Raises ExportError when there is not exactly one such tensor.
    """
    prefix = f"/model/layers.{layer}/input_layernorm/"
    inside = {out for node in model.graph.node for out in node.output if out.startswith(prefix)}
    read_outside = {name for node in model.graph.node if not any(out.startswith(prefix) for out in node.output)
                    for name in node.input if name in inside}
    if len(read_outside) != 1:
        raise ExportError(f"cannot find layer {layer}'s input norm output ('{prefix}...') in the target graph "
                          f"(found {len(read_outside)}): its normed input cannot be tapped for the draft head")
    return read_outside.pop()


def _remove_tap(model: onnx.ModelProto) -> None:
    """Drop an earlier tap (its nodes, constants and the output), so a graph can be tapped again with other layers."""
    kept = [node for node in model.graph.node if not node.name.startswith("specdec_hidden_")]
    del model.graph.node[:]
    model.graph.node.extend(kept)
    constants = [t for t in model.graph.initializer if not t.name.startswith("specdec_hidden_")]
    del model.graph.initializer[:]
    model.graph.initializer.extend(constants)
    outputs = [value for value in model.graph.output if value.name != HIDDEN_OUTPUT]
    del model.graph.output[:]
    model.graph.output.extend(outputs)


def _trailing_rows_of(model: onnx.ModelProto, taps: list[str], like: str) -> list[onnx.NodeProto]:
    """Return nodes slicing each tap [B, T, H] to the trailing rows `like` has (tap + "_specdec_rows").

    A graph whose last layer runs on the kept rows only (num_logits_to_keep) has fewer rows in
    the LM head's input than in earlier layers; hidden-state calls keep every row, so there the
    slice keeps all, and other calls still run a Concat of equal shapes.
    """
    from onnx import numpy_helper

    model.graph.initializer.extend([
        numpy_helper.from_array(np.array([1], np.int64), "specdec_hidden_rows_axis"),
        numpy_helper.from_array(np.array([np.iinfo(np.int64).max], np.int64), "specdec_hidden_rows_end")])
    make = onnx.helper.make_node
    nodes = [make("Shape", [like], ["specdec_hidden_rows_shape"], name="specdec_hidden_rows_shape"),
             make("Gather", ["specdec_hidden_rows_shape", "specdec_hidden_rows_axis"], ["specdec_hidden_rows_count"],
                  name="specdec_hidden_rows_count", axis=0),
             make("Neg", ["specdec_hidden_rows_count"], ["specdec_hidden_rows_start"],
                  name="specdec_hidden_rows_start")]
    bounds = ["specdec_hidden_rows_start", "specdec_hidden_rows_end", "specdec_hidden_rows_axis"]
    for tap in taps:
        nodes.append(make("Slice", [tap, *bounds], [f"{tap}_specdec_rows"], name=f"specdec_hidden_rows_{len(nodes)}"))
    return nodes


def add_head_row_start(model: onnx.ModelProto, logits_name: str = "logits") -> str | None:
    """Make the LM head read its input from row `HEAD_ROW_START` on (a new int64 [1] input; in place).

    A hidden-state call keeps every row through the last layer for the draft's features but
    needs only the trailing rows' logits: without this its LM head runs on every prompt position.
    Returns the input's name, or None where the graph has it already (a greedy head reads the
    same input; a graph tapped before).
    """
    from onnx import TensorProto, helper, numpy_helper

    if any(value.name == HEAD_ROW_START for value in model.graph.input):
        return None
    head = _lm_head_node(model, logits_name)
    rows = f"{head.input[0]}_from_row_start"
    model.graph.initializer.extend([
        numpy_helper.from_array(np.array([np.iinfo(np.int64).max], np.int64), "specdec_head_rows_end"),
        numpy_helper.from_array(np.array([1], np.int64), "specdec_head_rows_axis")])
    model.graph.input.append(helper.make_tensor_value_info(HEAD_ROW_START, TensorProto.INT64, [1]))
    slice_node = helper.make_node("Slice", [head.input[0], HEAD_ROW_START, "specdec_head_rows_end",
                                            "specdec_head_rows_axis"], [rows], name="specdec_head_rows")
    model.graph.node.insert(list(model.graph.node).index(head), slice_node)
    head.input[0] = rows
    return HEAD_ROW_START


def add_hidden_output(source: Path, destination: Path, logits_name: str = "logits",
                      layers: tuple[int, ...] = ()) -> tuple[str, str | None]:
    """Write a copy of the graph at `source` to `destination` with the LM head's input as an extra output.

    With `layers`, the output is [batch, seq, hidden * (1 + len(layers))]: the LM head's input,
    then each layer's normed input. External weight files are referenced, not copied (both
    graphs sit in one folder). An earlier tap is replaced. The LM head gets a row-start input
    (add_head_row_start) where it has none. Returns (the added output's name, the row-start
    input's name or None where the graph had one already).
    """
    model = onnx.load(str(source), load_external_data=False)
    _remove_tap(model)
    row_start = add_head_row_start(model, logits_name)
    tapped = find_lm_head_input(model, logits_name)
    taps = [find_layer_input(model, layer) for layer in layers]
    if taps:
        model.graph.node.extend(_trailing_rows_of(model, taps, like=tapped))
        model.graph.node.append(onnx.helper.make_node("Concat", [tapped] + [f"{t}_specdec_rows" for t in taps],
                                                      [HIDDEN_OUTPUT], name="specdec_hidden_concat", axis=-1))
    else:
        model.graph.node.append(onnx.helper.make_node("Identity", [tapped], [HIDDEN_OUTPUT], name="specdec_hidden_tap"))
    logits = next(value for value in model.graph.output if value.name == logits_name)
    elem = logits.type.tensor_type.elem_type
    model.graph.output.append(onnx.helper.make_tensor_value_info(
        HIDDEN_OUTPUT, elem, ["batch_size", "sequence_length", "hidden_size"]))
    onnx.save(model, str(destination))
    return HIDDEN_OUTPUT, row_start


def compare_hidden(onnx_hidden: np.ndarray, torch_hidden: np.ndarray) -> float:
    """Return max |difference| between two hidden-state arrays [seq, hidden] of the same prompt."""
    if onnx_hidden.shape != torch_hidden.shape:
        raise ExportError(f"hidden-state output has shape {onnx_hidden.shape}, PyTorch's is {torch_hidden.shape}")
    return float(np.max(np.abs(onnx_hidden.astype(np.float64) - torch_hidden.astype(np.float64))))
