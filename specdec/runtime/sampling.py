"""Pure functions that turn logits into the distributions both models sample from.

The same `process_logits` is applied to target rows (p) and draft rows (q): speculative
sampling is exact only when both are processed identically (temperature, top-k, top-p).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np

from specdec.models.errors import GenerationError


MIN_TEMPERATURE = 1e-3  # logits / 1e-3 stays finite for any float32 logit; sharper is greedy in all but name
MAX_TEMPERATURE = 100.0  # flatter than this is uniform noise, most likely a typo


@dataclass(frozen=True)
class SamplingConfig:
    """How logits become a distribution. Temperature 0 means greedy (argmax)."""

    temperature: float = 0.0  # 0: greedy; > 0: softmax(logits / temperature)
    top_k: int = 0  # 0: off; else keep the k most likely tokens
    top_p: float = 1.0  # 1.0: off; else keep the smallest set with mass >= top_p

    @property
    def greedy(self) -> bool:
        """Return True when decoding is argmax (temperature 0)."""
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise GenerationError if a setting has the wrong type or is out of range."""
        for name, kind in (("temperature", "a number"), ("top_p", "a number"), ("top_k", "an integer")):
            value = getattr(self, name)
            ok = isinstance(value, numbers.Integral if kind == "an integer" else numbers.Real)
            if not ok or isinstance(value, bool):
                raise GenerationError(f"{name} must be {kind}, got {value!r}")
        t = self.temperature
        # Below MIN_TEMPERATURE logits / t overflows float64 (1e-310 gave NaN probabilities).
        if not np.isfinite(t) or t < 0 or 0 < t < MIN_TEMPERATURE or t > MAX_TEMPERATURE:
            raise GenerationError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], "
                                  f"got {t}")
        if not 0.0 < self.top_p <= 1.0:
            raise GenerationError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise GenerationError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}")


def process_logits(logits: np.ndarray, config: SamplingConfig) -> np.ndarray:
    """Return probabilities [rows, vocab] (float64, rows sum to 1) from logits [rows, vocab].

    Greedy gives a one-hot row at the argmax, so a greedy draft is never scored with a
    softmax q. Otherwise: divide by temperature, keep top-k, keep top-p, softmax.
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be [rows, vocab], got shape {logits.shape}")
    rows, vocab = logits.shape
    if config.greedy:
        probs = np.zeros((rows, vocab), dtype=np.float64)
        probs[np.arange(rows), np.argmax(logits, axis=-1)] = 1.0
        return probs
    scaled = logits.astype(np.float64) / config.temperature
    if 0 < config.top_k < vocab:
        # kth largest value per row; ties at the threshold are all kept, as transformers does.
        kth = np.partition(scaled, vocab - config.top_k, axis=-1)[:, vocab - config.top_k, None]
        scaled = np.where(scaled < kth, -np.inf, scaled)
    probs = _softmax(scaled)
    if config.top_p < 1.0:
        order = np.argsort(-probs, axis=-1, kind="stable")
        sorted_probs = np.take_along_axis(probs, order, axis=-1)
        # Keep a token if the mass strictly before it is < top_p: the most likely token always stays.
        mass_before = np.cumsum(sorted_probs, axis=-1) - sorted_probs
        keep_sorted = mass_before < config.top_p
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def _softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - np.max(x, axis=-1, keepdims=True)
    e = np.exp(shifted)
    return e / e.sum(axis=-1, keepdims=True)


def sample_token(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Return one token id drawn from a probability row [vocab] (inverse CDF, one uniform draw)."""
    cdf = np.cumsum(probs)
    u = rng.random() * cdf[-1]
    return int(min(np.searchsorted(cdf, u, side="right"), probs.shape[0] - 1))


def next_token(logits_row: np.ndarray, config: SamplingConfig, rng: np.random.Generator) -> int:
    """Return the next token for one logits row [vocab]: argmax when greedy, else a sample."""
    if config.greedy:
        return int(np.argmax(logits_row))
    return sample_token(process_logits(logits_row[None, :], config)[0], rng)
