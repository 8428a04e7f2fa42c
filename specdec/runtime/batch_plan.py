"""Which requests of a batch step speculate: Theorem 3.8 extended to a batch, over measured call costs.

Two call shapes: with the artifact's ragged-rows graph, verify rows join one call with the plain rows
(`choose_draft_lengths_ragged`, which also shortens K); without it, each speculating request has a call of its own
(`choose_speculating`, below).

A step makes one batched call over every request that decodes plainly (one token each, t_b(n)
for n rows) plus one verify call per request that speculates (t_v(k + 1): onnxruntime's
GroupQueryAttention takes several new tokens per call at batch 1 only, docs/DESIGN.md). Moving
request r from the batch into its own verify call adds E_r(k) - 1 expected tokens (E from its own
acceptance estimate) and t_v(k + 1) - (t_b(n) - t_b(n - 1)) seconds. Requests are moved, best
ratio first, while each move raises the step's expected tokens per second. Alone, a request
speculates exactly when its own policy says so (the same condition: E(k) t(1) > t(k + 1)).
Pure functions over numbers.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

from specdec.runtime.config import MAX_DRAFT_TOKENS
from specdec.runtime.theory import expected_tokens_per_iteration


@dataclass(frozen=True)
class DraftCandidate:
    """A request whose policy asked for k drafts, and what it knows of its acceptance."""

    k: int
    alpha: float
    adjustable: bool = True  # False: a fixed K the user asked for, kept whatever the load
    # measured chance that the j-th draft (j = 1, 2, ...) is accepted, all before it accepted; beyond: alpha^j.
    # Drafts are not independent (prompt lookup copies a run or misses at once), so alpha^j from the
    # per-test rate overrates the first draft: half the iterations all 4 accepted, half none, gives
    # alpha 0.8 per test but 0.5 for the first draft.
    kept: tuple[float, ...] = ()

    def chance(self, j: int) -> float:
        """Return the chance that the j-th draft (1-based) is accepted: measured where known, else alpha^j."""
        return self.kept[j - 1] if j <= len(self.kept) else self.alpha ** j


@dataclass
class DraftRecord:
    """A request's own record of its drafts: per draft position j (index j - 1), the iterations that tested the
    j-th draft (all before it accepted) and those that accepted it."""

    tested: list[int] = field(default_factory=lambda: [0] * MAX_DRAFT_TOKENS)
    passed: list[int] = field(default_factory=lambda: [0] * MAX_DRAFT_TOKENS)

    def observe(self, drafted: int, accepted: int) -> None:
        """Count one iteration that verified `drafted` drafts, the first `accepted` of them accepted."""
        for j in range(min(drafted, accepted + 1, MAX_DRAFT_TOKENS)):
            self.tested[j] += 1
            self.passed[j] += j < accepted

    def kept(self, k: int) -> tuple[float, ...]:
        """Return the chance that each of k drafts is accepted, all before it too: measured per position
        (Laplace: 0.5 untested), multiplied along."""
        chances, running = [], 1.0
        for j in range(min(k, MAX_DRAFT_TOKENS)):
            running *= (self.passed[j] + 1) / (self.tested[j] + 2)
            chances.append(running)
        return tuple(chances)


@dataclass
class ShadowDraft:
    """Prompt lookup's drafts that the plan left unverified, followed against the tokens the target commits next.

    A request that decodes plainly learns how its lookup would have fared: its record then moves with what it is
    writing now (a request that begins to copy its prompt drafts again) instead of staying where its last verified
    drafts left it. Lookup drafts cost nothing to ask, and a one-hot draft x passes the acceptance test with
    chance p(x), the chance that the target commits x itself, so a match counts as an accepted draft.
    """

    tokens: tuple[int, ...]
    matched: int = 0
    settled: bool = False  # a committed token differed from its draft, or all drafts matched

    def follow(self, committed: list[int]) -> bool:
        """Return True when the newly `committed` tokens settle the drafts (then `matched` is final), matching
        them in order against the drafts not met yet; False while they are still open or already settled."""
        if self.settled:
            return False
        for token in committed:
            if token != self.tokens[self.matched]:
                self.settled = True
                return True
            self.matched += 1
            if self.matched == len(self.tokens):
                self.settled = True
                return True
        return False


def choose_speculating(candidates: list[DraftCandidate], plain_rows: int, batch_seconds: Callable[[int], float],
                       verify_seconds: Callable[[int], float]) -> list[bool]:
    """Return, per candidate, whether it speculates this step (False: it decodes one token in the batch).

    `plain_rows` requests decode plainly anyway; batch_seconds(n) is the batched call over n rows
    (0 for n = 0), verify_seconds(n) a batch-1 call over n tokens.
    """
    chosen = [not c.adjustable for c in candidates]
    rows = plain_rows + sum(1 for c in candidates if c.adjustable)
    seconds = batch_seconds(rows) + sum(verify_seconds(c.k + 1) for c in candidates if not c.adjustable)
    tokens = float(rows) + sum(expected_tokens_per_iteration(c.alpha, c.k) for c in candidates if not c.adjustable)
    order = sorted((i for i, c in enumerate(candidates) if c.adjustable),
                   key=lambda i: -(expected_tokens_per_iteration(candidates[i].alpha, candidates[i].k) - 1)
                   / max(verify_seconds(candidates[i].k + 1), 1e-9))
    for i in order:
        candidate = candidates[i]
        gained = expected_tokens_per_iteration(candidate.alpha, candidate.k) - 1.0
        added = verify_seconds(candidate.k + 1) - (batch_seconds(rows) - batch_seconds(rows - 1))
        if seconds + added > 0 and (tokens + gained) / (seconds + added) > tokens / seconds:
            chosen[i] = True
            tokens, seconds, rows = tokens + gained, seconds + added, rows - 1
    return chosen


def drafts_cannot_pay(rows: int, max_k: int, batch_seconds: Callable[[int], float],
                      verify_seconds: Callable[[int], float]) -> bool:
    """Return True where `choose_speculating` would move none of `rows` adjustable requests out of the batch
    even if each of its up to `max_k` drafts were sure to be accepted (then asking for drafts is wasted work).

    A move gains at most k tokens for verify_seconds(k + 1) less the row it frees; it pays only where
    k t_b(rows) > rows (t_v(k + 1) - (t_b(rows) - t_b(rows - 1))), the chooser's own test at acceptance 1.
    """
    seconds = batch_seconds(rows)
    freed = seconds - batch_seconds(rows - 1)
    return rows > 1 and all(k * seconds <= rows * (verify_seconds(k + 1) - freed) for k in range(1, max_k + 1))


def choose_draft_lengths_ragged(candidates: list[DraftCandidate], plain_rows: int,
                                batch_seconds: Callable[[int], float], ragged_seconds: Callable[[int], float],
                                margin: float = 1.0) -> list[int]:
    """Return each candidate's K this step (0: it decodes one token) when verify rows share one ragged call.

    With no drafts the step is the batched decode call over its rows, batch_seconds(rows); with any, one
    ragged-rows call over every token of the step (each row's 1 + k; the graph's idle rows take none),
    ragged_seconds(tokens). A request's j-th draft adds its chance of acceptance (all j accepted)
    for one more token in the call, so drafts are taken best first across requests, and every count of
    them is scored (the first draft switches the call, so stopping at the first loss would stop short);
    the most expected tokens per second wins, drafts counting only where they promise `margin` times the
    rate without them. A K the user fixed (not adjustable) is kept whole.
    """
    rows = plain_rows + len(candidates)
    fixed_tokens = sum(c.k for c in candidates if not c.adjustable)
    fixed_gain = sum(expected_tokens_per_iteration(c.alpha, c.k) - 1 for c in candidates if not c.adjustable)
    # (gain, candidate) per extra draft; within a request the gains fall with j, so a prefix keeps j in order
    drafts = sorted(((c.chance(j), i) for i, c in enumerate(candidates) if c.adjustable
                     for j in range(1, c.k + 1)), key=lambda d: -d[0])
    best, best_rate, gain = 0, -1.0, fixed_gain
    for count in range(len(drafts) + 1):
        if count:
            gain += drafts[count - 1][0]
        drafted = fixed_tokens + count
        seconds = ragged_seconds(rows + drafted) if drafted else batch_seconds(rows)
        rate = (rows + gain) / max(seconds, 1e-9) / (margin if count else 1.0)
        if rate > best_rate:
            best, best_rate = count, rate
    ks = [0 if c.adjustable else c.k for c in candidates]
    for _, i in drafts[:best]:
        ks[i] += 1
    return ks


@dataclass
class BatchCallCosts:
    """Seconds of a batched decode call over n rows: an EWMA per n, timed at start and refined by every call."""

    smoothing: float = 0.2
    _seconds: dict[int, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def observe(self, rows: int, seconds: float) -> None:
        """Record one batched call over `rows` rows that took `seconds`."""
        with self._lock:
            old = self._seconds.get(rows)
            self._seconds[rows] = seconds if old is None else old + self.smoothing * (seconds - old)

    def seconds(self, rows: int) -> float:
        """Return t_b(rows): measured, else the line through the nearest measured row counts (0 for no rows)."""
        if rows <= 0:
            return 0.0
        with self._lock:
            known = dict(self._seconds)
        if rows in known:
            return known[rows]
        if not known:
            return float(rows)  # nothing timed yet: any positive, increasing guess keeps the choice sane
        below = [n for n in known if n < rows]
        above = [n for n in known if n > rows]
        if below and above:
            lo, hi = max(below), min(above)
        else:
            ordered = sorted(known)
            if len(ordered) == 1:
                return known[ordered[0]] * rows / ordered[0]
            lo, hi = (ordered[-2], ordered[-1]) if below else (ordered[0], ordered[1])
        slope = (known[hi] - known[lo]) / (hi - lo)
        return max(known[lo] + slope * (rows - lo), 1e-6)

    def table(self) -> dict[int, float]:
        """Return the measured seconds by row count."""
        with self._lock:
            return dict(sorted(self._seconds.items()))
