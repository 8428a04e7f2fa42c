"""Weight precision of exported graphs: int8 and int4 MatMul weights (onnxruntime MatMulNBits).

Only weights change; inputs, outputs and the KV cache stay float, so the runtime drives a
quantized graph exactly like an fp32 one.

Why not `quantize_dynamic` (MatMulInteger) for int8: it quantizes activations with ONE scale
per tensor, computed over all the tokens of a call. A 5-token verify call then rounds each
token differently from the 1-token calls of plain decoding, and speculative greedy output
stops matching target-only output (seen on the tiny llama: first mismatch at token 16,
well outside a near-tie). MatMulNBits quantizes activations per row (per token), so a
token's result does not depend on its neighbours in the call.

What else is quantized and fused, and why, is in `nbits_graph.py` (figures: docs/INT4.md).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
from pathlib import Path
from typing import Any

from specdec.exporter.nbits_graph import fold_transposed_weights, fuse_shared_input_matmuls, tie_embedding
from specdec.exporter.packed_attention import pack_attention_inputs
from specdec.models.manifest import WEIGHT_DTYPES, sha256_of_file

WEIGHT_CHOICES = WEIGHT_DTYPES
BLOCK_SIZE = 32  # weights per scale: smaller blocks keep more accuracy, cost a little speed (genai's int4: 32)
# MatMulNBits' compute precision on the CPU. Level 4 (int8 compute, genai's choice) is the fastest, and
# its rows are independent of each other (a position scores bit-identically in calls of 1..300 rows).
# But it re-quantizes every activation to int8, so the ~6e-8 by which GroupQueryAttention's 1-row path
# rounds differently from its multi-row one grows into logits up to 1.2 apart (SmolLM2 int4): a
# verify call would disagree with 1-token steps. So an int4 target keeps level 4 and its attention
# never runs on one query row (`attention_rows.pad_attention_queries`, shared KV buffer only).
# Without a shared buffer, or at int8 (not measured), a target takes level 1 (fp32 compute, rows
# independent to ~1e-4, but slower). A draft only shapes proposals: level 4, 1-row calls allowed.
FAST_ACCURACY_LEVEL = 4
EXACT_ACCURACY_LEVEL = 1
TARGET_ACCURACY_LEVEL = EXACT_ACCURACY_LEVEL  # the level whatever the call shape (default of quantize_graph)
DRAFT_ACCURACY_LEVEL = FAST_ACCURACY_LEVEL


def target_precision(weights: str, shared_kv: bool) -> tuple[int, bool]:
    """Return (accuracy_level, pad_attention) for a quantized target graph: the fast kernel with
    every attention call over 2+ query rows where the graph has the shared KV buffer's
    GroupQueryAttention (int4), else fp32 compute and no padding."""
    if weights == "int4" and shared_kv:
        return FAST_ACCURACY_LEVEL, True
    return EXACT_ACCURACY_LEVEL, False


def quantize_graph(graph_path: Path, weights: str, accuracy_level: int = TARGET_ACCURACY_LEVEL) -> dict[str, Any]:
    """Quantize `graph_path` in place to int8 or int4 MatMul weights; return a manifest record.

    `accuracy_level`: MatMulNBits' compute precision (EXACT_ACCURACY_LEVEL keeps a target exact
    whatever its call shapes; FAST_ACCURACY_LEVEL is faster, for drafts, and for targets whose
    attention never runs on one query row: `target_precision`).

    Every MatMul with constant weights is quantized, the lm_head included (a tied one too,
    after folding its Transpose); at int4 a tied embedding then reads the lm_head's blocks;
    MatMuls sharing an input are fused; attention then takes the packed q/k/v projection.
    """
    if weights not in ("int8", "int4"):
        raise ValueError(f"quantize_graph handles int8 and int4, not {weights}")
    before = sha256_of_file(graph_path)
    temporary = graph_path.with_suffix(f".{weights}.onnx")
    logging.getLogger("onnxruntime").setLevel(logging.ERROR)
    bits = 8 if weights == "int8" else 4
    with contextlib.redirect_stdout(io.StringIO()):
        import onnx
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        model = onnx.load(str(graph_path))
        folded = fold_transposed_weights(model)
        quantizer = MatMulNBitsQuantizer(model, bits=bits, block_size=BLOCK_SIZE,
                                         is_symmetric=True, accuracy_level=accuracy_level)
        quantizer.process()
        model = quantizer.model.model
        unquantized = sum(1 for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in
                          {i.name for i in model.graph.initializer})
        tied = tie_embedding(model, folded) if bits == 4 else None
        fused = fuse_shared_input_matmuls(model)
        packed = pack_attention_inputs(model)
        onnx.save(model, str(temporary))
    method = (f"onnxruntime MatMulNBits: MatMul weights {weights}, block {BLOCK_SIZE}, symmetric, "
              f"accuracy level {accuracy_level}")
    os.replace(temporary, graph_path)
    return {"weights": weights, "method": method, "accuracy_level": accuracy_level,
            "lm_head": weights if folded or not unquantized else "fp32",
            "embedding": f"{weights}, the lm_head's blocks (tied)" if tied else "fp32",
            "constant_matmuls_left_fp32": unquantized,
            "matmuls_fused": fused,
            "attention_packed_qkv_rotary_inside": packed,
            "sha256_before": before, "sha256_after": sha256_of_file(graph_path)}
