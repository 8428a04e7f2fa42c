"""How many tokens to draft each iteration: a fixed K, or K chosen from measured alpha and c."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.runtime.call_costs import TargetCallCosts
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
    1-token target-call time. What verifying k drafts costs comes from `call_costs`, a
    per-length table of target call times (measured by `specdec tune`, refined by every
    call this policy sees). When no K >= 1 is expected to beat plain decoding, it decodes
    plainly for `cooldown` iterations, then probes with `probe_k`.
    """

    max_k: int = 16  # cap on K (GenerationConfig.max_draft_tokens_auto says why 16)
    smoothing: float = 0.3  # EWMA weight of the newest iteration
    alpha: float = 0.5  # starting guess, worth `prior_tests` acceptance tests
    prior_tests: float = 2.0
    cost_ratio: float = 0.0  # c: draft call / 1-token target call; learned when a model drafts
    call_costs: TargetCallCosts = field(default_factory=TargetCallCosts)
    cooldown: int = 16  # plain iterations before probing again
    probe_k: int = 2
    _plain_left: int = 0
    _probe_next: bool = False
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
        costs = self.call_costs.table(self.max_k + 1)
        k, speedup = best_draft_length(self.alpha, self.cost_ratio, self.max_k, call_cost=costs.__getitem__)
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
        cost_ratio = None
        if target_tokens > 0 and target_seconds > 0:
            self.call_costs.observe(target_tokens, target_seconds)
            if draft_step_seconds is not None:
                # c is against a 1-token target call; this call's length is taken out.
                cost_ratio = draft_step_seconds / self.call_costs.one_token_seconds(target_tokens, target_seconds)
        tests = accepted + (1 if rejected else 0)
        if tests > 0:  # a drafter with nothing to propose teaches nothing about alpha
            if self._accepted is None:  # the starting guess enters as prior_tests tests
                self._accepted, self._tests = self.alpha * self.prior_tests, self.prior_tests
            self._accepted += self.smoothing * (accepted - self._accepted)
            self._tests += self.smoothing * (tests - self._tests)
            self.alpha = self._accepted / self._tests
        if cost_ratio is not None:
            self.cost_ratio += self.smoothing * (cost_ratio - self.cost_ratio)
