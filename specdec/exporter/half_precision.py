"""fp16 graphs from a machine without a GPU: export in fp32, then convert the graph to fp16.

optimum exports fp16 only by tracing the model on a GPU (`--device cuda`). The machine
that builds an artifact for an edge GPU box often has none, so `--dtype fp16 --device cpu`
exports in fp32, runs the optimization stage on that graph, and then converts every float
tensor to fp16 with onnxruntime's float16 converter: weights, KV cache, logits; token ids
and lengths stay integers. onnxruntime's CPU provider runs such a graph (in fp32 where it
has no fp16 kernel), so it is validated on the CPU like any other, against PyTorch in fp32
under the fp16 bound. The fused attention of a shared KV buffer (GroupQueryAttention) then
takes fp16, which onnxruntime's CUDA kernel needs.

Rotary angles and norm statistics, which PyTorch computes in fp32 inside a half model, are
put back in fp32 after the conversion (`fp32_islands.py`): converted along with the rest,
a position past 2048 is off by up to 2 rad in fp16 (checked per family at positions
>= 2048 in tests/exporter/test_half_precision.py).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
from pathlib import Path
from typing import Any

import onnx

from specdec.exporter.fp32_islands import find_islands, name_every_node, restore_islands
from specdec.exporter.onnx_export import external_data_files
from specdec.models.manifest import sha256_of_file

METHOD = "onnxruntime.transformers.float16.convert_float_to_float16 after the fp32 export (keep_io_types=False)"
UNGUARDED = " with every tensor fp16 (rotary angles and norm statistics included)"


def convert_graph_to_fp16(graph_path: Path, keep_fp32: bool = True) -> dict[str, Any]:
    """Convert `graph_path` (and its external data, if any) to fp16 in place; return a manifest record.

    keep_fp32 puts rotary angles and norm statistics back in fp32 (the record's `kept_fp32`
    counts the nodes); False converts them too (only to show what that costs).
    A graph whose weights were kept in external data (over 2 GB in fp32) is written back
    with its weights in one external file beside it, `<graph name>.data`; files it used
    before and no longer does are removed.
    """
    from onnxruntime.transformers.float16 import convert_float_to_float16

    before = sha256_of_file(graph_path)
    folder = graph_path.parent
    old_external = _external_files(graph_path)
    model = onnx.load(str(graph_path))  # weights included, wherever they are kept
    structure = onnx.load(str(graph_path), load_external_data=False)  # for type inference under 2 GB
    for graph in (model, structure):
        name_every_node(graph)  # same order, same names
    islands = find_islands(structure) if keep_fp32 else {}
    island = {name for names in islands.values() for name in names}
    island_inputs = {tensor for node in model.graph.node if node.name in island for tensor in node.input}
    fp32_initializers = {init.name: _copy(init) for init in model.graph.initializer if init.name in island_inputs}
    logging.getLogger("onnxruntime.transformers").setLevel(logging.ERROR)
    with contextlib.redirect_stdout(io.StringIO()):
        # onnx's shape inference cannot take a model over 2 GB; the converter then relies on
        # the value types the graph already carries.
        converted = convert_float_to_float16(model, keep_io_types=False, disable_shape_infer=bool(old_external))
    casts = restore_islands(converted, structure, island, fp32_initializers)
    temporary = graph_path.with_suffix(".fp16.onnx")
    if old_external:
        location = f"{graph_path.name}.data"
        onnx.save_model(converted, str(temporary), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=location)
    else:
        onnx.save_model(converted, str(temporary))
    os.replace(temporary, graph_path)
    for name in set(old_external) - set(_external_files(graph_path)):
        (folder / name).unlink(missing_ok=True)
    return {"method": METHOD if keep_fp32 else METHOD + UNGUARDED,
            "kept_fp32": {kind: len(names) for kind, names in islands.items()}, "casts_added": casts,
            "sha256_before": before, "sha256_after": sha256_of_file(graph_path)}


def _copy(tensor: onnx.TensorProto) -> onnx.TensorProto:
    kept = onnx.TensorProto()
    kept.CopyFrom(tensor)
    return kept


def _external_files(graph_path: Path) -> list[str]:
    return external_data_files(onnx.load(str(graph_path), load_external_data=False))
