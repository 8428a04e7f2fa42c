"""Pure functions that turn logits into the distributions both models sample from.

The same `process_logits` is applied to target rows (p) and draft rows (q): speculative
sampling is exact only when both are processed identically (logit bias, repetition, frequency and
presence penalties, temperature, top-k, top-p, min-p), each row seeing the tokens before its own position.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from specdec.models.errors import GenerationError


MIN_TEMPERATURE = 1e-3  # logits / 1e-3 stays finite for any float32 logit; sharper is greedy in all but name
MAX_TEMPERATURE = 100.0  # flatter than this is uniform noise, most likely a typo
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token, +100 forces it
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 10.0  # beyond them a logit / penalty overflows or is noise
MAX_OPENAI_PENALTY = 2.0  # OpenAI's range for presence_penalty and frequency_penalty: [-2, 2]


@dataclass(frozen=True)
class SamplingConfig:
    """How logits become a distribution. Temperature 0 means greedy (argmax)."""

    temperature: float = 0.0  # 0: greedy; > 0: softmax(logits / temperature)
    top_k: int = 0  # 0: off; else keep the k most likely tokens
    top_p: float = 1.0  # 1.0: off; else keep the smallest set with mass >= top_p
    min_p: float = 0.0  # 0: off; else drop tokens less likely than min_p x the most likely one
    # 1: off; > 1: a token already in the context has its logit divided (if > 0) or multiplied by this
    # (CTRL's rule, as transformers and vLLM apply it over prompt and output)
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, value added to its logit), OpenAI's logit_bias
    # OpenAI's penalties: logit[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty, where c[j]
    # counts token j in the output so far (`seen` from index output_start on; the prompt is not counted,
    # as OpenAI's formula and vLLM have it).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    output_start: int = 0  # where the output begins in each `seen` row (the prompt's length)
    # A caller reads the logits themselves (logprobs, a grammar's mask): calls may not read the greedy
    # LM head, which gives the argmax and not the logits.
    needs_logits: bool = False

    @property
    def greedy(self) -> bool:
        """Return True when decoding is argmax (temperature 0)."""
        return self.temperature == 0.0

    @property
    def reads_context(self) -> bool:
        """Return True when a row's processing depends on the tokens before it (a penalty)."""
        return self.repetition_penalty != 1.0 or self.counts_output

    @property
    def counts_output(self) -> bool:
        """Return True when the presence or frequency penalty is on (they count the output's tokens)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def raw_argmax(self) -> bool:
        """Return True when the next token is the argmax of the model's own logits: greedy, no bias, no
        penalty. Only then may a call read a greedy LM head, which gives the argmax and not the logits."""
        return self.greedy and not self.logit_bias and not self.reads_context and not self.needs_logits

    def validate(self) -> None:
        """Raise GenerationError if a setting has the wrong type or is out of range."""
        for name, kind in (("temperature", "a number"), ("top_p", "a number"), ("top_k", "an integer"),
                           ("min_p", "a number"), ("repetition_penalty", "a number"),
                           ("presence_penalty", "a number"), ("frequency_penalty", "a number")):
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
        if not 0.0 <= self.min_p <= 1.0:
            raise GenerationError(f"min_p must be in [0, 1], got {self.min_p}")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise GenerationError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}], "
                                  f"got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value) or abs(value) > MAX_OPENAI_PENALTY:
                raise GenerationError(f"{name} must be in [-{MAX_OPENAI_PENALTY:g}, {MAX_OPENAI_PENALTY:g}], got {value}")
        for token, bias in self.logit_bias:
            if not isinstance(token, numbers.Integral) or isinstance(token, bool) or token < 0:
                raise GenerationError(f"logit_bias token ids must be integers >= 0, got {token!r}")
            if not isinstance(bias, numbers.Real) or not math.isfinite(bias) or abs(bias) > MAX_LOGIT_BIAS:
                raise GenerationError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                                      f"got {bias!r} for token {token}")


def seen_before_rows(context: Sequence[int], drafts: Sequence[int], rows: int) -> list[list[int]]:
    """Return, for each of `rows` rows of a call that scores the tokens after `context` and after each
    draft, the tokens before that row's position: context, context + drafts[:1], ..."""
    return [list(context) + list(drafts[:row]) for row in range(rows)]


def adjust_logits(logits: np.ndarray, config: SamplingConfig, seen: Sequence[Sequence[int]] | None,
                  mask: np.ndarray | None = None) -> np.ndarray:
    """Return logits [rows, vocab] with the logit bias added, then the repetition penalty, then the frequency and
    presence penalties applied (vLLM's order; float64; the input itself when none is set). `seen[r]`: the tokens
    before row r, the prompt's included (needed with a penalty). mask [rows, vocab] bool: a grammar's allowed
    tokens (specdec/runtime/grammar.py); the others get -inf, last, so that every later step sees them gone."""
    if not config.logit_bias and not config.reads_context:
        return logits if mask is None else np.where(mask, logits, -np.inf)
    adjusted = logits.astype(np.float64)  # a copy: the caller's logits stay as the model gave them
    vocab = adjusted.shape[-1]
    for token, bias in config.logit_bias:
        if token < vocab:
            adjusted[:, token] += bias
    if config.reads_context:
        if seen is None or len(seen) != adjusted.shape[0]:
            raise ValueError("a penalty needs the tokens seen before each row")
        penalty = config.repetition_penalty
        for row, tokens in enumerate(seen):
            if penalty != 1.0:
                ids = np.unique(np.asarray(tokens, dtype=np.int64))
                ids = ids[ids < vocab]
                values = adjusted[row, ids]
                adjusted[row, ids] = np.where(values > 0, values / penalty, values * penalty)
            if config.counts_output:
                ids, counts = np.unique(np.asarray(tokens[config.output_start:], dtype=np.int64), return_counts=True)
                inside = ids < vocab
                adjusted[row, ids[inside]] -= counts[inside] * config.frequency_penalty + config.presence_penalty
    return adjusted if mask is None else np.where(mask, adjusted, -np.inf)


def process_logits(logits: np.ndarray, config: SamplingConfig,
                   seen: Sequence[Sequence[int]] | None = None, mask: np.ndarray | None = None) -> np.ndarray:
    """Return probabilities [rows, vocab] (float64, rows sum to 1) from logits [rows, vocab].

    First the logit bias, the penalties (`seen[r]`: the tokens before row r) and a grammar's mask. Greedy then
    gives a one-hot row at the argmax, so a greedy draft is never scored with a softmax q. Otherwise:
    divide by temperature, keep top-k, keep top-p, keep min-p, softmax (transformers' order).
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be [rows, vocab], got shape {logits.shape}")
    rows, vocab = logits.shape
    logits = adjust_logits(logits, config, seen, mask)
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
    if config.min_p > 0.0:  # relative to the row's most likely token, which always stays
        probs = np.where(probs >= config.min_p * probs.max(axis=-1, keepdims=True), probs, 0.0)
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


def next_token(logits_row: np.ndarray, config: SamplingConfig, rng: np.random.Generator,
               seen: Sequence[int] = (), mask: np.ndarray | None = None) -> int:
    """Return the next token for one logits row [vocab] after the tokens `seen` (mask [vocab]: the allowed
    tokens): argmax when greedy, else a sample."""
    rows_mask = None if mask is None else mask[None, :]
    if config.greedy:
        return int(np.argmax(adjust_logits(logits_row[None, :], config, [seen], rows_mask)[0]))
    return sample_token(process_logits(logits_row[None, :], config, [seen], rows_mask)[0], rng)


def greedy_tokens(logits: np.ndarray, config: SamplingConfig, seen: Sequence[Sequence[int]] | None,
                  mask: np.ndarray | None = None) -> np.ndarray:
    """Return each row's argmax [rows] after the logit bias, the penalties and a grammar's mask [rows, vocab]."""
    return np.argmax(adjust_logits(logits, config, seen, mask), axis=-1)
