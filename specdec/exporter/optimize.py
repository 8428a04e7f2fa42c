"""The exporter's optimization stage: graph rewrites that make decoding faster, where they pay off.

Rewrites, each recorded in the manifest:
- onnxruntime's transformer fusions, for the families `specdec/models/architectures.py` names
  (`ort_fusion_type`), chosen by measurement on this project's machines;
- attention over one shared, preallocated KV buffer per tensor (`shared_kv.py`,
  onnxruntime's GroupQueryAttention), for the families marked `shared_kv_buffer`;
  this changes how the runtime binds the cache, so the manifest's `kv_buffer` says so;
- otherwise grouped-query attention without repeat_kv copies (`grouped_attention.py`),
  for every graph whose KV heads are fewer than its query heads;
- logits for the trailing rows the caller asks for (`logits_rows.py`, a `num_logits_to_keep`
  input; 0 keeps all rows), for every family: a prefill needs one row, not one per prompt token;
  and where the graph's shape allows, the last layer's work after its attention on those rows too;
- under the shared buffer, in float graphs that will not be quantized (`pack_projections`):
  one packed q/k/v and one gate/up MatMul per layer (`packed_matmuls.py`), then the packed
  q/k/v straight into GroupQueryAttention with rotary inside (`packed_attention.py`), as
  onnxruntime-genai's graphs do (figures: docs/FAIR_ANCHORS.md).
A graph neither applies to keeps the plain optimum graph, and the manifest says so.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import onnx

from specdec.exporter.grouped_attention import regroup_attention
from specdec.exporter.logits_rows import LOGITS_ROWS_NAME, keep_trailing_logit_rows, keep_trailing_rows_in_last_layer
from specdec.exporter.packed_attention import pack_attention_inputs
from specdec.exporter.packed_matmuls import pack_shared_input_matmuls
from specdec.exporter.shared_kv import fuse_shared_kv_attention
from specdec.models.architectures import PAST_KEY, PAST_VALUE, PRESENT_KEY, PRESENT_VALUE, ArchitectureSpec
from specdec.models.manifest import sha256_of_file


@dataclass(frozen=True)
class OptimizationReport:
    """What the optimization stage did to one graph."""

    applied: list[str] = field(default_factory=list)  # empty: the plain optimum graph is kept
    fused_operators: dict[str, int] = field(default_factory=dict)
    sha256_before: str = ""
    sha256_after: str = ""
    note: str = ""  # why nothing was applied, if so
    kv_buffer: str = "concat"  # "shared": attention rewritten over one preallocated KV buffer per tensor
    kv_buffer_reason: str | None = None  # why a family keeps the concat cache, where it is known

    def as_dict(self) -> dict[str, Any]:
        """Return the report as JSON-ready data (stored in the manifest)."""
        return asdict(self)


def optimize_graph(graph_path: Path, arch: ArchitectureSpec, config: dict[str, Any],
                   shared_kv: bool = True, pack_projections: bool = True) -> OptimizationReport:
    """Rewrite `graph_path` in place (fusions for its family, attention); return what was done.

    The graph keeps its inputs and outputs, except under a shared KV buffer
    (report.kv_buffer == "shared"): attention_mask goes, seqlens_k and
    total_sequence_length come, and past/present become one buffer per tensor.
    shared_kv=False keeps the concat cache even where the family allows the shared buffer.
    pack_projections=False leaves q/k/v and gate/up as separate MatMuls (the int8/int4 path
    packs its MatMulNBits itself, after quantizing).
    """
    before = sha256_of_file(graph_path)
    if any(t.data_location == onnx.TensorProto.EXTERNAL
           for t in onnx.load(str(graph_path), load_external_data=False).graph.initializer):
        return OptimizationReport(sha256_before=before, sha256_after=before,
                                  note="graph keeps its weights in external data (> 2 GB); plain graph kept")
    heads = int(config.get(arch.heads_key) or 0)
    kv_heads = arch.num_kv_heads(config) if heads else 0
    applied: list[str] = []
    fused: dict[str, int] = {}
    if arch.ort_fusion_type:
        model, fused = _ort_fusions(graph_path, arch, heads, int(config.get(arch.hidden_key) or 0))
        applied.append(f"onnxruntime transformers optimizer ({arch.ort_fusion_type} fusions)")
    else:
        model = onnx.load(str(graph_path))
    kv_buffer = "concat"
    layers = arch.num_layers(config)
    windows = arch.layer_windows(config)
    shared = shared_kv and arch.shared_kv_buffer and fuse_shared_kv_attention(
        model, layers, heads, kv_heads,
        [[PAST_KEY.format(layer=i), PAST_VALUE.format(layer=i)] for i in range(layers)],
        [[PRESENT_KEY.format(layer=i), PRESENT_VALUE.format(layer=i)] for i in range(layers)], windows)
    regrouped = 0 if shared else regroup_attention(model, heads, kv_heads)
    if shared:
        kv_buffer = "shared"
        sliding = sorted({w for w in windows if w})
        applied.append(f"one shared KV buffer per layer: GroupQueryAttention ({shared} layers, "
                       f"{heads} query / {kv_heads} KV heads"
                       + (f", sliding window {', '.join(map(str, sliding))}" if sliding else "") + ")")
        fused["GroupQueryAttention"] = shared
        packed = pack_shared_input_matmuls(model) if pack_projections else 0
        rotary_inside = pack_attention_inputs(model) if packed else 0
        if packed:
            applied.append(f"packed projections: {packed} MatMuls merged into their neighbours sharing an input "
                           "(q/k/v, gate/up)" + (f"; rotary inside GroupQueryAttention ({rotary_inside} layers)"
                                                 if rotary_inside else ""))
            fused["PackedMatMul"] = packed
            if rotary_inside:
                fused.pop("RotaryEmbedding", None)  # the attention op rotates q and k itself now
    reason = arch.concat_reason if not shared and shared_kv else None
    if regrouped:
        applied.append(f"grouped-query attention without repeat_kv copies ({regrouped} MatMuls, "
                       f"{heads} query / {kv_heads} KV heads)")
        fused["GroupedQueryMatMul"] = regrouped
    if keep_trailing_logit_rows(model):
        applied.append(f"logits for the trailing rows asked for ({LOGITS_ROWS_NAME} input)")
        if keep_trailing_rows_in_last_layer(model):
            applied.append("the last layer's o_proj, MLP and final norm on those rows only")
    if not applied:
        return OptimizationReport(sha256_before=before, sha256_after=before, kv_buffer_reason=reason,
                                  note=f"nothing measured to help the {arch.family} family applies; plain graph kept")
    temporary = graph_path.with_suffix(".optimized.onnx")
    onnx.save(model, str(temporary))
    os.replace(temporary, graph_path)
    return OptimizationReport(applied=applied, fused_operators=fused, sha256_before=before,
                              sha256_after=sha256_of_file(graph_path), kv_buffer=kv_buffer,
                              kv_buffer_reason=reason)


def _ort_fusions(graph_path: Path, arch: ArchitectureSpec, heads: int, hidden: int) -> tuple[onnx.ModelProto, dict[str, int]]:
    """Return the graph with onnxruntime's transformer fusions for the family, and the fused-op counts."""
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    options = FusionOptions(arch.ort_fusion_type)
    # Attention fusion would change the past/present interface the runtime drives; keep it off.
    options.enable_attention = False
    for flag in arch.ort_fusions_off:
        setattr(options, flag, False)
    quiet = io.StringIO()
    logging.getLogger("onnxruntime.transformers").setLevel(logging.ERROR)
    with contextlib.redirect_stdout(quiet):
        model = optimize_model(str(graph_path), model_type=arch.ort_fusion_type, num_heads=heads,
                               hidden_size=hidden, optimization_options=options, opt_level=0)
        fused = {op: count for op, count in model.get_fused_operator_statistics().items() if count}
    return model.model, fused
