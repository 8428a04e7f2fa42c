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

    def observe(self, drafted: int, accepted: int, rejected: bool, draft_step_seconds: float | None = None,
                target_tokens: int = 0, target_seconds: float = 0.0) -> None:
        """Ignore feedback: K is fixed."""


@dataclass
class AdaptiveDraftLength:
    """Picks K each iteration to maximise the expected speedup (Theorem 3.8) under estimates.

    alpha is the ratio of two EWMAs over recent iterations, accepted drafts over acceptance
    tests: the maximum-likelihood estimate of a per-token acceptance probability from
    recent iterations. (An EWMA of each iteration's own ratio would weigh a 0-of-1
    rejection as much as a 7-of-7 run and read alpha low; with n-gram drafts, whose
    acceptance comes in runs, that cost 5-10% of the speedup on grounded prompts in a
    replay of SmolLM2's greedy outputs.) c is an EWMA of the measured draft-call /
    target-call time; the verify cost per extra token comes from a
    line t(n) = a + b n fitted online to the target calls' times (EWMA moments), once calls
    of different lengths have been seen (before that, the prior `verify_cost`). When no
    K >= 1 is expected to beat plain decoding, it decodes plainly for `cooldown`
    iterations, then probes with `probe_k`.
    """

    max_k: int = 8  # cap on K
    smoothing: float = 0.3  # EWMA weight of the newest iteration
    alpha: float = 0.5  # starting guess, worth `prior_tests` acceptance tests
    prior_tests: float = 2.0
    cost_ratio: float = 0.0  # c: draft call / 1-token target call; learned when a model drafts
    verify_cost: float = 0.0  # extra target cost per verified token, in target steps
    cooldown: int = 16  # plain iterations before probing again
    probe_k: int = 2
    _plain_left: int = 0
    _probe_next: bool = False
    _moments: list[float] | None = None  # EWMA of n, t, n*n, n*t over target calls
    _accepted: float | None = None  # EWMA of accepted drafts per iteration (None: no test yet)
    _tests: float = 0.0  # EWMA of acceptance tests per iteration

    def choose(self) -> int:
        """Return K for the next iteration (0: decode one token plainly)."""
        if self._plain_left > 0:
            self._plain_left -= 1
            return 0
        if self._probe_next:
            self._probe_next = False
            return min(self.probe_k, self.max_k)
        k, speedup = best_draft_length(self.alpha, self.cost_ratio, self.max_k, self.verify_cost)
        if k == 0 or speedup < 1.0:
            # This iteration and `cooldown - 1` more are plain; then one probe re-measures alpha.
            self._plain_left = self.cooldown - 1
            self._probe_next = True
            return 0
        return k

    def observe(self, drafted: int, accepted: int, rejected: bool, draft_step_seconds: float | None = None,
                target_tokens: int = 0, target_seconds: float = 0.0) -> None:
        """Update the estimates from one iteration.

        `accepted` of `drafted` passed, `rejected` if a test failed; draft_step_seconds is
        the drafter's mean single-token call time (None: model-free drafter); the target
        call took `target_seconds` over `target_tokens` tokens.
        """
        if target_tokens > 0 and target_seconds > 0:
            self._learn_verify_cost(target_tokens, target_seconds)
            # c is against a 1-token target call; this call's length is taken out with v.
            one_token = target_seconds / (1.0 + self.verify_cost * (target_tokens - 1))
            cost_ratio = draft_step_seconds / one_token if draft_step_seconds is not None else None
        else:
            cost_ratio = None
        tests = accepted + (1 if rejected else 0)
        if tests > 0:  # a drafter with nothing to propose teaches nothing about alpha
            if self._accepted is None:  # the starting guess enters as prior_tests tests
                self._accepted, self._tests = self.alpha * self.prior_tests, self.prior_tests
            self._accepted += self.smoothing * (accepted - self._accepted)
            self._tests += self.smoothing * (tests - self._tests)
            self.alpha = self._accepted / self._tests
        if cost_ratio is not None:
            self.cost_ratio += self.smoothing * (cost_ratio - self.cost_ratio)

    def _learn_verify_cost(self, n: int, seconds: float) -> None:
        sample = [n, seconds, n * n, n * seconds]
        if self._moments is None:
            self._moments = sample
            return
        w = 0.1  # slower than alpha: call times are noisy, the line's slope is a hardware fact
        self._moments = [m + w * (x - m) for m, x in zip(self._moments, sample)]
        mean_n, mean_t, mean_nn, mean_nt = self._moments
        variance = mean_nn - mean_n * mean_n
        if variance < 0.25:  # too few distinct lengths seen to fit a slope
            return
        slope = (mean_nt - mean_n * mean_t) / variance
        one_token = mean_t - slope * (mean_n - 1.0)
        if one_token > 0:
            self.verify_cost = min(max(slope / one_token, 0.0), 1.0)
