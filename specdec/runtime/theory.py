"""The speedup speculative decoding should give: Leviathan et al. 2023, Theorem 3.8, with a call-cost function.

The paper takes a target call over k+1 tokens to cost one plain step. On real hardware it
costs call_cost(k+1) steps, measured (specdec/runtime/call_costs.py); every formula here takes that
function, and `paper_call_cost` gives the paper's numbers back.
"""

from __future__ import annotations

from typing import Callable

CallCost = Callable[[int], float]  # n tokens in one target call -> its cost in 1-token calls


def paper_call_cost(tokens: int) -> float:
    """Return 1.0: the paper's assumption that a call costs one step whatever its length."""
    return 1.0


def linear_call_cost(verify_cost: float) -> CallCost:
    """Return the call cost 1 + verify_cost * (n - 1): each verified token beyond the first adds v steps."""
    return lambda tokens: 1.0 + verify_cost * (tokens - 1)


def expected_tokens_per_iteration(alpha: float, k: int) -> float:
    """Return E[tokens committed per target call] = (1 - alpha^(k+1)) / (1 - alpha) (k+1 when alpha = 1)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_speedup_over_lengths(alpha: float, draft_lengths: dict[int, int], cost_ratio: float,
                                  call_cost: CallCost = paper_call_cost) -> float:
    """Return the expected walltime speedup over target-only decoding of iterations drafting various K.

    draft_lengths: k -> iteration count. An iteration with k drafts yields
    (1 - alpha^(k+1)) / (1 - alpha) tokens for k c + call_cost(k + 1) target steps (c:
    one draft call over one 1-token target call); a plain one (k = 0) 1 token for 1 step.
    A drafter that often finds fewer than K tokens (n-gram) is judged on what it drafted.
    """
    tokens = cost = 0.0
    for k, count in draft_lengths.items():
        tokens += count * expected_tokens_per_iteration(alpha, k)
        cost += count * (k * cost_ratio + call_cost(k + 1) if k > 0 else 1.0)
    return tokens / cost if cost else 1.0


def expected_speedup(alpha: float, k: int, cost_ratio: float, call_cost: CallCost = paper_call_cost) -> float:
    """Return Theorem 3.8's speedup for K = k every iteration: (1 - alpha^(k+1)) / ((1 - alpha)(k c + call_cost(k+1)))."""
    return expected_speedup_over_lengths(alpha, {k: 1}, cost_ratio, call_cost)


def best_draft_length(alpha: float, cost_ratio: float, max_k: int,
                      call_cost: CallCost = paper_call_cost) -> tuple[int, float]:
    """Return (k, expected speedup) maximising the expected speedup over k = 0..max_k (0: do not draft)."""
    speedups = [expected_speedup(alpha, k, cost_ratio, call_cost) for k in range(max_k + 1)]
    best = max(range(max_k + 1), key=speedups.__getitem__)
    return best, speedups[best]
