"""What one target call over n tokens costs, relative to a 1-token call: a table per n, kept from timings.

Pure bookkeeping over numbers; timing calls is specdec/runtime/calibration.py's job. A table, not a
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
    have `min_calls` fresh calls (1 guessed from the lengths timed when it has too few, as with
    a drafter that always drafts: `_one_token_guess`); else, between two measured lengths, the
    line between them; else the `prior` table (what `specdec tune` or calibration
    measured); else a least-squares line through the lengths measured so far; else one
    through the prior table; else the prior line 1 + prior_verify_cost (n - 1). A length
    none of whose last `fresh_calls` calls (all lengths counted) was of it stops being
    trusted, and its old times are dropped when it is next called: the policy avoids
    lengths it believes dear, so a length timed slow once (a cold first call, a busy
    moment) would otherwise never be timed again. The table returned is then made
    non-decreasing in n (a longer call is never cheaper) by pooling, each length weighted by
    the calls behind it, so one noisy length cannot lift every longer one. One object can
    outlive a generation: the curve is a fact of the hardware and the model, not of the prompt.
    """

    prior: dict[int, float] = field(default_factory=dict)  # n -> t(n) / t(1)
    prior_verify_cost: float = 0.0  # v of the prior line, per token beyond the first
    window: int = 16  # recent calls per length whose median is its time
    min_calls: int = 3  # calls of a length before its own median is trusted
    fresh_calls: int = 64  # a length stays trusted while one of the last this many calls was of it
    _recent: dict[int, deque] = field(default_factory=dict)
    _medians: dict[int, float] = field(default_factory=dict)
    _calls: int = 0  # calls observed
    _last_call: dict[int, int] = field(default_factory=dict)  # n -> the number of its latest call
    # An engine's requests share one table from many threads. Under the GIL each step here
    # is atomic enough; a free-threaded Python would iterate a deque while it grows.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    # The last table (its key, the prior it read, the table): every request of a batch asks each step (~70 us).
    _table_cache: tuple | None = field(default=None, repr=False, compare=False)

    def observe(self, tokens: int, seconds: float) -> None:
        """Record one target call over `tokens` tokens that took `seconds`."""
        if tokens < 1 or seconds <= 0:
            return
        with self._lock:
            self._calls += 1
            recent = self._recent.setdefault(tokens, deque(maxlen=self.window))
            if not self._fresh(tokens, self._calls - 1):
                recent.clear()  # times from before a long absence say little about now
                self._medians.pop(tokens, None)
            self._last_call[tokens] = self._calls
            recent.append(seconds)
            if len(recent) >= self.min_calls:
                self._medians[tokens] = statistics.median(recent)

    def _fresh(self, tokens: int, calls: int) -> bool:
        last = self._last_call.get(tokens)
        return last is not None and calls - last < self.fresh_calls

    def table(self, max_tokens: int) -> list[float]:
        """Return [t(0) unused, t(1) = 1, t(2), ..., t(max_tokens)], non-decreasing, in 1-token calls."""
        with self._lock:
            key = (max_tokens, self._calls, self.prior_verify_cost)
            cached = self._table_cache
            if cached is not None and cached[0] == key and cached[1] is self.prior:  # nothing observed since
                return list(cached[2])
            trusted = {n: median for n, median in self._medians.items() if self._fresh(n, self._calls)}
            weights = {n: float(len(self._recent[n])) for n in trusted}
        line = self._line(trusted)
        one_token = trusted.get(1)
        if one_token is None and trusted:
            one_token = self._one_token_guess(trusted, line)
        estimates = {1: 1.0, **{n: self._estimate(n, trusted, one_token, line) for n in range(2, max_tokens + 1)}}
        measured = one_token is not None  # else every ratio is a guess of equal weight
        costs = non_decreasing(estimates, {n: weights.get(n, 1.0) if measured else 1.0 for n in estimates},
                               pinned=1)
        table = [1.0] + [costs[n] for n in range(1, max_tokens + 1)]
        self._table_cache = (key, self.prior, table)
        return list(table)

    def relative(self, tokens: int) -> float:
        """Return t(tokens) / t(1), from `table` over every length known (pooling reads longer ones too)."""
        tokens = max(tokens, 1)
        with self._lock:
            longest = max([tokens, *self.prior, *self._medians])
        return self.table(longest)[tokens]

    def one_token_seconds(self, tokens: int, seconds: float) -> float:
        """Return what a 1-token call would have taken, given a call over `tokens` that took `seconds`."""
        return seconds / self.relative(tokens)

    def _one_token_guess(self, trusted: dict[int, float], line: tuple[float, float] | None) -> float | None:
        """Return a 1-token call's seconds guessed from the lengths timed (None: no basis).

        A drafter that always drafts makes few 1-token calls. Over lengths 3+ tokens apart, the line
        through them; n 1-token calls do a call over n tokens' work, so t(1) >= t(n) / n bounds it.
        Over closer lengths a line multiplies their noise (2- and 3-token calls 5% off put t(1) 11%
        off), so the prior's shape is scaled to their times instead.
        """
        if line is not None and max(trusted) - min(trusted) >= 3:
            return max(sum(line), max(median / n for n, median in trusted.items()))
        scaled = [median / self.prior[n] for n, median in trusted.items() if self.prior.get(n, 0) > 0]
        return statistics.median(scaled) if scaled else None

    def _estimate(self, n: int, trusted: dict[int, float], one_token: float | None,
                  line: tuple[float, float] | None) -> float:
        if one_token is not None:
            if n in trusted:
                return trusted[n] / one_token
            # Between two lengths timed in this run, their line beats a table timed at another moment.
            below = max((m for m in trusted if m < n), default=1)
            above = min((m for m in trusted if m > n), default=None)
            if above is not None:
                low = 1.0 if below == 1 else trusted[below] / one_token
                return low + (trusted[above] / one_token - low) * (n - below) / (above - below)
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


def non_decreasing(costs: dict[int, float], weights: dict[int, float] | None = None,
                   pinned: int | None = None) -> dict[int, float]:
    """Return the non-decreasing costs by call length closest to `costs` (least squares, `weights`, default 1).

    A longer call is never cheaper, so a dip is noise; pooling adjacent violators averages it
    with its neighbours instead of raising every longer call to the highest cost seen, which
    would let one slow length make all longer ones look dear. `pinned` (a length) keeps its
    cost: every pooled value at or below it is held there (t(1) = 1 by definition).
    """
    lengths = sorted(costs)
    blocks: list[list[float]] = []  # [weighted sum, weight, first index, last index]
    for index, n in enumerate(lengths):
        weight = (weights or {}).get(n, 1.0)
        weight = float("inf") if n == pinned else max(weight, 1e-9)
        blocks.append([costs[n] * weight if weight != float("inf") else costs[n], weight, index, index])
        while len(blocks) > 1 and _mean(blocks[-2]) > _mean(blocks[-1]):
            last = blocks.pop()
            blocks[-1] = _pool(blocks[-1], last)
    out = {}
    for block in blocks:
        for index in range(block[2], block[3] + 1):
            out[lengths[index]] = _mean(block)
    return out


def _mean(block: list[float]) -> float:
    total, weight = block[0], block[1]
    return total if weight == float("inf") else total / weight


def _pool(left: list[float], right: list[float]) -> list[float]:
    # A pinned block (infinite weight) keeps its value whatever joins it.
    if left[1] == float("inf") or right[1] == float("inf"):
        value = _mean(left) if left[1] == float("inf") else _mean(right)
        return [value, float("inf"), left[2], right[3]]
    return [left[0] + right[0], left[1] + right[1], left[2], right[3]]


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
