"""How many tokens to draft each iteration: a fixed K, or K chosen from measured alpha and c."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.runtime.theory import best_draft_length


class FixedDraftLength:
    """Always the same K."""

    def __init__(self, k: int):
        self.k = k

    def choose(self) -> int:
        """Return K."""
        return self.k

    def observe(self, drafted: int, accepted: int, rejected: bool, cost_ratio: float | None) -> None:
        """Ignore feedback: K is fixed."""


@dataclass
class AdaptiveDraftLength:
    """Picks K each iteration to maximise the expected speedup (Theorem 3.8) under estimates.

    alpha is an EWMA over recent iterations of accepted / acceptance-tests; c is an EWMA of
    the measured draft-call / target-call time. When no K >= 1 is expected to beat plain
    decoding, it decodes plainly for `cooldown` iterations, then probes with `probe_k`.
    """

    max_k: int = 8  # cap on K
    smoothing: float = 0.3  # EWMA weight of the newest iteration
    alpha: float = 0.5  # starting guess, corrected after the first iteration
    cost_ratio: float = 0.0  # c; learned from timings when a model drafts
    verify_cost: float = 0.0  # extra target cost per verified token, in target steps
    cooldown: int = 16  # plain iterations before probing again
    probe_k: int = 2
    _plain_left: int = 0
    _probing: bool = False

    def choose(self) -> int:
        """Return K for the next iteration (0: decode one token plainly)."""
        if self._plain_left > 0:
            self._plain_left -= 1
            if self._plain_left == 0:
                self._probing = True
            return 0
        if self._probing:
            return min(self.probe_k, self.max_k)
        k, speedup = best_draft_length(self.alpha, self.cost_ratio, self.max_k, self.verify_cost)
        if k == 0 or speedup < 1.0:
            self._plain_left = self.cooldown
            return 0
        return k

    def observe(self, drafted: int, accepted: int, rejected: bool, cost_ratio: float | None) -> None:
        """Update alpha and c from one iteration: `accepted` of `drafted`, `rejected` if a test failed."""
        tests = accepted + (1 if rejected else 0)
        if tests > 0:
            self.alpha += self.smoothing * (accepted / tests - self.alpha)
            self._probing = False
        elif drafted == 0 and self._probing:
            self._probing = False  # nothing to draft (no n-gram match): re-decide next time
        if cost_ratio is not None:
            self.cost_ratio += self.smoothing * (cost_ratio - self.cost_ratio)
