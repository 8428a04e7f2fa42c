"""Continuous batching with speculation: one scheduler thread advances every running request per step.

Requests are submitted, streamed and cancelled from any thread (`BatchEngine.stream`, the same
GenerationStream as `Engine.stream`). Each step, every running request is planned, drafted and
committed by the loop's own steps (specdec/runtime/loop.py); between them the scheduler makes ONE
target call: the batched decode call when no row speculates, else one call of the artifact's
ragged-rows graph over every row's last token and drafts (specdec/exporter/ragged_rows.py). An
artifact without that graph verifies each speculating request in a batch-1 call of its own. Draft
models' calls are shared the same way, round by round, in the draft's own ragged-rows graph; a draft
head (EAGLE) reads its request's hidden rows from the ragged call (tapped by `specdec distill`) and runs
its own small calls.
batch_plan.py chooses which requests speculate, from measured call costs (prompt lookup is asked
first, so the plan weighs the drafts it found; those it leaves unverified are followed against the
tokens committed next, so a request's record keeps learning while it decodes plainly). New requests
are admitted between steps into KV slots (slots.py), those admitted together prefilled in one
ragged-rows call. There may be more slots than that graph has rows: new requests take its rows while
the load fits them, the rest only under more load (`_slot_window`), and a step with a request beyond
them is a batched decode call.

    from specdec.runtime import BatchEngine, Engine, GenerationConfig
    batch = BatchEngine(Engine.load("artifacts/smollm2"), max_batch=8)
    for piece in batch.stream("Hello", GenerationConfig(max_new_tokens=32)):
        print(piece, end="")
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

import numpy as np

from specdec.models.errors import GenerationError
from specdec.runtime.batch_plan import (BatchCallCosts, DraftCandidate, DraftRecord, ShadowDraft,
                                        choose_draft_lengths_ragged, choose_speculating, drafts_cannot_pay)
from specdec.runtime.combined import CombinedDrafter
from specdec.runtime.config import MAX_DRAFT_TOKENS, GenerationConfig
from specdec.runtime.drafters import Drafter, ModelDrafter, Proposal
from specdec.runtime.draft_length import ANY_SITUATION, AdaptiveDraftLength
from specdec.runtime.eagle import EagleDrafter
from specdec.runtime.engine import Engine, GenerationStream, OpenRequest
from specdec.runtime.loop import (MAX_DRAFT_ROOM, DecodeState, Iteration, commit, draft, first_token, plan, prefill,
                                  prompt_rest, verify_call)
from specdec.runtime.session import LONG_CALL_ROWS
from specdec.runtime.slots import MIN_PREFIX, SlotArena, SlotCache, common_prefix

DEFAULT_MAX_BATCH = 8
DEFAULT_KV_CAPACITY = 1024  # positions per slot
_CALIBRATION_ROWS = (1, 2, 4, 8, 16)
CALIBRATION_PAST = 256  # positions each row of a timed ragged call attends over
# Drafts must promise this much more than a step without them: every other row pays for a wrong yes, and a
# request's acceptance is known from a few iterations (at 1.0, n-gram rows drafted under load and lost 16%).
DRAFT_MARGIN = 1.25


@dataclass
class _Counters:
    """A finished request's onnxruntime counters, copied off its slot before the slot is reused."""

    run_seconds: float = 0.0
    rollback_seconds: float = 0.0


@dataclass(eq=False)
class _Request:
    """One submitted request: its loop state, its slot once admitted, and the queue its iterations go to."""

    opened: OpenRequest
    out: queue.Queue = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    cache: SlotCache | None = None
    counters: _Counters = field(default_factory=_Counters)
    passed_over: int = 0  # times a request behind it was admitted first (the prefix cache's choice)
    on_start: Callable[[], None] | None = None  # called when it takes a slot
    record: DraftRecord = field(default_factory=DraftRecord)  # its drafts' outcomes, for the batch plan
    shadows: list[ShadowDraft] = field(default_factory=list)  # lookups the plan left unverified, not settled yet


def _candidate(opened: OpenRequest, situation: str | None, k: int) -> DraftCandidate:
    """Return what the batch plan knows of a request that asks for k drafts.

    A K the request itself set is kept under any load (its sampled output then reproduces at any
    load); `auto`'s K and the artifact's default K give way when the batch serves more without them.
    """
    policy = opened.state.policy
    if not _k_gives_way(opened):
        return DraftCandidate(k, 0.5, adjustable=False)
    if isinstance(policy, AdaptiveDraftLength):
        return DraftCandidate(k, _cautious_alpha(policy.estimate(situation or ANY_SITUATION)))
    stats = opened.stats  # the default K: judged on this request's record so far
    return DraftCandidate(k, (stats.accepted + 1) / (stats.acceptance_tests + 2))


def _k_gives_way(opened: OpenRequest) -> bool:
    """Return whether the batch plan may lower the request's K (`_candidate`'s adjustable): all but a K it set."""
    return isinstance(opened.state.policy, AdaptiveDraftLength) or opened.config.num_draft_tokens is None


def _largest_k(state: DecodeState) -> int:
    """Return the most drafts the request's policy could ask for next (0 for a request that does not draft)."""
    if not state.drafting:
        return 0
    policy = state.policy
    return policy.max_k if isinstance(policy, AdaptiveDraftLength) else getattr(policy, "k", MAX_DRAFT_TOKENS)


def _cautious_alpha(estimate) -> float:
    """Return the lower of a situation's recent (EWMA) and whole-record acceptance: a batch pays for a
    wrong yes with every other row's time, so a streak of accepts alone does not buy a verify call."""
    record = estimate.accepted_total / estimate.tests_total if estimate.tests_total > 0 else estimate.alpha
    return min(estimate.alpha, record)


def _side(drafter: Drafter | None, kind: type) -> Drafter | None:
    """Return the drafter of type `kind` (a draft model, a draft head) that drafts for `drafter`: itself, or a
    combined drafter's model side; None if neither is one."""
    side = drafter.model if isinstance(drafter, CombinedDrafter) else drafter
    return side if isinstance(side, kind) else None


def _draft_lag(state: DecodeState, situation: str | None) -> int:
    """Return the committed tokens a request's draft model has not read yet, where the model would draft next
    (0 for prompt lookup, which reads nothing)."""
    model = _side(state.drafter, ModelDrafter)
    if model is None or (isinstance(state.drafter, CombinedDrafter) and not (situation or "").startswith("model")):
        return 0
    return len(state.context) - model.cache.length


def _drafts_free(state: DecodeState, situation: str | None) -> bool:
    """Return whether the request's next drafts come from prompt lookup (n-gram, phrase table), which costs
    nothing to ask and reads no model, rather than a draft model."""
    if _side(state.drafter, ModelDrafter) is None:
        return not state.hidden
    return isinstance(state.drafter, CombinedDrafter) and not (situation or "").startswith("model")


def _rest_tokens(request: _Request) -> int:
    """Return how many prompt tokens a request's prefill feeds: those its slot does not hold already."""
    return len(request.opened.state.request.prompt_ids) - request.cache.length


def _first(proposal: Proposal, k: int) -> Proposal:
    """Return the first k drafts of a proposal (drafts are sequential: a prefix is a proposal of its own)."""
    if k >= len(proposal.tokens):
        return proposal
    return Proposal(proposal.tokens[:k], None if proposal.probs is None or k == 0 else proposal.probs[:k])


_END = object()  # the scheduler is done with a request (cancelled or shut down)


class BatchEngine:
    """An Engine's target run for many requests at once, in `max_batch` KV slots of `kv_capacity` positions."""

    def __init__(self, engine: Engine, max_batch: int = DEFAULT_MAX_BATCH, kv_capacity: int = DEFAULT_KV_CAPACITY,
                 on_step: Callable[[int], None] | None = None, prefix_cache: bool = False):
        if max_batch < 1:
            raise GenerationError(f"max_batch must be >= 1, got {max_batch}")
        self.engine = engine
        self.arena = SlotArena(engine.target, max_batch, kv_capacity, keep_prefixes=prefix_cache)
        # The draft model's KV slots follow the target's (request in slot s drafts in draft slot s), so that
        # every drafting request's draft calls of a step share one ragged-rows call of the draft graph (where it
        # has one of max_batch rows), and a prompt reuses the draft's prefix too.
        draft = engine.draft
        self.draft_arena = (SlotArena(draft, max_batch, kv_capacity, keep_prefixes=prefix_cache)
                            if draft is not None and draft.shared_kv and draft.batches
                            else None)
        self.draft_ragged_calls = 0  # rounds of draft calls that shared one ragged-rows call
        self.head_ragged_calls = 0  # rounds of draft head calls that shared the head's ragged-rows graph
        self.batch_costs = BatchCallCosts()
        self.verify_costs = BatchCallCosts()  # a speculating request's drafting + batch-1 verify call, by tokens
        self.ragged_costs = BatchCallCosts()  # one ragged-rows call (every slot's row), by tokens
        self._ragged_shapes: set[int] = set()
        self.ragged_calls = 0  # steps whose verify rows shared one ragged-rows call
        self.ragged_prefills = 0  # prefills of several admitted requests in one ragged-rows call
        self.prefills_in_steps = 0  # admitted requests prefilled in the running requests' step call
        self.on_step = on_step  # called with the requests of every batched call (a metrics histogram)
        # Reuse the KV a finished request left in its slot for a prompt that starts the same way (a chat's
        # history, a shared system prompt). Off by default: the reused positions were computed in calls of
        # another shape, so a logit may round differently at the last bit and flip a near-tie argmax.
        self.prefix_cache = prefix_cache
        self.prefix_tokens_reused = 0
        self.prefix_tokens_queried = 0  # prompt tokens of the requests admitted with the prefix cache on
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._admitting: list[_Request] = []  # dequeued this round, not yet running: a scheduler error reaches them
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="specdec-batch", daemon=True)
        self._thread.start()

    @property
    def max_batch(self) -> int:
        """Return how many requests run at once (the KV slots)."""
        return self.arena.slots

    @property
    def alive(self) -> bool:
        """Return whether the scheduler thread runs (False after shutdown, or if it died)."""
        return self._thread.is_alive()

    @property
    def num_running(self) -> int:
        """Return the requests holding a slot now."""
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Return the requests submitted and not yet admitted."""
        return len(self._waiting)

    @property
    def kv_usage(self) -> float:
        """Return the fraction of the arena's positions that running requests have cached."""
        return self.arena.positions_used / (self.arena.slots * self.arena.capacity)

    def time_batch_calls(self, repeats: int = 3) -> dict[int, float]:
        """Time batched calls over 1, 2, 4, ... rows, and ragged-rows calls over 1, half and all rows of 1 token and
        all rows of 3 and 5 (every row attending over CALIBRATION_PAST positions) before any request; return the
        batched calls' seconds by rows.

        Call before submitting: the scheduler must not run beside it.
        """
        plain_rows = _CALIBRATION_ROWS if self.arena.plain_batches else (1,)
        for rows in (r for r in plain_rows if r <= self.max_batch):
            self.batch_costs.observe(rows, self.time_batched_call(rows, repeats=repeats))
        if self.arena.ragged:
            slots = self.arena.ragged_span
            for active, per_row in ((1, 1), (max(slots // 2, 1), 1), (slots, 1), (slots, 3), (slots, 5)):
                tokens = [per_row] * active + [0] * (slots - active)  # slots no request holds take no tokens
                self.ragged_costs.observe(active * per_row, self.time_ragged_call(tokens, repeats=repeats))
                self._ragged_shapes.add(active * per_row)
        return self.batch_costs.table()

    def _calibration_past(self) -> int:
        return min(CALIBRATION_PAST, self.arena.parked_position - 8)  # every row attends over a typical context

    def time_batched_call(self, rows: int, repeats: int = 3) -> float:
        """Return the fastest of `repeats` batched decode calls over `rows` rows of one token (each attending over
        CALIBRATION_PAST positions), after one untimed call that binds the shape's buffers. Not beside the
        scheduler. The fp32 LM head: on made-up tokens the 8-bit greedy head's bound fails and it recomputes."""
        if rows > 1 and not self.arena.plain_batches:
            raise GenerationError("this artifact's plain graph takes one row a call: its steps run in the ragged graph")
        target, past = self.engine.target, self._calibration_past()
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            target.forward_batch(lambda head, n=rows: self.arena.binding(n, head), [None] * rows, [0] * rows,
                                 [past] * rows, self.arena.parked_position, greedy=False)
            times.append(time.perf_counter() - start)
        return min(times[1:])

    def time_ragged_call(self, tokens: list[int], repeats: int = 3) -> float:
        """Return the fastest of `repeats` ragged-rows calls where slot s feeds tokens[s] tokens (0: an idle slot)
        after CALIBRATION_PAST positions, after one untimed call (fp32 LM head). Needs a ragged-rows graph of
        max_batch rows at most; not beside the scheduler."""
        slots, past = self.arena.ragged_span, self._calibration_past()
        if not self.arena.ragged:
            raise GenerationError(f"no ragged-rows graph of {self.max_batch} rows or fewer here (the artifact's has "
                                  f"{self.engine.target.spec.ragged_rows}): export with --batch-rows {self.max_batch}")
        if len(tokens) > slots:
            raise GenerationError(f"{len(tokens)} rows asked of a ragged-rows graph of {slots}")
        rows = [[0] * n for n in tokens] + [[]] * (slots - len(tokens))
        pasts = [past if row else self.arena.idle_length(s) for s, row in enumerate(rows)]
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            self.engine.target.forward_ragged(self.arena.ragged_binding(), [None] * slots, rows, pasts)
            times.append(time.perf_counter() - start)
        return min(times[1:])

    def generate(self, prompt: str | list[int], config: GenerationConfig = GenerationConfig()):
        """Return the GenerationResult of one request, run among whatever else is running."""
        stream = self.stream(prompt, config)
        for _ in stream:
            pass
        return stream.result

    def stream(self, prompt: str | list[int], config: GenerationConfig = GenerationConfig(),
               on_iteration: Callable[[Iteration], None] | None = None,
               on_start: Callable[[], None] | None = None) -> GenerationStream:
        """Return a GenerationStream of the request's text; it waits for a slot, then runs among the others.

        `on_start` is called (on the scheduler's thread: keep it short) when the request takes its slot.
        Closing the stream (or leaving its iteration) cancels the request and frees its slot; so does the
        stream's cancel() from any thread, and a request cancelled while it waits is never prefilled.
        Raises GenerationError at once for bad settings, a prompt that does not fit a slot, or a draft
        head (eagle) where the ragged-rows graph returns no hidden rows (distilled before heads were batched).
        """
        ids = self.engine.checked_prompt(prompt, config)
        self.check_fits(len(ids), config.max_new_tokens)
        opened = self.engine.open_request(ids, config)
        if opened.state.hidden:
            self._check_heads()
        request = _Request(opened, on_start=on_start)
        with self._wake:
            if self._stopping:
                raise GenerationError("the batch engine is shut down")
            self._waiting.append(request)
            self._wake.notify()
        return GenerationStream(lambda stream: self.engine.text_pieces(opened, self._iterations(request),
                                                                       request.counters, on_iteration, stream),
                                on_cancel=lambda: self._cancel(request))

    def _check_heads(self) -> None:
        """Raise GenerationError unless a draft head's request can run here: its target rows (hidden states
        included) come from the ragged-rows graph of every step it is in."""
        rows = self.engine.target.spec.ragged_rows
        if not self.arena.ragged:
            raise GenerationError("a draft head (eagle) runs in the batch engine through the artifact's ragged-rows "
                                  + (f"graph of {rows} rows: use --max-batch {rows}" if rows else
                                     "graph, which it has not: re-export it, or use drafter 'ngram' or 'model'"))
        if not self.engine.target.ragged_hidden:
            raise GenerationError("this artifact's ragged-rows graph has no hidden-state output for the draft head "
                                  "(distilled before heads were batched): run `specdec distill` again, or use "
                                  "drafter 'ngram' or 'model'")

    def _cancel(self, request: _Request) -> None:
        request.cancelled.set()
        with self._wake:
            self._wake.notify()

    def check_fits(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """Raise GenerationError when a request of this size may outgrow a KV slot (its drafts included)."""
        needed = prompt_tokens + max_new_tokens + GenerationConfig.max_draft_tokens_auto + 1
        if min(needed, self.engine.max_positions) > self.arena.parked_position:
            raise GenerationError(f"{prompt_tokens} prompt tokens + max_tokens {max_new_tokens} do not fit a KV slot "
                                  f"of {self.arena.capacity} positions (kv_capacity; specdec serve --kv-capacity)")

    def shutdown(self) -> None:
        """Stop the scheduler after its current step; requests still running end where they are."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join()

    def _iterations(self, request: _Request) -> Iterator[Iteration]:
        try:
            while True:
                item = request.out.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self._cancel(request)  # a consumer that stops early frees the slot at the next step

    def _loop(self) -> None:
        try:
            self._schedule()
        except BaseException as err:  # a scheduler bug: every request hears of it, none waits forever
            stopped = GenerationError(f"the batch scheduler stopped: {type(err).__name__}: {err}")
            with self._wake:
                self._stopping = True
                ended = list({id(r): r for r in [*self._waiting, *self._admitting, *self._running]}.values())
            for request in ended:
                request.out.put(stopped)
            raise

    def _schedule(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self._waiting and not self._running:
                    self._wake.wait()
                if self._stopping:
                    break
                for request in [r for r in self._waiting if r.cancelled.is_set()]:  # gone before its prefill
                    self._waiting.remove(request)
                    request.out.put(_END)
            # Every request a slot takes now is prefilled in one ragged-rows call (a burst of arrivals waits
            # for one call, not one after another); but a prompt that starts like one already in the group, for
            # MIN_PREFIX tokens more than some slot holds already, waits for that one's prefill, then copies the
            # prefix it computed (a document many requests start with). A chat template's system prompt that a
            # slot holds is copied now: waiting for it would prefill every chat arrival alone.
            group: list[_Request] = []
            window = self._slot_window()
            while (request := self._admissible(window)) is not None:
                self._admitting = [*group, request]
                prompt = request.opened.state.request.prompt_ids
                if self.prefix_cache and group:
                    held = self.arena.cached_prefix(prompt)
                    if any(common_prefix(r.opened.state.request.prompt_ids, prompt) >= held + MIN_PREFIX
                           for r in group):
                        self._prefill_all(group)
                        group = []
                request.cache = self.arena.take(prompt if self.prefix_cache else None, window=window)
                self.prefix_tokens_reused += request.cache.length
                self.prefix_tokens_queried += len(prompt) if self.prefix_cache else 0
                group.append(request)
            self._running = [r for r in self._running if not self._ended(r)]
            # Short prompt rests ride the step's ragged-rows call as rows of their own: one weight read for the
            # step and the admissions, so requests that finish out of step (speculation, EOS, arrivals) cost
            # their prompt tokens, not a call each. A long one is prefilled first in a call of its own.
            riding = self._riding(group)
            self._prefill_all([r for r in group if r not in riding])
            riding = self._opened(riding)
            self._running = [r for r in self._running if not self._ended(r)]
            if self._running or riding:
                # An error that no single request's guard caught (planning, drafting) ends this step's requests.
                self._guarded_all(self._running + riding, lambda: self._step(riding))
            self._admitting = []
        for request in list(self._waiting) + self._running:
            request.out.put(_END)
            self._release(request)

    def _admissible(self, window: int) -> _Request | None:
        """Return (and dequeue) the next waiting request to admit while one of slots 0..window-1 is free, else None."""
        with self._wake:
            while self._waiting and self.arena.free_below(window) and not self._stopping:
                request = self._next_waiting()
                if request.cancelled.is_set():
                    request.out.put(_END)
                    continue
                return request
        return None

    def _slot_window(self) -> int:
        """Return how many slots, from slot 0, this round's new requests may take: as many as are running and
        waiting, but no fewer than the ragged-rows graph's rows (and no more while a draft head's request is among
        them: it needs that graph every step). Requests then stay in the slots a ragged call spans while the load
        fits them, and a batched call spans no more rows than the load needs (a row past the running ones costs
        a MatMul row)."""
        rows = self.arena.ragged_span
        if not rows or rows == self.arena.slots:
            return self.arena.slots
        with self._wake:
            requests = self._running + list(self._waiting)
        if any(r.opened.state.hidden for r in requests):
            return rows
        return max(rows, min(len(requests), self.arena.slots))

    def _next_waiting(self) -> _Request:
        """Return (and dequeue) the next request to admit: the first waiting, unless the prefix cache holds a
        longer prefix for one of the next 2 x `max_batch` (then that one; no request is passed over more than
        `max_batch` times). Requests of equal length otherwise land on each other's cached prompts whenever
        slots free one at a time."""
        if not self.prefix_cache or len(self._waiting) == 1:
            return self._waiting.popleft()
        window = list(itertools.islice(self._waiting, 2 * self.max_batch))
        shared = [self.arena.cached_prefix(r.opened.state.request.prompt_ids) for r in window]
        best = shared.index(max(shared))  # the first of the longest: order kept among equals
        best = next((i for i in range(best) if window[i].passed_over >= self.max_batch), best)
        for request in window[:best]:
            request.passed_over += 1
        del self._waiting[best]
        return window[best]

    def _riding(self, group: list[_Request]) -> list[_Request]:
        """Return the requests that just took slots whose prompts are prefilled in the running requests' next
        step: none unless some run, every slot lies among the ragged-rows graph's rows and no draft head needs
        a prefill's hidden rows (the head's prefill runs in the single loop's call); then those whose prompt
        rest is at most LONG_CALL_ROWS tokens. A ragged call computes every row's logits, so beyond that a
        prefill of its own (the last row's logits, the long-call kernel) costs less than the call it saves."""
        requests = self._running + group
        if not self._running or not self._in_ragged_rows(requests) or any(r.opened.state.hidden for r in requests):
            return []
        return [r for r in group if _rest_tokens(r) <= LONG_CALL_ROWS]

    def _opened(self, group: list[_Request]) -> list[_Request]:
        """Open every request that just took a slot; return those still holding one."""
        for request in group:
            self._guarded(request, self._open)
        return [r for r in group if r.cache is not None]

    def _prefill_all(self, group: list[_Request]) -> None:
        """Prefill the requests that just took slots: in one ragged-rows call where there are several (each row
        its prompt's rest), else in the single loop's call."""
        group = self._opened(group)
        if len(group) < 2 or not self._in_ragged_rows(group) or any(r.opened.state.hidden for r in group):
            for request in group:
                self._guarded(request, lambda r: self._started(r, prefill(self.engine.target, r.cache,
                                                                           r.opened.state)))
            return
        self._guarded_all(group, lambda: self._ragged_prefill(group))

    def _ragged_prefill(self, group: list[_Request]) -> None:
        fed = {r.cache.slot: (r.cache, prompt_rest(r.opened.state, r.cache)) for r in group}
        caches, rows, lengths = self.arena.ragged_rows(fed)  # running requests' slots take no token
        start = time.perf_counter()
        logits = self.engine.target.forward_ragged(self.arena.ragged_binding(), caches, rows, lengths,
                                                   all(r.opened.state.request.sampling.raw_argmax for r in group))
        seconds = time.perf_counter() - start
        self.ragged_prefills += 1
        tokens = sum(len(row) for row in rows)
        for request in group:
            self._start_from(request, logits[request.cache.slot][-1], seconds * len(rows[request.cache.slot]) / tokens)

    def _start_from(self, request: _Request, last_logits: np.ndarray, seconds: float) -> None:
        """Start a request whose prompt a shared call prefilled: its first token from the prompt's last logits
        row; `seconds` is its share of the call."""
        request.cache.count_call(seconds)
        self._guarded(request, lambda r: self._started(r, first_token(r.opened.state, last_logits, None, seconds)))

    def _open(self, request: _Request) -> None:
        """Start a request that took a slot: tell its caller, give its draft model the slot's draft KV."""
        if request.on_start is not None:
            request.on_start()
        model = _side(request.opened.state.drafter, ModelDrafter)
        if model is not None and self.draft_arena is not None:
            model.cache = self.draft_arena.cache_at(request.cache.slot, request.opened.state.request.prompt_ids)
        cache = request.cache
        cache.run_seconds = cache.rollback_seconds = 0.0
        cache.run_calls = 0

    def _started(self, request: _Request, iteration: Iteration) -> None:
        if not iteration.finished:
            self._running.append(request)
        self._deliver(request, iteration)

    def _step(self, admitted: list[_Request] = ()) -> None:
        """Advance every running request by one target call; `admitted` requests (just opened) are prefilled in
        the same call, a ragged-rows one, and join the running ones."""
        start = time.perf_counter()  # a step's cost is all of it (planning, drafting, commits), not the call alone
        running = list(self._running)
        admitted = list(admitted)
        prompt_tokens = sum(_rest_tokens(r) for r in admitted)
        plans = ([(None, 0)] * len(running) if not admitted and self._drafts_cannot_pay(running)
                 else [plan(r.opened.state) for r in running])
        # Prompt lookup costs nothing to ask: its proposals come first, so that the plan weighs the drafts
        # that exist (it often finds fewer than K, or none) and keeps a prefix of them.
        looked_up = {i: draft(r.opened.state, k) for i, (r, (situation, k)) in enumerate(zip(running, plans))
                     if k > 0 and _drafts_free(r.opened.state, situation)}
        ks = self._draft_lengths(running, [(situation, len(looked_up[i].tokens) if i in looked_up else k)
                                           for i, (situation, k) in enumerate(plans)], prompt_tokens)
        for i, proposal in looked_up.items():
            if ks[i] == 0 and proposal.tokens:
                running[i].shadows.append(ShadowDraft(tuple(proposal.tokens)))
        proposals = self._draft_all(running, ks, looked_up)
        heads = any(r.opened.state.hidden for r in running)  # their drafter reads every step's hidden rows
        if admitted or (self._ragged_mode(running)
                        and (self._plain_steps_ragged() or heads or any(p.tokens for p in proposals))):
            self._guarded_all([*running, *admitted],
                              lambda: self._ragged_call(running, plans, proposals, start, admitted))
            self._running = [r for r in self._running if not self._ended(r)]
            return
        # A graph without plain batched calls (int4) runs a lone request's steps as the single-request loop does.
        # The batched decode call returns no hidden rows: a draft head's request takes the single loop's call.
        plain = ([i for i, p in enumerate(proposals) if not p.tokens and not running[i].opened.state.hidden]
                 if self.arena.plain_batches else [])
        if plain:
            self._guarded_all([running[i] for i in plain],
                              lambda: self._batched_call(running, plans, proposals, plain, start))
        for i, proposal in enumerate(proposals):
            if i not in plain:
                self._guarded(running[i], lambda r, i=i: self._verify(r, plans[i][0], proposals[i]))
        self._running = [r for r in self._running if not self._ended(r)]

    def _draft_all(self, running: list[_Request], ks: list[int], looked_up: dict[int, Proposal]) -> list[Proposal]:
        """Return every running request's proposal of its k tokens: the first k of what prompt lookup proposed
        (`looked_up`), or drafted now. The draft models' calls of all requests go round by round (catch-up, then
        one token at a time), each round ONE call of the draft's ragged-rows graph over every request still
        drafting (a lone one: its own batch-1 call, as the single loop makes); so do the draft heads' calls,
        through the head's ragged-rows graph where `specdec distill` wrote one."""
        proposals: list[Proposal | None] = [None] * len(running)
        by_model, by_head = {}, {}  # request index -> (its draft calls, what its next call feeds)
        for i, (request, k) in enumerate(zip(running, ks)):
            state = request.opened.state
            if i in looked_up:
                proposals[i] = _first(looked_up[i], k)
                continue
            model, head = _side(state.drafter, ModelDrafter), _side(state.drafter, EagleDrafter)
            if k and model is not None and self.draft_arena is not None and \
                    request.cache.slot < self.draft_arena.ragged_span:
                pending = by_model
            elif k and head is not None and head.head.ragged_session is not None:
                pending = by_head
            else:
                proposals[i] = draft(state, k)
                continue
            calls = state.drafter.draft_calls(state.context, k)
            try:
                pending[i] = (calls, next(calls))
            except StopIteration as done:  # prompt lookup's side of a combined drafter: no call
                proposals[i] = done.value
        self._draft_rounds(running, by_model, self._model_round, proposals)
        self._draft_rounds(running, by_head, self._head_round, proposals)
        return proposals

    def _draft_rounds(self, running: list[_Request], pending: dict, round_call: Callable,
                      proposals: list[Proposal | None]) -> None:
        """Run the pending requests' draft calls round by round, `round_call(running, pending)` making each round's
        calls; put each request's Proposal in `proposals` when its calls end."""
        while pending:
            start = time.perf_counter()
            outputs = round_call(running, pending)
            share = (time.perf_counter() - start) / len(pending)
            for i in list(pending):
                running[i].opened.state.draft_seconds += share
                calls, fed = pending[i]
                self._count_draft_call(running[i], fed, share, len(pending) > 1)
                try:
                    pending[i] = (calls, calls.send(outputs[i]))
                except StopIteration as done:
                    proposals[i] = done.value
                    del pending[i]

    def _model_round(self, running: list[_Request], pending: dict) -> dict[int, np.ndarray]:
        """Return each pending request's last logits row of its draft model's call: one ragged-rows call."""
        session = self.engine.draft
        models = {i: _side(running[i].opened.state.drafter, ModelDrafter) for i in pending}
        if len(pending) == 1:
            (i, (_, feed)), = pending.items()
            return {i: session.forward(models[i].cache, feed, logits_rows=1)[-1]}
        slots = {running[i].cache.slot: i for i in pending}
        caches, rows, lengths = self.draft_arena.ragged_rows({s: (models[i].cache, pending[i][1])
                                                              for s, i in slots.items()})
        out = session.forward_ragged(self.draft_arena.ragged_binding(), caches, rows, lengths)
        self.draft_ragged_calls += 1
        return {i: out[s][-1] for s, i in slots.items()}

    def _head_round(self, running: list[_Request], pending: dict) -> dict:
        """Return each pending request's HeadOutput of its draft head's call: one ragged-rows call of the head."""
        order = list(pending)
        outputs = self.engine.eagle.run_rows([pending[i][1] for i in order])
        self.head_ragged_calls += len(order) > 1
        return dict(zip(order, outputs))

    @staticmethod
    def _count_draft_call(request: _Request, fed, seconds: float, shared: bool) -> None:
        drafter = request.opened.state.drafter
        head = _side(drafter, EagleDrafter)
        if head is not None:
            head.count_call(len(fed.token_ids), seconds)
        elif shared:  # a draft model's batch-1 call counted itself
            _side(drafter, ModelDrafter).cache.count_call(seconds)

    def _batched_call(self, running, plans, proposals, plain: list[int], step_start: float) -> None:
        states = [running[i].opened.state for i in plain]
        by_slot = {running[i].cache.slot: running[i] for i in plain}
        # Rows first..last, the slots between them parked: with the prefix cache a light load may sit in high
        # slots, and binding from slot 0 would step every row below them for nothing.
        first = min(by_slot)
        window = range(first, max(by_slot) + 1)
        caches = [by_slot[s].cache if s in by_slot else None for s in window]
        tokens = [by_slot[s].opened.state.context[-1] if s in by_slot else 0 for s in window]
        greedy = all(s.request.sampling.raw_argmax for s in states)
        start = time.perf_counter()
        parked = [self.arena.idle_length(s) for s in window]  # where a row not decoding writes
        logits = self.engine.target.forward_batch(lambda head: self.arena.binding(len(window), head, first), caches,
                                                  tokens, parked, self.arena.parked_position, greedy)
        seconds = time.perf_counter() - start
        if self.on_step is not None:
            self.on_step(len(plain))
        for i in plain:
            request = running[i]
            request.cache.count_call(seconds / len(plain))
            # A call shared by several rows is not a batch-1 call: auto's t(n) must not learn from it.
            shared = seconds if len(plain) == 1 else 0.0
            self._guarded(request, lambda r, i=i: self._deliver(r, commit(
                r.opened.state, r.cache, plans[i][0], proposals[i], logits[r.cache.slot - first][None, :], shared)))
        self.batch_costs.observe(len(plain), time.perf_counter() - step_start)

    def _ragged_mode(self, running: list[_Request]) -> bool:
        """Return whether this step's rows would share a ragged-rows call: several requests run, and one drafts
        or the plain graph cannot batch them."""
        return len(running) > 1 and self._in_ragged_rows(running) and (
            not self.arena.plain_batches or any(r.opened.state.drafting for r in running))

    def _in_ragged_rows(self, requests: list[_Request]) -> bool:
        """Return whether every request's slot lies among the rows of the ragged-rows graph (False without one)."""
        return all(r.cache.slot < self.arena.ragged_span for r in requests)

    def _plain_steps_ragged(self) -> bool:
        """Return whether a step without drafts also takes the ragged-rows graph (in ragged mode).

        On per-session thread pools it does (8 x 1 tokens cost ~6% more than the batched decode call):
        two sessions taking turns would each spin its threads through the other's calls. On one shared
        pool (Engine.load(shared_threads=True), as `specdec serve` loads) it takes the batched decode call, where
        the plain graph has one (not int4's).
        """
        return not self.engine.shared_pool or not self.arena.plain_batches

    def _ragged_call(self, running, plans, proposals, step_start: float, admitted: list[_Request] = ()) -> None:
        """Score every running request's last token and drafts in ONE ragged-rows call, then commit each; the
        call also prefills `admitted` requests (each row its prompt's rest) and starts them."""
        index = {r.cache.slot: i for i, r in enumerate(running)}
        fed = {slot: (running[i].cache, [running[i].opened.state.context[-1]] + proposals[i].tokens)
               for slot, i in index.items()}
        fed.update({r.cache.slot: (r.cache, prompt_rest(r.opened.state, r.cache)) for r in admitted})
        caches, rows, lengths = self.arena.ragged_rows(fed)  # a free slot's row takes no token
        greedy = all(r.opened.state.request.sampling.raw_argmax for r in [*running, *admitted])
        heads = [r for r in running if r.opened.state.hidden]
        start = time.perf_counter()
        logits = self.engine.target.forward_ragged(self.arena.ragged_binding(), caches, rows, lengths, greedy,
                                                   hidden=bool(heads))
        seconds = time.perf_counter() - start
        if heads:
            logits, states = logits
            for request in heads:  # what commit hands the head: the features of the rows it keeps
                request.opened.state.states = states[request.cache.slot]
        self.ragged_calls += 1
        tokens = sum(len(row) for row in rows)
        if self.on_step is not None:
            self.on_step(len(running) + len(admitted))
        for slot, i in index.items():
            request = running[i]
            request.cache.count_call(seconds * len(rows[slot]) / tokens)
            # A shared call is not a batch-1 call: auto's t(n) does not learn from it (target_seconds 0).
            self._guarded(request, lambda r, i=i, slot=slot: self._deliver(r, commit(
                r.opened.state, r.cache, plans[i][0], proposals[i], logits[slot], 0.0)))
        for request in admitted:
            self.prefills_in_steps += 1
            self._start_from(request, logits[request.cache.slot][-1], seconds * len(rows[request.cache.slot]) / tokens)
        if tokens in self._ragged_shapes:  # a shape's first call also plans its buffers: not its cost
            self.ragged_costs.observe(tokens, time.perf_counter() - step_start)
        self._ragged_shapes.add(tokens)

    def _verify(self, request: _Request, situation: str | None, proposal) -> None:
        state = request.opened.state
        drafting = state.draft_seconds
        start = time.perf_counter()
        logits = verify_call(self.engine.target, request.cache, state, proposal.tokens)
        seconds = time.perf_counter() - start
        self.verify_costs.observe(len(proposal.tokens) + 1, seconds + drafting)
        self._deliver(request, commit(state, request.cache, situation, proposal, logits, seconds))

    def _draft_lengths(self, running: list[_Request], plans: list[tuple[str | None, int]],
                       prompt_tokens: int = 0) -> list[int]:
        """Return each request's K this step: its policy's, unless the batch serves more tokens per second
        without it. `prompt_tokens` of admitted prompts ride the step's call (a ragged-rows one then)."""
        ks = [k for _, k in plans]
        if len(running) == 1:
            return ks  # alone: exactly the single-request loop's choice
        candidates, where = [], []
        for i, (request, (situation, k)) in enumerate(zip(running, plans)):
            if k > 0:
                candidate = _candidate(request.opened, situation, k)
                if candidate.adjustable and _draft_lag(request.opened.state, situation) > MAX_DRAFT_ROOM:
                    # Its draft model would first read all it has not seen (a prefill's cost, every row waiting).
                    ks[i] = 0
                    continue
                if candidate.adjustable:
                    candidate = replace(candidate, kept=request.record.kept(k))
                candidates.append(candidate)
                where.append(i)
        if not candidates:
            return ks
        plain_rows = len(running) - len(candidates)
        if prompt_tokens or self._ragged_mode(running):
            plain_step = (self.ragged_costs.seconds if prompt_tokens or self._plain_steps_ragged()
                          else self.batch_costs.seconds)
            lengths = choose_draft_lengths_ragged(
                candidates, plain_rows, lambda tokens: plain_step(tokens + prompt_tokens),
                lambda tokens: self.ragged_costs.seconds(tokens + prompt_tokens), margin=DRAFT_MARGIN)
            for i, k in zip(where, lengths):
                ks[i] = k
            return ks
        chosen = choose_speculating(candidates, plain_rows, self.batch_costs.seconds, self._verify_seconds())
        for i, keep in zip(where, chosen):
            if not keep:
                ks[i] = 0
        return ks

    def _verify_seconds(self) -> Callable[[int], float]:
        """Return t_v(n): a request's verify call over n tokens, drafting included, measured here once timed;
        before, the 1-row batched call scaled by auto's t(n)."""
        costs = self.engine.target_call_costs
        one_row = self.batch_costs.seconds(1)
        verify = self.verify_costs.table()
        return lambda tokens: verify.get(tokens) or one_row * costs.relative(tokens)

    def _drafts_cannot_pay(self, running: list[_Request]) -> bool:
        """Return whether this step skips planning: every request's drafts would need a verify call of its own,
        and none could pay for it even with all accepted (batch_plan.drafts_cannot_pay, on the measured costs).

        Asking each request's policy and prompt lookup costs ~0.5% of a 16-row step on a 2-core CPU (default K);
        where verify calls are cheap (a GPU), the bound does not hold and every step asks. A K a request set is
        always asked.
        """
        if (len(running) < 2 or not self.arena.plain_batches or self._ragged_mode(running)
                or any(r.opened.state.hidden or (r.opened.state.drafting and not _k_gives_way(r.opened))
                       for r in running)):
            return False
        max_k = max(_largest_k(r.opened.state) for r in running)
        return max_k == 0 or drafts_cannot_pay(len(running), max_k, self.batch_costs.seconds, self._verify_seconds())

    def _deliver(self, request: _Request, iteration: Iteration) -> None:
        if iteration.drafted:
            request.record.observe(len(iteration.drafted), iteration.num_accepted)
            request.shadows = []  # the verified drafts tell the same story
        for shadow in request.shadows:
            if shadow.follow(iteration.committed):
                request.record.observe(len(shadow.tokens), shadow.matched)
        request.shadows = [shadow for shadow in request.shadows if not shadow.settled]
        if iteration.finished:
            self._release(request)  # first: the consumer reads the counters once it has the last iteration
        request.out.put(iteration)

    def _ended(self, request: _Request) -> bool:
        if request.cache is None:
            return True
        if request.cancelled.is_set():
            self._release(request)  # first: the consumer reads the counters once it has the end
            request.out.put(_END)
            return True
        return False

    def _release(self, request: _Request) -> None:
        cache = request.cache
        model = _side(request.opened.state.drafter, ModelDrafter)
        if cache is not None and model is not None and self.draft_arena is not None:
            self.draft_arena.free(model.cache)  # without the prefix cache its row then attends over nothing
        if cache is not None:
            request.counters.run_seconds, request.counters.rollback_seconds = cache.run_seconds, cache.rollback_seconds
            request.cache = None
            self.arena.give(cache)

    def _guarded(self, request: _Request, step: Callable[[_Request], None]) -> None:
        """Run one request's step; an error ends that request (raised in its consumer), never the scheduler."""
        try:
            step(request)
        except Exception as err:  # surfaced to the request's consumer, which raises it
            request.out.put(err)
            self._release(request)

    def _guarded_all(self, requests: list[_Request], call: Callable[[], None]) -> None:
        """Run a step shared by `requests`; an error ends each of them."""
        try:
            call()
        except Exception as err:
            for request in requests:
                if request.cache is not None:
                    request.out.put(err)
                    self._release(request)
