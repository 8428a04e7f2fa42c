"""How many tokens to draft each iteration: a fixed K, or K chosen from measured alpha and c."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specdec.runtime.call_costs import TargetCallCosts
from specdec.runtime.theory import best_draft_length

if TYPE_CHECKING:
    from specdec.runtime.loop import Iteration


ANY_SITUATION = "any"  # the label of a caller that does not tell situations apart


class FixedDraftLength:
    """Always the same K."""

    def __init__(self, k: int):
        self.k = k

    def choose(self, situation: str = ANY_SITUATION) -> int:
        """Return K."""
        return self.k

    def observe(self, iteration: "Iteration") -> None:
        """Ignore feedback: K is fixed."""


@dataclass
class AcceptanceEstimate:
    """Per-token acceptance of drafts made in one situation, and that situation's plain-decoding pause."""

    alpha: float  # the current estimate
    accepted: float | None = None  # EWMA of accepted drafts per iteration (None: no test yet)
    tests: float = 0.0  # EWMA of acceptance tests per iteration
    # Every test in this situation so far, the starting guess included: what the situation has
    # shown over the request, which the EWMA forgets after a few rejections in a row.
    accepted_total: float = 0.0
    tests_total: float = 0.0
    plain_left: int = 0  # iterations in this situation still to decode plainly
    probe_next: bool = False  # probe with a short draft next time in this situation
    cost_ratio: float | None = None  # c of drafting here (cost_per_situation only; None: not measured yet)


@dataclass
class AdaptiveDraftLength:
    """Picks K each iteration to maximise the expected speedup (Theorem 3.8) under estimates.

    alpha is estimated per drafting situation (a label the drafter gives before it proposes),
    as the ratio of two EWMAs over recent iterations in that situation: accepted drafts over
    acceptance tests. c is an EWMA of draft-call / 1-token target-call time; what verifying
    k drafts costs comes from `call_costs`, refined by every call this policy sees. When no
    K >= 1 is expected to beat plain decoding in a situation, under the EWMA and under the
    situation's whole record (all its tests so far), that situation decodes plainly for
    `cooldown` iterations, then probes with `probe_k`. Why each choice: docs/DESIGN.md,
    "Adaptive K".
    """

    max_k: int = 16  # cap on K (docs/DESIGN.md, "Defaults")
    smoothing: float = 0.3  # EWMA weight of the newest iteration
    alpha: float = 0.5  # starting guess for every situation, worth `prior_tests` acceptance tests
    prior_tests: float = 2.0
    cost_ratio: float = 0.0  # c: draft call / 1-token target call; learned when a model drafts
    call_costs: TargetCallCosts = field(default_factory=TargetCallCosts)
    cooldown: int = 16  # plain iterations (in one situation) before probing again
    probe_k: int = 2
    # One c per situation, from the drafting time each iteration spent per drafted token: for a
    # drafter that serves situations differently (specdec/runtime/combined.py: prompt lookup costs ~0,
    # a model draft ~c), one shared c would misprice every situation.
    cost_per_situation: bool = False
    # False: K depends on the accepted tokens only, never on timings (GenerationConfig.reproducible): the call
    # costs stay as given and c at `cost_ratio`.
    learns_timings: bool = True
    _estimates: dict[str, AcceptanceEstimate] = field(default_factory=dict)
    _seen_drafts: bool = False  # the first drafted iteration also carries the draft's prefill

    def estimate(self, situation: str = ANY_SITUATION) -> AcceptanceEstimate:
        """Return the acceptance estimate kept for `situation` (the starting guess if it is new)."""
        if situation not in self._estimates:
            self._estimates[situation] = AcceptanceEstimate(self.alpha, accepted_total=self.alpha * self.prior_tests,
                                                            tests_total=self.prior_tests)
        return self._estimates[situation]

    def choose(self, situation: str = ANY_SITUATION) -> int:
        """Return K for the next iteration, drafted in `situation` (0: decode one token plainly)."""
        state = self.estimate(situation)
        if state.plain_left > 0:
            state.plain_left -= 1
            return 0
        if state.probe_next:
            state.probe_next = False
            return min(self.probe_k, self.max_k)
        k, speedup = self.best(situation)
        if k == 0 or speedup < 1.0:
            # A few rejections in a row pull the EWMA below break-even even for a drafter that pays on
            # average (alpha ~0.4 went plain 41% of the time in a simulation); pause only if the
            # situation's whole record agrees.
            if state.tests_total > 0:
                k, speedup = self.best(situation, state.accepted_total / state.tests_total)
        if k == 0 or speedup < 1.0:
            # This iteration and `cooldown - 1` more are plain; then one probe re-measures alpha.
            state.plain_left = self.cooldown - 1
            state.probe_next = True
            return 0
        return k

    def situation_cost(self, situation: str = ANY_SITUATION) -> float:
        """Return c for drafting in `situation`: its own (cost_per_situation, once measured), else the shared one."""
        own = self.estimate(situation).cost_ratio if self.cost_per_situation else None
        return self.cost_ratio if own is None else own

    def best(self, situation: str = ANY_SITUATION, alpha: float | None = None) -> tuple[int, float]:
        """Return (K, expected speedup) maximising Theorem 3.8 under `situation`'s c and its current alpha
        estimate (or `alpha`); K=0: plain."""
        costs = self.call_costs.table(self.max_k + 1)
        alpha = self.estimate(situation).alpha if alpha is None else alpha
        return best_draft_length(alpha, self.situation_cost(situation), self.max_k, call_cost=costs.__getitem__)

    def observe(self, iteration: "Iteration") -> None:
        """Update the estimates from one iteration: its situation's alpha, c, and the target call's cost."""
        target_tokens, target_seconds = len(iteration.drafted) + 1, iteration.target_seconds
        if not self.learns_timings:
            target_seconds = 0.0  # every update below that reads a time is skipped
        cost_ratio = None
        if target_seconds > 0:
            self.call_costs.observe(target_tokens, target_seconds)
            if iteration.draft_step_seconds is not None:
                # c is against a 1-token target call; this call's length is taken out.
                cost_ratio = iteration.draft_step_seconds / self.call_costs.one_token_seconds(target_tokens,
                                                                                              target_seconds)
        accepted, tests = iteration.num_accepted, iteration.acceptance_tests
        situation = iteration.situation or ANY_SITUATION
        if tests > 0:  # a drafter with nothing to propose teaches nothing about alpha
            state = self.estimate(situation)
            if state.accepted is None:  # the starting guess enters as prior_tests tests
                state.accepted, state.tests = state.alpha * self.prior_tests, self.prior_tests
            state.accepted += self.smoothing * (accepted - state.accepted)
            state.tests += self.smoothing * (tests - state.tests)
            state.alpha = state.accepted / state.tests
            state.accepted_total += accepted
            state.tests_total += tests
        if cost_ratio is not None:
            self.cost_ratio += self.smoothing * (cost_ratio - self.cost_ratio)
        if self.cost_per_situation and iteration.drafted and target_seconds > 0:
            if self._seen_drafts:
                one_token = self.call_costs.one_token_seconds(target_tokens, target_seconds)
                measured = iteration.draft_seconds / len(iteration.drafted) / one_token
                state = self.estimate(situation)
                state.cost_ratio = measured if state.cost_ratio is None else \
                    state.cost_ratio + self.smoothing * (measured - state.cost_ratio)
            self._seen_drafts = True
