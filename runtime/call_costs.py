"""What one target call over n tokens costs, relative to a 1-token call: a table per n, kept from timings.

Pure bookkeeping over numbers; timing calls is runtime/calibration.py's job. A table, not a
line: on CPUs the cost steps with n (docs/DESIGN.md, "Adaptive K").
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from dataclasses import dataclass, field


@dataclass
class TargetCallCosts:
    """Relative cost t(n) / t(1) of a target call over n tokens, learned from timed calls.

    Each n keeps the median of its last `window` call times: one call can be slow for
    reasons that have nothing to do with n (the OS, the other core), and a mean would
    carry that into every later choice of K. t(n) is measured / measured when both n and 1
    have `min_calls` calls; else the `prior` table (what `specdec tune` measured); else a
    least-squares line through the lengths seen so far; else one through the prior table;
    else the prior line 1 + prior_verify_cost (n - 1). The table returned is then made
    non-decreasing in n, since a longer call is never cheaper and a dip is noise that would
    lure K past the length it dipped at. One object can outlive a generation: the curve is a
    fact of the hardware and the model, not of the prompt.
    """

    prior: dict[int, float] = field(default_factory=dict)  # n -> t(n) / t(1)
    prior_verify_cost: float = 0.0  # v of the prior line, per token beyond the first
    window: int = 16  # recent calls per length whose median is its time
    min_calls: int = 3  # calls of a length before its own median is trusted
    _recent: dict[int, deque] = field(default_factory=dict)
    _medians: dict[int, float] = field(default_factory=dict)
    # An engine's requests share one table from many threads. Under the GIL each step here
    # is atomic enough; a free-threaded Python would iterate a deque while it grows.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def observe(self, tokens: int, seconds: float) -> None:
        """Record one target call over `tokens` tokens that took `seconds`."""
        if tokens < 1 or seconds <= 0:
            return
        with self._lock:
            recent = self._recent.setdefault(tokens, deque(maxlen=self.window))
            recent.append(seconds)
            if len(recent) >= self.min_calls:
                self._medians[tokens] = statistics.median(recent)

    def table(self, max_tokens: int) -> list[float]:
        """Return [t(0) unused, t(1) = 1, t(2), ..., t(max_tokens)], non-decreasing, in 1-token calls."""
        with self._lock:
            trusted = dict(self._medians)
        line = self._line(trusted)
        costs = non_decreasing({1: 1.0, **{n: self._estimate(n, trusted, line) for n in range(2, max_tokens + 1)}})
        return [1.0] + [costs[n] for n in range(1, max_tokens + 1)]

    def relative(self, tokens: int) -> float:
        """Return t(tokens) / t(1), from `table`."""
        return self.table(max(tokens, 1))[max(tokens, 1)]

    def one_token_seconds(self, tokens: int, seconds: float) -> float:
        """Return what a 1-token call would have taken, given a call over `tokens` that took `seconds`."""
        return seconds / self.relative(tokens)

    def _estimate(self, n: int, trusted: dict[int, float], line: tuple[float, float] | None) -> float:
        if 1 in trusted and n in trusted:
            return trusted[n] / trusted[1]
        if n in self.prior:
            return self.prior[n]
        # Beyond the lengths measured, extrapolate: from this run's timings, else from the
        # prior table (a tuned or calibrated table stops at its K cap + 1, and a cap raised
        # later must not read every longer call as free).
        prior_line = self._line({1: 1.0, **self.prior}) if self.prior else None
        for fitted in (line, prior_line):
            if fitted is not None:
                intercept, slope = fitted
                one = intercept + slope
                if one > 0:
                    return (intercept + slope * n) / one
        return 1.0 + self.prior_verify_cost * (n - 1)

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


def non_decreasing(costs: dict[int, float]) -> dict[int, float]:
    """Return the costs by call length with each raised to the highest cost of any shorter call.

    A longer call is never cheaper: a dip is timing noise, and it would lure K to the length it dipped at.
    """
    lifted, highest = {}, float("-inf")
    for n in sorted(costs):
        highest = max(highest, costs[n])
        lifted[n] = highest
    return lifted


def relative_costs_from_step_times(step_seconds: list[float]) -> dict[int, float]:
    """Return {n: t(n) / t(1)} from step_seconds[n - 1], the time of a call over n tokens."""
    if not step_seconds or step_seconds[0] <= 0:
        return {}
    return {n: seconds / step_seconds[0] for n, seconds in enumerate(step_seconds, start=1)}


def verify_cost_from_calls(seconds_by_tokens: dict[int, float], weights: dict[int, float] | None = None) -> float:
    """Return v, the extra cost of each verified token beyond the first, in 1-token calls.

    seconds_by_tokens: n -> seconds of a call over n tokens (n = 1 must be there). v is the
    least-squares slope of t(n) / t(1) - 1 against n - 1 (a line through the 1-token point),
    each length weighted by `weights` (default 1), floored at 0; 0 when there is no 1-token
    time or no other length.
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
