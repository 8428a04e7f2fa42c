"""The exporter's optimization stage: onnxruntime's transformer fusions, where they pay off.

What runs for a family is decided in `models/architectures.py` (`ort_fusion_type`), from
measurement on this project's machines; a family without one keeps the plain graph, and
the manifest says so.
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

from specdec.models.architectures import ArchitectureSpec
from specdec.models.manifest import sha256_of_file


@dataclass(frozen=True)
class OptimizationReport:
    """What the optimization stage did to one graph."""

    applied: list[str] = field(default_factory=list)  # empty: the plain optimum graph is kept
    fused_operators: dict[str, int] = field(default_factory=dict)
    sha256_before: str = ""
    sha256_after: str = ""
    note: str = ""  # why nothing was applied, if so

    def as_dict(self) -> dict[str, Any]:
        """Return the report as JSON-ready data (stored in the manifest)."""
        return asdict(self)


def optimize_graph(graph_path: Path, arch: ArchitectureSpec, config: dict[str, Any]) -> OptimizationReport:
    """Rewrite `graph_path` in place with onnxruntime's fusions for its family; return what was done.

    The graph keeps its inputs and outputs (names, shapes), so the runtime drives it the same way.
    """
    before = sha256_of_file(graph_path)
    if not arch.ort_fusion_type:
        return OptimizationReport(sha256_before=before, sha256_after=before,
                                  note=f"no fusion measured to help the {arch.family} family; plain graph kept")
    if any(t.data_location == onnx.TensorProto.EXTERNAL
           for t in onnx.load(str(graph_path), load_external_data=False).graph.initializer):
        return OptimizationReport(sha256_before=before, sha256_after=before,
                                  note="graph keeps its weights in external data (> 2 GB); plain graph kept")
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    options = FusionOptions(arch.ort_fusion_type)
    # Attention fusion would change the past/present interface the runtime drives; keep it off.
    options.enable_attention = False
    heads = config.get(arch.heads_key) or 0
    hidden = config.get(arch.hidden_key) or 0
    quiet = io.StringIO()
    logging.getLogger("onnxruntime.transformers").setLevel(logging.ERROR)
    with contextlib.redirect_stdout(quiet):
        model = optimize_model(str(graph_path), model_type=arch.ort_fusion_type, num_heads=int(heads),
                               hidden_size=int(hidden), optimization_options=options, opt_level=0)
        fused = {op: count for op, count in model.get_fused_operator_statistics().items() if count}
        temporary = graph_path.with_suffix(".optimized.onnx")
        model.save_model_to_file(str(temporary), use_external_data_format=False)
    os.replace(temporary, graph_path)
    return OptimizationReport(applied=[f"onnxruntime transformers optimizer ({arch.ort_fusion_type} fusions)"],
                              fused_operators=fused, sha256_before=before, sha256_after=sha256_of_file(graph_path))
