"""Running optimum's ONNX exporter and reading back what the graph looks like."""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import onnx

from specdec.models.architectures import PAST_KEY, PAST_VALUE, PRESENT_KEY, PRESENT_VALUE
from specdec.models.errors import ExportError

_ELEM_TO_NUMPY = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16"}


@dataclass(frozen=True)
class GraphLayout:
    """Names and KV dtype read from an exported graph."""

    input_ids_name: str
    attention_mask_name: str
    position_ids_name: str | None
    past_names: list[list[str]]
    present_names: list[list[str]]
    logits_name: str
    kv_dtype: str
    files: list[str]  # graph file, then its external data files, relative to the graph's folder


def export_onnx(export_path: str, output_dir: Path, opset: int | None, device: str, dtype: str,
                trust_remote_code: bool, quiet: bool = True, revision: str | None = None) -> Path:
    """Export one decoder with optimum (`text-generation-with-past`); return the model.onnx path.

    The graph takes any number of new tokens on top of a past of any length, which the
    verify step needs. optimum's own validation is skipped: specdec validates afterwards.
    """
    from optimum.exporters.onnx import main_export

    output_dir.mkdir(parents=True, exist_ok=True)
    sink = io.StringIO()
    redirect = contextlib.redirect_stdout(sink) if quiet else contextlib.nullcontext()
    with redirect, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        previous = logging.getLogger("optimum").level
        logging.getLogger("optimum").setLevel(logging.ERROR)
        # optimum's own from_pretrained passes `torch_dtype`, which transformers reports as deprecated: not
        # a call of ours, nothing the user can act on.
        from transformers.utils import logging as transformers_logging
        verbosity = transformers_logging.get_verbosity()
        transformers_logging.set_verbosity_error()
        try:
            main_export(
                export_path,
                output=output_dir,
                task="text-generation-with-past",
                opset=opset,
                device=device,
                dtype="fp16" if dtype == "fp16" else None,
                trust_remote_code=trust_remote_code,
                do_validation=False,
                # The same hub revision as the PyTorch model that validates the graph.
                revision=revision or "main",
                local_files_only=Path(export_path).exists(),
            )
        except Exception as err:
            lines = str(err).strip().splitlines() or [type(err).__name__]
            raise ExportError(f"optimum could not export '{export_path}': {lines[0]}") from None
        finally:
            logging.getLogger("optimum").setLevel(previous)
            transformers_logging.set_verbosity(verbosity)
    graph = output_dir / "model.onnx"
    if not graph.is_file():
        raise ExportError(f"optimum wrote no model.onnx for '{export_path}'")
    return graph


def read_layout(graph_path: Path, num_layers: int) -> GraphLayout:
    """Return the input/output names and KV dtype of an optimum decoder graph.

    Raises ExportError if the graph lacks a past/present tensor for some layer.
    """
    model = onnx.load(str(graph_path), load_external_data=False)
    inputs = {value.name: value for value in model.graph.input}
    outputs = [value.name for value in model.graph.output]
    past, present = [], []
    for layer in range(num_layers):
        pair_in = [PAST_KEY.format(layer=layer), PAST_VALUE.format(layer=layer)]
        pair_out = [PRESENT_KEY.format(layer=layer), PRESENT_VALUE.format(layer=layer)]
        missing = [n for n in pair_in if n not in inputs] + [n for n in pair_out if n not in outputs]
        if missing:
            raise ExportError(f"exported graph lacks KV tensor(s) {', '.join(missing)}: not a with-past decoder")
        past.append(pair_in)
        present.append(pair_out)
    for required in ("input_ids", "attention_mask"):
        if required not in inputs:
            raise ExportError(f"exported graph has no '{required}' input")
    if "logits" not in outputs:
        raise ExportError("exported graph has no 'logits' output")
    kv_dtype, files = _kv_dtype_and_files(model, past[0][0], graph_path.name)
    return GraphLayout(
        input_ids_name="input_ids",
        attention_mask_name="attention_mask",
        position_ids_name="position_ids" if "position_ids" in inputs else None,
        past_names=past,
        present_names=present,
        logits_name="logits",
        kv_dtype=kv_dtype,
        files=files,
    )


def reread_kv_dtype_and_files(graph_path: Path, layout: GraphLayout) -> GraphLayout:
    """Return `layout` with the KV dtype and files of `graph_path` as it is now (after a conversion)."""
    model = onnx.load(str(graph_path), load_external_data=False)
    kv_dtype, files = _kv_dtype_and_files(model, layout.past_names[0][0], graph_path.name)
    return replace(layout, kv_dtype=kv_dtype, files=files)


def _kv_dtype_and_files(model: onnx.ModelProto, past_name: str, graph_name: str) -> tuple[str, list[str]]:
    """Return (numpy dtype name of the past tensor `past_name`, [graph file, external data files...])."""
    elem = next(value for value in model.graph.input if value.name == past_name).type.tensor_type.elem_type
    return _ELEM_TO_NUMPY.get(elem, "float32"), [graph_name] + external_data_files(model)


def external_data_files(model: onnx.ModelProto) -> list[str]:
    """Return the files `model` keeps weights in besides the graph file (relative to its folder; sorted)."""
    return sorted({
        entry.value
        for tensor in model.graph.initializer
        for entry in tensor.external_data
        if entry.key == "location"
    })
