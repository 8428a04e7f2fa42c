"""Greedy logits from an 8-bit LM head, exact where it matters: the fp32 head's argmax, bounded.

The 8-bit head (onnxruntime MatMulNBits, accuracy level 4, inside the target graph) computes
h' . w'_j, where h' is the hidden state quantized to int8 in blocks of 32 and w'_j the 8-bit row.
The fp32 logit is h . w_j;

    |h . w_j - h' . w'_j| <= |h - h'| |w_j| + |h'| |w_j - w'_j|

(add and subtract h' . w_j; Cauchy-Schwarz twice). |w_j| and |w_j - w'_j| come with the artifact;
|h - h'| is at most half a quantization step per element. Every token whose upper bound reaches
the best lower bound may be the argmax: those rows of the fp32 head are recomputed in float32,
and the rest are set to -inf. The argmax of what this returns is the fp32 head's argmax (up to
ties within float32 rounding), reading ~28 MB instead of 113 MB on SmolLM2. Only the argmax and
the candidates' values are real: greedy decoding's use, and nothing else's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

ACTIVATION_BLOCK = 32  # MatMulNBits quantizes its input in blocks of its block size (32 here)
INT8_LEVELS = 127  # symmetric int8: scale = max |block| / 127
# Room for what the inequality leaves out: the kernel's float32 sums and scale products, relative to
# |h| |w_j|, and the float32 rounding of the norms themselves.
KERNEL_SLACK = 1e-4
BOUND_MARGIN = 1.01
# Calls keeping more rows read the fp32 head: the 8-bit head costs about a millisecond a row (its kernel
# and the bounding), the fp32 one one pass over its weights shared by all rows. SmolLM2, 2 threads,
# AVX2: 9 rows 0.94x the fp32 head's call, 13 rows 1.06x, 17 rows 1.08x.
MAX_ROWS = 10


def activation_error(hidden: np.ndarray, block: int = ACTIVATION_BLOCK) -> np.ndarray:
    """Return, per row of `hidden` [rows, width], an upper bound on |h - h'|, h' its int8 block quantization.

    Rounding to the nearest of steps max|block|/127 moves an element by half a step at most.
    """
    rows, width = hidden.shape
    padded = np.zeros((rows, -(-width // block) * block), dtype=np.float64)
    padded[:, :width] = np.abs(hidden)
    blocks = padded.reshape(rows, -1, block)
    half_steps = blocks.max(axis=2) / INT8_LEVELS / 2  # [rows, blocks]
    counts = np.minimum(block, width - np.arange(blocks.shape[1]) * block)
    return np.sqrt((half_steps ** 2 * counts).sum(axis=1))


def bound_factors(hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Return (per_norm, per_error) [rows] float32: row i's bound on token j is
    per_norm[i] |w_j| + per_error[i] |w_j - w'_j| + KERNEL_SLACK."""
    h_error = activation_error(hidden)
    h_norm = np.linalg.norm(hidden.astype(np.float64), axis=1)
    # Two float32 multiply-adds per token; BOUND_MARGIN covers their rounding many times over.
    return ((BOUND_MARGIN * (h_error + KERNEL_SLACK * h_norm)).astype(np.float32),
            (BOUND_MARGIN * (h_norm + h_error)).astype(np.float32))


def logit_bounds(hidden: np.ndarray, weight_norms: np.ndarray, weight_errors: np.ndarray) -> np.ndarray:
    """Return [rows, vocab] float32: how far each fp32 logit of hidden [rows, width] can be from the 8-bit head's."""
    per_norm, per_error = bound_factors(hidden)
    return per_norm[:, None] * weight_norms + per_error[:, None] * weight_errors + np.float32(KERNEL_SLACK)


def argmax_candidates(approx_row: np.ndarray, bound_row: np.ndarray) -> np.ndarray:
    """Return the token ids whose logit may be the largest: upper bound >= the best lower bound."""
    return np.flatnonzero(approx_row + bound_row >= np.max(approx_row - bound_row))


def near_top_candidates(approx_row: np.ndarray, per_norm: float, per_error: float, weight_norms: np.ndarray,
                        weight_errors: np.ndarray, widest: float) -> np.ndarray:
    """Return argmax_candidates' ids, bounding only the tokens near the top: `widest` >= every token's bound.

    The best lower bound is at least top - widest, so a candidate's 8-bit logit is at least
    top - 2 widest; the other tokens need no bound of their own (a step would otherwise spend
    more on vocab-wide numpy than the 8-bit head saves).
    """
    near = np.flatnonzero(approx_row >= approx_row.max() - 2 * widest)
    bounds = per_norm * weight_norms[near] + per_error * weight_errors[near] + np.float32(KERNEL_SLACK)
    values = approx_row[near]
    return near[values + bounds >= np.max(values - bounds)]


@dataclass
class GreedyHead:
    """What bounds the target graph's 8-bit LM head; `logits` turns its output into greedy logits."""

    weights: np.ndarray  # fp32 [vocab, hidden], memory-mapped: only candidate rows are read
    weight_norms: np.ndarray  # |w_j|, float32
    weight_errors: np.ndarray  # |w_j - w'_j|, float32
    candidates_seen: int = 0  # tokens recomputed in fp32 so far (for diagnostics)

    def __post_init__(self):
        self.max_norm, self.max_error = float(self.weight_norms.max()), float(self.weight_errors.max())

    @classmethod
    def load(cls, artifact: Path, record: dict) -> "GreedyHead":
        """Return the head of a GraphSpec's `greedy_head` record (paths relative to `artifact`)."""
        norms = np.load(artifact / record["norms"]).astype(np.float32)
        return cls(np.load(artifact / record["weights"], mmap_mode="r"), norms[0].copy(), norms[1].copy())

    def logits(self, hidden: np.ndarray, approx: np.ndarray) -> np.ndarray:
        """Return [rows, vocab] float32 for the heads' input rows `hidden` [rows, width] and the 8-bit head's
        logits `approx` [rows, vocab]: the fp32 logit of every token that may be its row's argmax, -inf elsewhere."""
        hidden = np.ascontiguousarray(hidden, dtype=np.float32)
        vocab = approx.shape[1]
        norms, errors = self.weight_norms[:vocab], self.weight_errors[:vocab]
        per_norm, per_error = bound_factors(hidden)
        out = np.full(approx.shape, -np.inf, dtype=np.float32)
        for row in range(approx.shape[0]):
            widest = per_norm[row] * self.max_norm + per_error[row] * self.max_error + KERNEL_SLACK
            candidates = near_top_candidates(approx[row], per_norm[row], per_error[row], norms, errors, widest)
            self.candidates_seen += len(candidates)
            # The same rows and the same h give the same sums: a step and a verify call agree.
            out[row, candidates] = self.weights[candidates] @ hidden[row]
        return out
