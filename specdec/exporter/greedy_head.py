"""A greedy path that reads an int8 copy of the LM head and still picks the fp32 head's argmax.

A 1-token fp32 step on SmolLM2-135M reads ~540 MB of weights, 113 MB of them the LM head
(576 x 49,152); the same graph without it steps in 14.5 ms against 17.5 (docs/DESIGN.md, "Greedy calls through an 8-bit LM head").
Greedy decoding only needs the head's argmax. The exporter gives the target graph a second,
8-bit head (MatMulNBits, accuracy level 4: ~28 MB, ~1.1 ms a row on 2 cores) beside its fp32
one, each reading the kept rows from an index given as an input:

- `lm_head_row_start` / `lm_head_approx_row_start` (int64 [1]): 0 runs that head on every kept
  row, a huge value on none (its output then has 0 rows); a call runs one of the two;
- `lm_head_approx`: the 8-bit head's logits; `lm_head_input`: the rows the heads read;

and writes `greedy_head/lm_head.npy` (the fp32 head, [vocab, hidden], read row by row) and
`greedy_head/norms.npy` ([2, vocab]: |w_j| and |w_j - w'_j|, w' the 8-bit rows as the kernel sees
them). The runtime (`specdec/runtime/greedy_head.py`) bounds every fp32 logit from the 8-bit one and
recomputes in fp32 only the tokens whose bound reaches the best lower bound: on SmolLM2's bench
prompts, 5-50 of 49,152 per token on average.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from specdec.models.errors import ExportError

ROW_START_NAME = "lm_head_row_start"
APPROX_ROW_START_NAME = "lm_head_approx_row_start"
APPROX_NAME = "lm_head_approx"
HEAD_INPUT_NAME = "lm_head_input"
FOLDER = "greedy_head"
HEAD_WEIGHTS, HEAD_NORMS = "lm_head.npy", "norms.npy"
_PREFIX = "specdec_greedy_head_"
_ENDS, _AXES = _PREFIX + "ends", _PREFIX + "axes"


def lm_head_weights(model: onnx.ModelProto, logits_name: str = "logits") -> tuple[onnx.NodeProto, np.ndarray]:
    """Return (the LM head's MatMul, its weights as float32 [vocab, hidden]).

    Raises ExportError unless the logits come from a plain fp32 MatMul with constant weights.
    """
    producers = {out: node for node in model.graph.node for out in node.output}
    initializers = {init.name: init for init in model.graph.initializer}
    node = producers.get(logits_name)
    while node is not None and node.op_type in ("Cast", "Identity"):
        node = producers.get(node.input[0])
    if node is None or node.op_type != "MatMul":
        raise ExportError("--greedy-head needs an fp32 LM head MatMul before the logits")
    weight = node.input[1]
    if weight in initializers:  # [hidden, vocab]
        matrix = numpy_helper.to_array(initializers[weight]).T
    elif (weight in producers and producers[weight].op_type == "Transpose"
          and producers[weight].input[0] in initializers):
        matrix = numpy_helper.to_array(initializers[producers[weight].input[0]])  # tied: the embedding, [vocab, hidden]
    else:
        raise ExportError("--greedy-head: the LM head's weights are not a constant of the graph")
    if matrix.dtype != np.float32 or matrix.ndim != 2:
        raise ExportError(f"--greedy-head needs fp32 LM head weights, got {matrix.dtype}")
    return node, np.ascontiguousarray(matrix)


def split_lm_head(model: onnx.ModelProto, head: onnx.NodeProto, approx: onnx.ModelProto) -> None:
    """Put the 8-bit head graph `approx` beside the fp32 `head`, each behind its row-start input (in place)."""
    graph = model.graph
    hidden = head.input[0]
    graph.initializer.extend([
        numpy_helper.from_array(np.array([np.iinfo(np.int64).max], dtype=np.int64), _ENDS),
        numpy_helper.from_array(np.array([1], dtype=np.int64), _AXES),
    ])
    position = list(graph.node).index(head)
    added = [helper.make_node("Identity", [hidden], [HEAD_INPUT_NAME], name=_PREFIX + "tap")]
    for start, reader in ((ROW_START_NAME, "fp32"), (APPROX_ROW_START_NAME, "int8")):
        graph.input.append(helper.make_tensor_value_info(start, TensorProto.INT64, [1]))
        added.append(helper.make_node("Slice", [hidden, start, _ENDS, _AXES], [f"{hidden}_{reader}_rows"],
                                      name=f"{_PREFIX}{reader}_rows"))
    head.input[0] = f"{hidden}_fp32_rows"
    renamed = {name: _PREFIX + name for name in (init.name for init in approx.graph.initializer)}
    renamed.update({approx.graph.input[0].name: f"{hidden}_int8_rows", approx.graph.output[0].name: APPROX_NAME})
    for node in approx.graph.node:
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.name = _PREFIX + (node.name or node.op_type)
        copy.input[:] = [renamed.get(name, name) for name in node.input]
        copy.output[:] = [renamed.get(name, name) for name in node.output]
        added.append(copy)
    for init in approx.graph.initializer:
        copy = onnx.TensorProto()
        copy.CopyFrom(init)
        copy.name = renamed[init.name]
        graph.initializer.append(copy)
    for offset, node in enumerate(added):
        graph.node.insert(position + offset, node)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    graph.output.extend([
        helper.make_tensor_value_info(HEAD_INPUT_NAME, TensorProto.FLOAT, ["batch_size", "rows", "hidden_size"]),
        helper.make_tensor_value_info(APPROX_NAME, TensorProto.FLOAT, ["batch_size", "rows", "vocab_size"]),
    ])


def head_graph(weights: np.ndarray) -> onnx.ModelProto:
    """Return a graph computing hidden [1, rows, hidden] @ weights.T -> logits [1, rows, vocab] in fp32."""
    vocab, width = weights.shape
    node = helper.make_node("MatMul", ["hidden", "head_weight"], ["logits"])
    graph = helper.make_graph(
        [node], "greedy_head",
        [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, [1, "rows", width])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "rows", vocab])],
        [numpy_helper.from_array(np.ascontiguousarray(weights.T), "head_weight")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def write_greedy_head(graph_path: Path, folder: Path, logits_name: str = "logits") -> dict:
    """Rewrite the target graph at `graph_path` (split_lm_head) and write the head's fp32 rows and norms into `folder`.

    Returns the manifest record: file names relative to the graph's folder, input/output names,
    and what the 8-bit head costs in accuracy (max |w_j - w'_j| / |w_j|).
    """
    import onnxruntime as ort

    from specdec.exporter.quantize import FAST_ACCURACY_LEVEL, quantize_graph

    model = onnx.load(str(graph_path))
    head, weights = lm_head_weights(model, logits_name)
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "head.onnx"
        onnx.save(head_graph(weights), str(path))
        quantize_graph(path, "int8", FAST_ACCURACY_LEVEL)
        approx = onnx.load(str(path))
        # The 8-bit rows as the kernel sees them: a unit vector quantizes exactly, so row k of the
        # identity's output is column k of the dequantized head.
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        width = weights.shape[1]
        seen = session.run(None, {"hidden": np.eye(width, dtype=np.float32)[None]})[0][0].T.astype(np.float64)
    exact = weights.astype(np.float64)
    norms = np.stack([np.linalg.norm(exact, axis=1), np.linalg.norm(exact - seen, axis=1)])
    np.save(folder / HEAD_WEIGHTS, weights)
    np.save(folder / HEAD_NORMS, norms)
    split_lm_head(model, head, approx)
    temporary = graph_path.with_suffix(".greedy.onnx")
    onnx.save(model, str(temporary))
    temporary.replace(graph_path)
    return {"weights": f"{folder.name}/{HEAD_WEIGHTS}", "norms": f"{folder.name}/{HEAD_NORMS}",
            "row_start_name": ROW_START_NAME, "approx_row_start_name": APPROX_ROW_START_NAME,
            "approx_name": APPROX_NAME, "input_name": HEAD_INPUT_NAME,
            "max_relative_weight_error": float((norms[1] / norms[0]).max())}
