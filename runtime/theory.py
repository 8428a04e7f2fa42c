"""The speedup speculative decoding should give, from Leviathan et al. 2023 (Theorem 3.8)."""

from __future__ import annotations

from typing import Callable

import numpy as np


def expected_tokens_per_iteration(alpha: float, k: int) -> float:
    """Return E[tokens committed per target call] = (1 - alpha^(k+1)) / (1 - alpha) (k+1 when alpha = 1)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, k: int, cost_ratio: float, verify_cost: float = 0.0) -> float:
    """Return the expected walltime speedup over target-only decoding.

    Theorem 3.8: (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1)). alpha: per-token acceptance
    probability; k: draft tokens per iteration; cost_ratio c: one draft call over one target
    call. The paper takes a (k+1)-token target call to cost one plain step; `verify_cost`
    (v) adds v * k target steps for the k extra tokens, as measured on hardware where
    verification is not free (0 keeps the paper's formula). k = 0 is plain decoding: 1.0.
    """
    if k <= 0:
        return 1.0
    return expected_tokens_per_iteration(alpha, k) / (k * (cost_ratio + verify_cost) + 1.0)


def expected_speedup_over_lengths(alpha: float, draft_lengths: dict[int, int], cost_ratio: float,
                                  verify_cost: float = 0.0,
                                  call_cost: Callable[[int], float] | None = None) -> float:
    """Return Theorem 3.8's speedup over iterations that drafted different K (k -> iteration count).

    Per iteration with k drafts: (1 - alpha^(k+1)) / (1 - alpha) expected tokens for
    k c + call_cost(k + 1) target-step units, call_cost defaulting to the line
    1 + verify_cost k; plain iterations (k = 0) count 1 token for 1 unit. A drafter that
    often finds fewer than K tokens (n-gram) is judged on what it drafted.
    """
    cost_of_call = call_cost or (lambda n: 1.0 + verify_cost * (n - 1))
    tokens = cost = 0.0
    for k, count in draft_lengths.items():
        tokens += count * expected_tokens_per_iteration(alpha, k)
        cost += count * (k * cost_ratio + (cost_of_call(k + 1) if k > 0 else 1.0))
    return tokens / cost if cost else 1.0


def best_draft_length(alpha: float, cost_ratio: float, max_k: int, verify_cost: float = 0.0,
                      call_cost: Callable[[int], float] | None = None) -> tuple[int, float]:
    """Return (k, expected speedup) maximising the expected speedup over k = 0..max_k (0: do not draft).

    call_cost(n): a target call over n tokens in 1-token calls (default: the line
    1 + verify_cost (n - 1)); k drafts cost k c + call_cost(k + 1).
    """
    cost_of_call = call_cost or (lambda n: 1.0 + verify_cost * (n - 1))
    speedups = [1.0] + [expected_tokens_per_iteration(alpha, k) / (k * cost_ratio + cost_of_call(k + 1))
                        for k in range(1, max_k + 1)]
    best = int(np.argmax(speedups))
    return best, speedups[best]


def verify_cost_per_token(step_seconds: list[float]) -> float:
    """Return v, the extra cost of each verified token beyond the first, in 1-token calls.

    step_seconds[n - 1] is the time of one target call over n tokens; see verify_cost_from_calls.
    """
    return verify_cost_from_calls({n: t for n, t in enumerate(step_seconds, start=1)})


def verify_cost_from_calls(seconds_by_tokens: dict[int, float], weights: dict[int, float] | None = None) -> float:
    """Return v from call times by tokens per call (n -> seconds; n = 1 must be there).

    v is the least-squares slope of t(n) / t(1) - 1 against n - 1 (a line through the
    1-token point), each length weighted by `weights` (default 1), floored at 0; 0 when
    there is no 1-token time or no other length.
    """
    base = seconds_by_tokens.get(1, 0.0)
    if base <= 0:
        return 0.0
    num = den = 0.0
    for n, seconds in seconds_by_tokens.items():
        weight = (weights or {}).get(n, 1.0)
        num += weight * (n - 1) * (seconds / base - 1.0)
        den += weight * (n - 1) ** 2
    return max(num / den, 0.0) if den else 0.0
