"""A second target graph for the batch engine: R sequences of any token counts in ONE call.

onnxruntime's CPU GroupQueryAttention refuses batch > 1 with several new tokens and a past, so a
batch that verifies drafts cannot be one batched call of the plain graph. This graph flattens the
call's tokens into one sequence axis ([1, T]: every projection and MLP reads its weights once for
all of them) and splits it per row before attention: each layer's GroupQueryAttention becomes R
batch-1 ones, row r taking its `row_tokens[r]` tokens, its own past length (`seqlens_k[r]`) and its
own KV slot, bound as inputs `<past name>.<r>` and written in place (outputs `<present name>.<r>`).
Rows compute what batch-1 calls compute, bit for bit (docs/DESIGN.md, "Batched verification").
Weights are shared with the plain graph through one external-data file. A graph whose attention never
runs on one query row (specdec/exporter/attention_rows.py: int4 targets, --exact-steps) keeps that
promise here: every row's own attention gets the throwaway query row.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from specdec.exporter.attention_rows import ATTENTION_PAD_ROWS, strip_attention_pad
from specdec.exporter.onnx_export import external_data_files

RAGGED_FILE = "ragged.onnx"
ROW_TOKENS_NAME = "row_tokens"  # int64 [R]: tokens of each row, in order along the flattened axis
DATA_FILE = "model.onnx.data"


def _attention(node: onnx.NodeProto) -> onnx.NodeProto | None:
    """Return the GroupQueryAttention a top-level node is or wraps (the long-call If's short-call branch)."""
    if node.op_type == "GroupQueryAttention":
        return node
    if node.op_type == "If":
        branch = next(a.g for a in node.attribute if a.name == "else_branch")
        return next((n for n in branch.node if n.op_type == "GroupQueryAttention"), None)
    return None


def ragged_graph(model: onnx.ModelProto, rows: int, seqlens_name: str, query_pad: int = 0) -> int:
    """Rewrite a shared-KV GroupQueryAttention graph into its ragged-rows form (in place); return the layers.
    Raise ValueError (the model untouched) for an attention the rewrite cannot split.

    Each attention's q/k/v [1, T, ...] (packed or not) are split along the tokens by `row_tokens`; row r's op reads
    `seqlens_k[r]` and its own past/present; the row outputs are concatenated back along the tokens. A row may
    have no tokens (a slot no request holds: it costs no MatMul row): its op, which refuses an empty query, gets
    one throwaway row, written past what the slot holds. `query_pad` throwaway rows follow every row's own
    (the attention pad of specdec/exporter/attention_rows.py); rows after a row's own never change its outputs.
    """
    graph = model.graph
    for node in graph.node:  # refuse before changing anything
        op = _attention(node)
        if op is not None and any(list(op.input)[9:]):
            raise ValueError(f"{op.name} has inputs past sin_cache ({', '.join(i for i in op.input[9:] if i)}), "
                             "which the ragged rewrite does not split per row")
    nodes, row_seqlens, row_pads, row_ends, total = _row_inputs(graph, rows, seqlens_name, query_pad)
    layers = 0
    for node in graph.node:
        op = _attention(node)
        if op is None:
            nodes.append(node)
            continue
        inputs, outputs = list(op.input), list(node.output)
        tag = f"ragged_{layers}"
        split = {}  # q (or packed q/k/v), k and v where given: each split along the tokens, row by row
        for index in (0, 1, 2):
            if inputs[index]:
                split[index] = [f"{tag}_in{index}_{r}" for r in range(rows)]
                nodes.append(helper.make_node("Split", [inputs[index], ROW_TOKENS_NAME], split[index], axis=1,
                                              name=f"{tag}_split{index}"))
        for r in range(rows):
            qkv = []
            for index in (0, 1, 2):
                if index in split:
                    padded = f"{split[index][r]}_padded"
                    nodes.append(helper.make_node("Pad", [split[index][r], row_pads[r]], [padded], mode="constant",
                                                  name=f"{tag}_pad{index}_{r}"))
                    qkv.append(padded)
                else:
                    qkv.append("")
            row = helper.make_node(
                op.op_type, [*qkv, f"{inputs[3]}.{r}", f"{inputs[4]}.{r}", row_seqlens[r], total, *inputs[7:9]],
                [f"{tag}_padded_out{r}", f"{outputs[1]}.{r}", f"{outputs[2]}.{r}"], name=f"{tag}_row{r}",
                domain=op.domain)
            row.attribute.extend(op.attribute)
            nodes.append(row)
            nodes.append(helper.make_node("Slice", [f"{tag}_padded_out{r}", _ZERO, row_ends[r], _ONE],
                                          [f"{tag}_out{r}"], name=f"{tag}_keep{r}"))
        nodes.append(helper.make_node("Concat", [f"{tag}_out{r}" for r in range(rows)], [outputs[0]], axis=1,
                                      name=f"{tag}_concat"))
        layers += 1
    del graph.node[:]
    graph.node.extend(nodes)
    inputs = []
    for value in graph.input:
        if value.name.startswith("past_key_values."):
            inputs += [_per_row(value, f"{value.name}.{r}") for r in range(rows)]
        elif value.name == seqlens_name:
            inputs.append(helper.make_tensor_value_info(seqlens_name, TensorProto.INT32, [rows]))
        else:
            inputs.append(value)
    inputs.append(helper.make_tensor_value_info(ROW_TOKENS_NAME, TensorProto.INT64, [rows]))
    outputs = []
    for value in graph.output:
        outputs += ([_per_row(value, f"{value.name}.{r}") for r in range(rows)] if value.name.startswith("present.")
                    else [value])
    del graph.input[:], graph.output[:]
    graph.input.extend(inputs)
    graph.output.extend(outputs)
    return layers


_ZERO, _ONE = "ragged_zero", "ragged_one"  # int64 [1]


def _row_inputs(graph: onnx.GraphProto, rows: int, seqlens_name: str,
                query_pad: int) -> tuple[list[onnx.NodeProto], list[str], list[str], list[str], str]:
    """Return the nodes that compute, once per call, each row's attention inputs, and their names: (nodes, seqlens_k
    per row, Pad widths per row, tokens per row (where its outputs end), total_sequence_length)."""
    attention = next(_attention(n) for n in graph.node if _attention(n) is not None)
    total_name = attention.input[6]
    graph.initializer.extend([
        numpy_helper.from_array(np.array([0], np.int64), _ZERO), numpy_helper.from_array(np.array([1], np.int64), _ONE),
        numpy_helper.from_array(np.zeros(4, np.int64), "ragged_zeros4"),
        numpy_helper.from_array(np.array(query_pad, np.int32), "ragged_query_pad")])
    # extra[r]: throwaway query rows after row r's own: the pad, and one more for a row with no tokens
    nodes = [helper.make_node("Less", [ROW_TOKENS_NAME, _ONE], ["ragged_empty"], name="ragged_empty"),
             helper.make_node("Cast", ["ragged_empty"], ["ragged_fill"], to=TensorProto.INT64, name="ragged_fill"),
             helper.make_node("Add", ["ragged_fill", _ONE if query_pad else _ZERO], ["ragged_extra"],
                              name="ragged_extra"),
             helper.make_node("Cast", ["ragged_extra"], ["ragged_extra32"], to=TensorProto.INT32,
                              name="ragged_extra32"),
             helper.make_node("Add", [seqlens_name, "ragged_extra32"], ["ragged_seqlens_all"], name="ragged_seqlens"),
             helper.make_node("Add", [total_name, "ragged_query_pad"], ["ragged_total"], name="ragged_total")]
    names = [[f"ragged_{part}_row{r}" for r in range(rows)] for part in ("seqlens", "extra", "pads", "ends")]
    seqlens, extra, pads, ends = names
    nodes += [helper.make_node("Split", [whole], parts, axis=0, num_outputs=rows, name=f"ragged_split_{part}")
              for whole, parts, part in (("ragged_seqlens_all", seqlens, "seqlens"), ("ragged_extra", extra, "extra"),
                                         (ROW_TOKENS_NAME, ends, "ends"))]
    # Pad widths of a [1, tokens, width] input: nothing before, extra[r] rows after on the tokens axis
    nodes += [helper.make_node("Concat", ["ragged_zeros4", extra[r], _ZERO], [pads[r]], axis=0,
                               name=f"ragged_pads_row{r}") for r in range(rows)]
    return nodes, seqlens, pads, ends, "ragged_total"


def _per_row(value: onnx.ValueInfoProto, name: str) -> onnx.ValueInfoProto:
    dims = value.type.tensor_type.shape.dim
    shape = [1, dims[1].dim_value or dims[1].dim_param, "capacity", dims[3].dim_value or dims[3].dim_param]
    return helper.make_tensor_value_info(name, value.type.tensor_type.elem_type, shape)


def write_ragged_graph(graph_path: Path, rows: int, seqlens_name: str) -> tuple[Path, int]:
    """Move the graph's weights into one external-data file and write its ragged-rows form beside it, sharing
    them; return (the ragged graph, layers rewritten). Raise ValueError, the graph untouched, where an
    attention cannot be split per row."""
    structure = onnx.load(str(graph_path), load_external_data=False)
    earlier = set(external_data_files(structure)) - {DATA_FILE}  # a large model's own data file(s), if any
    # the attention pad goes on each row's own attention instead
    query_pad = ATTENTION_PAD_ROWS if strip_attention_pad(structure) else 0
    ragged_graph(structure, rows, seqlens_name, query_pad)  # raises here, before any file changes
    model = onnx.load(str(graph_path))
    onnx.save_model(model, str(graph_path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=DATA_FILE, size_threshold=1024)  # the proto now points at the file, no copies
    for name in earlier:  # their tensors are in DATA_FILE now
        graph_path.with_name(name).unlink(missing_ok=True)
    strip_attention_pad(model)
    layers = ragged_graph(model, rows, seqlens_name, query_pad)
    ragged = graph_path.with_name(RAGGED_FILE)
    onnx.save(model, str(ragged))
    return ragged, layers
