"""One running request of the batch engine: its loop state, its KV slot, what its drafts taught, this step's row.

The scheduler (specdec/runtime/batch.py) keeps one BatchRequest per submitted request; a step
(batch_step.py) fills each one's `row` (its plan, its K, its drafts) and the target call reads them,
so no list is kept in step with another by index. The functions below are what the batch plan asks
of a request (batch_plan.py weighs the answers): pure reads of its state.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Callable

from specdec.runtime.batch_plan import DraftCandidate, DraftRecord, ShadowDraft
from specdec.runtime.config import MAX_DRAFT_TOKENS
from specdec.runtime.draft_length import ANY_SITUATION, AdaptiveDraftLength
from specdec.runtime.drafters import Drafter, ModelDrafter, Proposal
from specdec.runtime.engine import OpenRequest
from specdec.runtime.loop import FORCED, DecodeState, Iteration
from specdec.runtime.slots import SlotCache
from specdec.runtime.timeline import FirstTokenTimeline

END = object()  # put on a request's queue: the scheduler is done with it (cancelled or shut down)


@dataclass
class SlotCounters:
    """A finished request's onnxruntime counters, copied off its slot before the slot is reused."""

    run_seconds: float = 0.0
    rollback_seconds: float = 0.0


@dataclass
class RowPlan:
    """One request's part of the current step, set as the step goes: planned, looked up, K chosen, drafted."""

    situation: str | None = None  # the drafter's situation, as `plan` named it (None: not asked)
    k: int = 0  # drafts asked: the policy's K, then the batch plan's
    looked_up: Proposal | None = None  # what prompt lookup found, asked before the batch plan
    proposal: Proposal | None = None  # the drafts the target call verifies (none: a plain row)

    @property
    def offered(self) -> int:
        """Return the drafts the batch plan may weigh: those prompt lookup found, else the K asked."""
        return len(self.looked_up.tokens) if self.looked_up is not None else self.k


@dataclass(eq=False)
class BatchRequest:
    """One submitted request: its loop state, its slot once admitted, and the queue its iterations go to."""

    opened: OpenRequest
    out: queue.Queue = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    cache: SlotCache | None = None
    counters: SlotCounters = field(default_factory=SlotCounters)
    passed_over: int = 0  # times a request behind it was admitted first (the prefix cache's choice)
    on_start: Callable[[], None] | None = None  # called when it takes a slot
    record: DraftRecord = field(default_factory=DraftRecord)  # its drafts' outcomes, for the batch plan
    shadows: list[ShadowDraft] = field(default_factory=list)  # lookups the plan left unverified, not settled yet
    row: RowPlan = field(default_factory=RowPlan)  # this step's plan and drafts
    # While its prompt is prefilled (batch_admission.py): this step's prompt tokens, the calls' time so far, the
    # hidden rows of its pieces so far (a draft head's), and whether it waits to copy what an older one prefills.
    chunk: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    prefill_states: list = field(default_factory=list)
    awaits_copy: bool = False
    timeline: FirstTokenTimeline = field(default_factory=FirstTokenTimeline.now)  # where its first token's wait went

    @property
    def state(self) -> DecodeState:
        """Return the request's loop state (what the loop's steps read and advance)."""
        return self.opened.state

    @property
    def prompt_ids(self) -> list[int]:
        """Return the request's prompt tokens."""
        return self.opened.state.request.prompt_ids

    @property
    def cache_salt(self) -> str | None:
        """Return the prefix-cache namespace of its prompt (GenerationConfig.cache_salt)."""
        return self.opened.config.cache_salt

    @property
    def raw_argmax(self) -> bool:
        """Return whether its tokens are the raw argmax (a call may then read the 8-bit greedy LM head)."""
        return self.opened.state.request.sampling.raw_argmax

    @property
    def hidden(self) -> bool:
        """Return whether its target calls must return hidden rows (a draft head reads them)."""
        return self.opened.state.hidden

    @property
    def draft_model(self) -> ModelDrafter | None:
        """Return the drafter whose draft model drafts for it (None: no draft model)."""
        drafter = self.opened.state.drafter
        return drafter.draft_model if drafter is not None else None

    @property
    def draft_head(self) -> Drafter | None:
        """Return the drafter whose draft head drafts for it (None: no draft head)."""
        drafter = self.opened.state.drafter
        return drafter.draft_head if drafter is not None else None

    @property
    def holds_slot(self) -> bool:
        """Return whether it holds a KV slot (admitted, not finished, failed or released)."""
        return self.cache is not None

    @property
    def slot(self) -> int:
        """Return its KV slot's index (it must hold one)."""
        return self.cache.slot

    def choose_k(self, k: int) -> None:
        """Set this step's K; drafts prompt lookup found that the plan leaves unverified become a shadow, followed
        against the tokens committed next."""
        looked_up = self.row.looked_up
        if k == 0 and looked_up is not None and looked_up.tokens:
            self.shadows.append(ShadowDraft(tuple(looked_up.tokens)))
        self.row.k = k

    def learn_from(self, iteration: Iteration) -> None:
        """Update its draft record from a committed iteration: the drafts it verified, else its shadows."""
        if iteration.drafted:
            self.record.observe(len(iteration.drafted), iteration.num_accepted)
            self.shadows = []  # the verified drafts tell the same story
        for shadow in self.shadows:
            if shadow.follow(iteration.committed):
                self.record.observe(len(shadow.tokens), shadow.matched)
        self.shadows = [shadow for shadow in self.shadows if not shadow.settled]

    def end(self) -> None:
        """Tell its consumer that the scheduler is done with it (the stream then ends)."""
        self.out.put(END)


def draft_candidate(opened: OpenRequest, situation: str | None, k: int) -> DraftCandidate:
    """Return what the batch plan knows of a request that asks for k drafts.

    A K the request itself set is kept under any load (its sampled output then reproduces at any
    load); `auto`'s K and the artifact's default K give way when the batch serves more without them.
    """
    policy = opened.state.policy
    if situation == FORCED:  # a grammar's forced tokens: the only allowed ones, so the target takes them
        return DraftCandidate(k, 1.0, adjustable=False)
    if not k_gives_way(opened):
        return DraftCandidate(k, 0.5, adjustable=False)
    if isinstance(policy, AdaptiveDraftLength):
        return DraftCandidate(k, cautious_alpha(policy.estimate(situation or ANY_SITUATION)))
    stats = opened.stats  # the default K: judged on this request's record so far
    return DraftCandidate(k, (stats.accepted + 1) / (stats.acceptance_tests + 2))


def k_gives_way(opened: OpenRequest) -> bool:
    """Return whether the batch plan may lower the request's K (`draft_candidate`'s adjustable): all but a K it set
    and a reproducible request's (its K may not depend on the load)."""
    if opened.config.k_follows_tokens:
        return False
    return isinstance(opened.state.policy, AdaptiveDraftLength) or opened.config.num_draft_tokens is None


def largest_k(state: DecodeState) -> int:
    """Return the most drafts the request's policy could ask for next (0 for a request that does not draft)."""
    if not state.drafting:
        return 0
    policy = state.policy
    return policy.max_k if isinstance(policy, AdaptiveDraftLength) else getattr(policy, "k", MAX_DRAFT_TOKENS)


def cautious_alpha(estimate) -> float:
    """Return the lower of a situation's recent (EWMA) and whole-record acceptance: a batch pays for a
    wrong yes with every other row's time, so a streak of accepts alone does not buy a verify call."""
    record = estimate.accepted_total / estimate.tests_total if estimate.tests_total > 0 else estimate.alpha
    return min(estimate.alpha, record)


def draft_lag(state: DecodeState, situation: str | None) -> int:
    """Return the committed tokens a request's draft model has not read yet, where the model would draft next
    (0 for prompt lookup, which reads nothing)."""
    model = state.drafter.draft_model if state.drafter is not None else None
    if model is None or state.drafter.drafts_by_lookup(situation):
        return 0
    return len(state.context) - model.cache.length


def drafts_free(state: DecodeState, situation: str | None) -> bool:
    """Return whether the request's next drafts come from prompt lookup (n-gram, phrase table), which costs
    nothing to ask and reads no model, rather than a draft model or head."""
    return situation == FORCED or (state.drafter.drafts_by_lookup(situation) and not state.hidden)


def first_drafts(proposal: Proposal, k: int) -> Proposal:
    """Return the first k drafts of a proposal (drafts are sequential: a prefix is a proposal of its own)."""
    if k >= len(proposal.tokens):
        return proposal
    return Proposal(proposal.tokens[:k], None if proposal.probs is None or k == 0 else proposal.probs[:k])
