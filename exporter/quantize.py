"""Weight precision of exported graphs: int8 and int4 MatMul weights (onnxruntime MatMulNBits).

Only the MatMul weights change; inputs, outputs and the KV cache stay float, so the runtime
drives a quantized graph exactly like an fp32 one.

Why not `quantize_dynamic` (MatMulInteger) for int8: it quantizes activations with ONE scale
per tensor, computed over all the tokens of a call. A 5-token verify call then rounds each
token differently from the 1-token calls of plain decoding, and speculative greedy output
stops matching target-only output (seen on the tiny llama: first mismatch at token 16,
well outside a near-tie). MatMulNBits quantizes activations per row (per token), so a
token's result does not depend on its neighbours in the call.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
from pathlib import Path
from typing import Any

from specdec.models.manifest import sha256_of_file

WEIGHT_CHOICES = ("fp32", "fp16", "int8", "int4")
BLOCK_SIZE = 32  # weights per scale: smaller blocks keep more accuracy, cost a little speed
# accuracy_level 4: MatMulNBits computes in int8 on CPU (activations quantized per row), its fastest kernel.
ACCURACY_LEVEL = 4


def quantize_graph(graph_path: Path, weights: str) -> dict[str, Any]:
    """Quantize the MatMul weights of `graph_path` in place to int8 or int4; return a manifest record."""
    if weights not in ("int8", "int4"):
        raise ValueError(f"quantize_graph handles int8 and int4, not {weights}")
    before = sha256_of_file(graph_path)
    temporary = graph_path.with_suffix(f".{weights}.onnx")
    logging.getLogger("onnxruntime").setLevel(logging.ERROR)
    bits = 8 if weights == "int8" else 4
    with contextlib.redirect_stdout(io.StringIO()):
        import onnx
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        quantizer = MatMulNBitsQuantizer(onnx.load(str(graph_path)), bits=bits, block_size=BLOCK_SIZE,
                                         is_symmetric=True, accuracy_level=ACCURACY_LEVEL)
        quantizer.process()
        quantizer.model.save_model_to_file(str(temporary), use_external_data_format=False)
    method = (f"onnxruntime MatMulNBits: MatMul weights {weights}, block {BLOCK_SIZE}, symmetric, "
              f"accuracy level {ACCURACY_LEVEL}")
    os.replace(temporary, graph_path)
    return {"weights": weights, "method": method, "sha256_before": before, "sha256_after": sha256_of_file(graph_path)}
