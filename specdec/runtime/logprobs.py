"""Log-probabilities of committed tokens, read from the target's rows (OpenAI's `logprobs` / `top_logprobs`).

What is reported: log softmax of the target's logits after the logit bias, the penalties and a
grammar's mask, divided by the temperature (1 under greedy), before top-k, top-p and min-p cut the
row. That is vLLM's "processed" logprobs without the truncation, so `top_logprobs` lists real
alternatives and its first entry is the greedy token. Every committed token (accepted draft,
recovered or bonus) is read from the target's row at its own position, never from the draft's q:
the figures are the same with and without drafts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from specdec.runtime.sampling import SamplingConfig, adjust_logits

MAX_TOP_LOGPROBS = 20  # OpenAI's limit


@dataclass(frozen=True)
class TokenLogprobs:
    """The log-probabilities of n committed tokens and of each position's most likely tokens."""

    chosen: np.ndarray  # [n] float64: log p of each committed token
    top_ids: np.ndarray  # [n, top] int64: the top most likely tokens at each position, most likely first
    top_values: np.ndarray  # [n, top] float64: their log p

    def __len__(self) -> int:
        return len(self.chosen)


def log_softmax(x: np.ndarray) -> np.ndarray:
    """Return log softmax over the last axis (float64; -inf entries stay -inf)."""
    x = x.astype(np.float64)
    peak = np.max(x, axis=-1, keepdims=True)
    shifted = x - peak
    return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


def token_logprobs(logits: np.ndarray, tokens: Sequence[int], config: SamplingConfig,
                   seen: Sequence[Sequence[int]] | None, top: int, mask: np.ndarray | None = None) -> TokenLogprobs:
    """Return the TokenLogprobs of `tokens`, token r read from logits row r.

    logits [n, vocab] (rows past len(tokens) are ignored); seen[r]: the tokens before row r (with a penalty);
    mask [n, vocab] bool: a grammar's allowed tokens per row (None: all allowed); top: 0..MAX_TOP_LOGPROBS.
    """
    n = len(tokens)
    if logits.ndim != 2 or logits.shape[0] < n:
        raise ValueError(f"need [>= {n}, vocab] logits, got shape {logits.shape}")
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top must be in 0..{MAX_TOP_LOGPROBS}, got {top}")
    rows = adjust_logits(logits[:n], config, seen[:n] if seen is not None else None,
                         None if mask is None else mask[:n]).astype(np.float64)
    if not config.greedy:
        rows = rows / config.temperature
    values = log_softmax(rows)
    chosen = values[np.arange(n), np.asarray(tokens, dtype=np.int64)]
    if top == 0:
        empty = np.zeros((n, 0))
        return TokenLogprobs(chosen, empty.astype(np.int64), empty)
    # argpartition then a stable sort of the few kept: ties keep the lower id first, as a full sort would
    part = np.argpartition(-values, top - 1, axis=-1)[:, :top]
    order = np.argsort(-np.take_along_axis(values, part, axis=-1), axis=-1, kind="stable")
    top_ids = np.take_along_axis(part, order, axis=-1)
    return TokenLogprobs(chosen, top_ids.astype(np.int64), np.take_along_axis(values, top_ids, axis=-1))
