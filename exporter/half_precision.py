"""fp16 graphs from a machine without a GPU: export in fp32, then convert the graph to fp16.

optimum exports fp16 only by tracing the model on a GPU (`--device cuda`). The machine
that builds an artifact for an edge GPU box often has none, so `--dtype fp16 --device cpu`
exports in fp32, runs the optimization stage on that graph, and then converts every float
tensor to fp16 with onnxruntime's float16 converter: weights, KV cache, logits; token ids
and lengths stay integers. onnxruntime's CPU provider runs such a graph (in fp32 where it
has no fp16 kernel), so it is validated on the CPU like any other, against PyTorch in fp32
under the fp16 bound. The fused attention of a shared KV buffer (GroupQueryAttention) then
takes fp16, which onnxruntime's CUDA kernel needs.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
from pathlib import Path
from typing import Any

import onnx

from specdec.exporter.onnx_export import external_data_files
from specdec.models.manifest import sha256_of_file

METHOD = "onnxruntime.transformers.float16.convert_float_to_float16 after the fp32 export (keep_io_types=False)"


def convert_graph_to_fp16(graph_path: Path) -> dict[str, Any]:
    """Convert `graph_path` (and its external data, if any) to fp16 in place; return a manifest record.

    A graph whose weights were kept in external data (over 2 GB in fp32) is written back
    with its weights in one external file beside it, `<graph name>.data`; files it used
    before and no longer does are removed.
    """
    from onnxruntime.transformers.float16 import convert_float_to_float16

    before = sha256_of_file(graph_path)
    folder = graph_path.parent
    old_external = _external_files(graph_path)
    model = onnx.load(str(graph_path))  # weights included, wherever they are kept
    logging.getLogger("onnxruntime.transformers").setLevel(logging.ERROR)
    with contextlib.redirect_stdout(io.StringIO()):
        # onnx's shape inference cannot take a model over 2 GB; the converter then relies on
        # the value types the graph already carries.
        converted = convert_float_to_float16(model, keep_io_types=False, disable_shape_infer=bool(old_external))
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
    return {"method": METHOD, "sha256_before": before, "sha256_after": sha256_of_file(graph_path)}


def _external_files(graph_path: Path) -> list[str]:
    return external_data_files(onnx.load(str(graph_path), load_external_data=False))
