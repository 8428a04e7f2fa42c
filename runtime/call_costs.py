"""What one target call over n tokens costs, relative to a 1-token call, on this machine.

The paper takes verification of K+1 tokens to cost one step. On real hardware the cost
grows with n, and not along a line: on a 2-core CPU, SmolLM2-135M's 2-token call costs
~1.09 steps, 3..6 tokens ~1.15-1.18, and 7 tokens jumps to ~1.29 (MLAS packs 6 rows per
block). A line through those points overrates long drafts and underrates the first extra
token, so `auto` picked K worse than a fixed K=4 did (replayed on SmolLM2's greedy
outputs: extract 1.84x against 1.96x with the table below). Hence a table per n.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class TargetCallCosts:
    """Relative cost t(n) / t(1) of a target call over n tokens, learned from timed calls.

    Each n keeps an EWMA of its call seconds. relative(n) is measured / measured when both
    n and 1 have `min_calls` calls; else the `prior` table (what `specdec tune` measured);
    else a least-squares line through the lengths seen so far; else the prior line
    1 + prior_verify_cost (n - 1). One object can outlive a generation: the curve is a
    fact of the hardware and the model, not of the prompt.
    """

    prior: dict[int, float] = field(default_factory=dict)  # n -> t(n) / t(1)
    prior_verify_cost: float = 0.0  # v of the prior line, per token beyond the first
    smoothing: float = 0.1  # EWMA weight of the newest call: single calls are noisy
    min_calls: int = 3  # calls of a length before its own mean is trusted
    _seconds: dict[int, float] = field(default_factory=dict)
    _calls: dict[int, int] = field(default_factory=dict)
    # An engine's requests share one table from many threads; reading it while another
    # thread adds a length would break the iteration.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def observe(self, tokens: int, seconds: float) -> None:
        """Record one target call over `tokens` tokens that took `seconds`."""
        if tokens < 1 or seconds <= 0:
            return
        with self._lock:
            count = self._calls.get(tokens, 0)
            old = self._seconds.get(tokens, seconds)
            # Plain mean for the first few calls, then an EWMA that follows drift.
            weight = max(self.smoothing, 1.0 / (count + 1))
            self._seconds[tokens] = old + weight * (seconds - old)
            self._calls[tokens] = count + 1

    def relative(self, tokens: int) -> float:
        """Return t(tokens) / t(1), at least 1 (a longer call is never cheaper)."""
        if tokens <= 1:
            return 1.0
        trusted = self._trusted()
        if 1 in trusted and tokens in trusted:
            return max(trusted[tokens] / trusted[1], 1.0)
        if tokens in self.prior:
            return max(self.prior[tokens], 1.0)
        line = self._line(trusted)
        if line is not None:
            intercept, slope = line
            one = intercept + slope
            if one > 0:
                return max((intercept + slope * tokens) / one, 1.0)
        return 1.0 + self.prior_verify_cost * (tokens - 1)

    def one_token_seconds(self, tokens: int, seconds: float) -> float:
        """Return what a 1-token call would have taken, given a call over `tokens` that took `seconds`."""
        return seconds / self.relative(tokens)

    def _trusted(self) -> dict[int, float]:
        with self._lock:
            return {n: s for n, s in self._seconds.items() if self._calls[n] >= self.min_calls}

    @staticmethod
    def _line(points: dict[int, float]) -> tuple[float, float] | None:
        """Return (intercept, slope) of the least-squares line t = a + b n, or None under two lengths."""
        if len(points) < 2:
            return None
        mean_n = sum(points) / len(points)
        mean_t = sum(points.values()) / len(points)
        spread = sum((n - mean_n) ** 2 for n in points)
        slope = sum((n - mean_n) * (t - mean_t) for n, t in points.items()) / spread
        return mean_t - slope * mean_n, slope


def relative_costs_from_step_times(step_seconds: list[float]) -> dict[int, float]:
    """Return {n: t(n) / t(1)} from step_seconds[n - 1], the time of a call over n tokens."""
    if not step_seconds or step_seconds[0] <= 0:
        return {}
    return {n: seconds / step_seconds[0] for n, seconds in enumerate(step_seconds, start=1)}
