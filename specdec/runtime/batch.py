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
are admitted between steps into KV slots (slots.py); their prompts are prefilled in chunks aligned to
absolute positions, at most `prefill_budget` tokens a step (and with `prefill_itl_factor`, no more than
keep the step within that factor of its cost without them, in 16-token granules: prefill_budget.py), the
oldest first, riding the running requests' ragged-rows call (or, where nothing runs, one ragged-rows call
of their own); each request's `timeline` records where its first token waited (timeline.py). There may be
more slots than that graph has rows: new requests take its rows while the load fits them, the rest
only under more load (`_slot_window`), and a step with a request beyond them is a batched decode call.
With the prefix cache (on by default) a prompt skips the positions a slot holds of it that a fresh
chunked prefill computes alike (slots.py, batch_chunks.py), so the output is the same with or without it;
while no request waits or runs, the replies that 1-token steps left unreusable are computed again as a prefill
computes them (batch_idle.py), so a chat's next turn skips them too.

This file is the engine's face and its scheduler loop; each job is a file of its own, entered once
per step in this order: batch_admission.py (slots, prefills), batch_step.py (plan, K, commit),
batch_drafting.py (shared draft calls), batch_calls.py (the target calls and their costs); batch_idle.py is
the work between requests; batch_request.py holds one running request's state.

    from specdec.runtime import BatchEngine, Engine, GenerationConfig
    batch = BatchEngine(Engine.load("artifacts/smollm2"), max_batch=8)
    for piece in batch.stream("Hello", GenerationConfig(max_new_tokens=32)):
        print(piece, end="")
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable, Iterator

from specdec.models.errors import GenerationError
from specdec.runtime.batch_admission import SlotAdmission
from specdec.runtime.batch_calls import CALIBRATION_PAST, TargetCalls
from specdec.runtime.batch_drafting import DraftRounds
from specdec.runtime.batch_idle import IdleReprefill
from specdec.runtime.batch_request import END, BatchRequest
from specdec.runtime.batch_step import DRAFT_MARGIN, BatchStep
from specdec.runtime.config import AUTO_K_CAP, GenerationConfig
from specdec.runtime.engine import Engine, GenerationStream
from specdec.runtime.guess_rows import MAX_REPLY_REUSE_SHARE
from specdec.runtime.loop import Iteration
from specdec.runtime.prefill_budget import DEFAULT_PREFILL_TOKENS, PrefillBudget
from specdec.runtime.slots import SlotArena

__all__ = ["BatchEngine", "CALIBRATION_PAST", "DEFAULT_KV_CAPACITY", "DEFAULT_MAX_BATCH", "DEFAULT_PREFILL_BUDGET",
           "DRAFT_MARGIN"]

DEFAULT_MAX_BATCH = 8
DEFAULT_KV_CAPACITY = 1024  # positions per slot
DEFAULT_PREFILL_BUDGET = DEFAULT_PREFILL_TOKENS  # prompt tokens a step (prefill_budget.py: measured)


def _delegated(part: str, name: str, what: str) -> property:
    """Return a read-only property giving `self.<part>.<name>`: `what`, as the facade shows it."""
    return property(lambda self: getattr(getattr(self, part), name), doc=f"Return {what}.")


class BatchEngine(SlotAdmission, BatchStep, IdleReprefill):
    """An Engine's target run for many requests at once, in `max_batch` KV slots of `kv_capacity` positions; each
    step prefills at most `prefill_budget` prompt tokens, and while requests run, no more than keep the step within
    `prefill_itl_factor` x its cost without them (prefill_budget.py; None: the budget alone). A request that would
    decode one token alone verifies a 1-token guess instead where that adds at most `reply_reuse_share` to the step's
    measured cost, so its reply stays reusable on the chat's next turn (guess_rows.py; 0: off). With
    `reprefill_when_idle` (and the prefix cache; `specdec serve`'s default) replies are made reusable while no
    request waits or runs instead, at no cost to a step (batch_idle.py)."""

    def __init__(self, engine: Engine, max_batch: int = DEFAULT_MAX_BATCH, kv_capacity: int = DEFAULT_KV_CAPACITY,
                 on_step: Callable[[int], None] | None = None, prefix_cache: bool = True,
                 prefill_budget: int = DEFAULT_PREFILL_BUDGET, prefill_itl_factor: float | None = None,
                 reply_reuse_share: float = 0.0, reprefill_when_idle: bool = False):
        if max_batch < 1:
            raise GenerationError(f"max_batch must be >= 1, got {max_batch}")
        if not 0 <= reply_reuse_share <= MAX_REPLY_REUSE_SHARE:
            raise GenerationError(f"reply_reuse_share must be in [0, {MAX_REPLY_REUSE_SHARE}], got {reply_reuse_share}")
        self.reply_reuse_share = reply_reuse_share
        try:
            self.budget = PrefillBudget(prefill_budget, prefill_itl_factor)
        except ValueError as err:
            raise GenerationError(str(err)) from None
        self.engine = engine
        self.prefill_budget = prefill_budget
        self.arena = SlotArena(engine.target, max_batch, kv_capacity, keep_prefixes=prefix_cache, exact_prefixes=True)
        # The draft model's KV slots follow the target's (request in slot s drafts in draft slot s), so that
        # every drafting request's draft calls of a step share one ragged-rows call of the draft graph (where it
        # has one of max_batch rows), and a prompt reuses the draft's prefix too.
        draft = engine.draft
        self.draft_arena = (SlotArena(draft, max_batch, kv_capacity, keep_prefixes=prefix_cache)
                            if draft is not None and draft.shared_kv and draft.batches
                            else None)
        self.calls = TargetCalls(engine, self.arena, on_step)  # the target calls, and what they cost
        self.drafting = DraftRounds(engine, self.draft_arena)  # the draft calls, shared across requests
        self.prefills_in_steps = 0  # requests whose prompt's last chunk rode the running requests' step call
        # Reuse the KV a finished request left in its slot for a prompt that starts the same way (a chat's
        # history, a shared system prompt): only positions a fresh chunked prefill computes bit for bit alike.
        self.prefix_cache = prefix_cache
        self.prefix_tokens_reused = 0
        self.prefix_tokens_queried = 0  # prompt tokens of the requests admitted with the prefix cache on
        self.reprefill_when_idle = reprefill_when_idle
        self.reprefilled_tokens = 0  # kept positions computed again while idle, for the next turn to reuse
        self._idle_since: float | None = None  # when the scheduler last found no work (None: it has some)
        self._idle_due = False  # _wait_for_work returned for idle work, not for a request
        self._waiting: deque[BatchRequest] = deque()
        self._prefilling: list[BatchRequest] = []  # holding slots, their prompts prefilled chunk by chunk, oldest first
        self._running: list[BatchRequest] = []
        self._admitting: list[BatchRequest] = []  # dequeued, not yet prefilling: a scheduler error reaches it
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
        """Return the requests holding a slot now (their prompts prefilled or still prefilling)."""
        return len(self._running) + len(self._prefilling)

    @property
    def num_waiting(self) -> int:
        """Return the requests submitted and not yet admitted."""
        return len(self._waiting)

    @property
    def kv_usage(self) -> float:
        """Return the fraction of the arena's positions that running requests have cached."""
        return self.arena.positions_used / (self.arena.slots * self.arena.capacity)

    # What the call paths and draft rounds measured and counted, read through the facade.
    batch_costs = _delegated("calls", "batch_costs", "the measured cost of a step of one batched decode call, by rows")
    verify_costs = _delegated("calls", "verify_costs",
                              "the measured cost of a speculating request's drafting + batch-1 verify call, by tokens")
    ragged_costs = _delegated("calls", "ragged_costs",
                              "the measured cost of a step of one ragged-rows call (every slot's row), by tokens")
    ragged_calls = _delegated("calls", "ragged_calls", "the steps whose rows shared one ragged-rows call")
    ragged_prefills = _delegated("calls", "ragged_prefills",
                                 "the prefills of several admitted requests in one ragged-rows call")
    draft_ragged_calls = _delegated("drafting", "model_rounds",
                                    "the rounds of draft model calls that shared one ragged-rows call")
    head_ragged_calls = _delegated("drafting", "head_rounds",
                                   "the rounds of draft head calls that shared the head's ragged-rows graph")

    def time_batch_calls(self, repeats: int = 3) -> dict[int, float]:
        """Time batched calls over 1, 2, 4, ... rows, and ragged-rows calls over 1, half and all rows of 1 token and
        all rows of 3 and 5 (every row attending over CALIBRATION_PAST positions) before any request; return the
        batched calls' seconds by rows.

        Call before submitting: the scheduler must not run beside it.
        """
        return self.calls.time_batch_calls(repeats)

    def time_batched_call(self, rows: int, repeats: int = 3) -> float:
        """Return the fastest of `repeats` batched decode calls over `rows` rows (TargetCalls.time_batched_call)."""
        return self.calls.time_batched_call(rows, repeats)

    def time_ragged_call(self, tokens: list[int], repeats: int = 3) -> float:
        """Return the fastest of `repeats` ragged-rows calls where slot s feeds tokens[s] tokens
        (TargetCalls.time_ragged_call)."""
        return self.calls.time_ragged_call(tokens, repeats)

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
        request = BatchRequest(opened, on_start=on_start)
        with self._wake:
            if self._stopping:
                raise GenerationError("the batch engine is shut down")
            self._waiting.append(request)
            self._wake.notify()
        return GenerationStream(lambda stream: self.engine.text_pieces(opened, self._iterations(request),
                                                                       request.counters, on_iteration, stream),
                                on_cancel=lambda: self._cancel(request), timeline=request.timeline)

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

    def _cancel(self, request: BatchRequest) -> None:
        request.cancelled.set()
        with self._wake:
            self._wake.notify()

    def check_fits(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """Raise GenerationError when a request of this size may outgrow a KV slot (its drafts included)."""
        needed = prompt_tokens + max_new_tokens + AUTO_K_CAP + 1
        if min(needed, self.engine.max_positions) > self.arena.parked_position:
            raise GenerationError(f"{prompt_tokens} prompt tokens + max_tokens {max_new_tokens} do not fit a KV slot "
                                  f"of {self.arena.capacity} positions (kv_capacity; specdec serve --kv-capacity)")

    def shutdown(self) -> None:
        """Stop the scheduler after its current step; requests still running end where they are."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join()

    def _iterations(self, request: BatchRequest) -> Iterator[Iteration]:
        try:
            while True:
                item = request.out.get()
                if item is END:
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
                ended = list({id(r): r for r in [*self._waiting, *self._admitting, *self._prefilling,
                                                 *self._running]}.values())
            for request in ended:
                request.out.put(stopped)
            raise

    def _schedule(self) -> None:
        """Between steps admit waiting requests and plan this step's prompt chunks (batch_admission.py), then run
        one step (batch_step.py), until the engine stops."""
        while self._wait_for_work():
            if self._idle_due:  # woken for idle work (batch_idle.py); a request that came meanwhile is seen next turn
                self._idle_due = False
                if self._is_idle():
                    self._reprefill_piece()
                continue
            self._admit()
            self._reap_cancelled()
            # Prompt chunks ride the step's ragged-rows call as rows of their own: one weight read for the step and
            # the prefills, the running requests still get their token each step while a burst (or a long prompt)
            # is prefilled, and a prompt costs its tokens, not a call of its own.
            riding = self._prefill_apart(self._plan_chunks())
            self._reap_cancelled()
            riding = [r for r in riding if r.holds_slot]
            if self._running or riding:
                # An error that no single request's guard caught (planning, drafting) ends this step's requests.
                self._guarded_all(self._running + riding, lambda: self._step(riding))
        for request in list(self._waiting) + self._prefilling + self._running:
            request.end()
            self._release(request)

    def _reap_cancelled(self) -> None:
        """End the running and prefilling requests cancelled since the last look (their slots freed, their streams
        told), and keep only those that hold a slot (a finished or failed request gave its slot back already)."""
        for request in self._prefilling + self._running:
            if request.holds_slot and request.cancelled.is_set():
                self._release(request)  # first: the consumer reads the counters once it has the end
                request.end()
        self._prefilling = [r for r in self._prefilling if r.holds_slot]
        self._running = [r for r in self._running if r.holds_slot]

    def _deliver(self, request: BatchRequest, iteration: Iteration) -> None:
        """Hand a committed iteration to the request's consumer; its draft record learns from it first, and its
        slot is freed if the iteration ends it."""
        request.learn_from(iteration)
        if iteration.finished:
            self._release(request)  # first: the consumer reads the counters once it has the last iteration
        request.out.put(iteration)

    def _release(self, request: BatchRequest) -> None:
        """Give the request's slot (and its draft model's) back, its counters copied off it; nothing if it holds
        none."""
        cache = request.cache
        model = request.draft_model
        if cache is not None and model is not None and self.draft_arena is not None:
            self.draft_arena.free(model.cache)  # without the prefix cache its row then attends over nothing
        if cache is not None:
            request.counters.run_seconds, request.counters.rollback_seconds = cache.run_seconds, cache.rollback_seconds
            request.cache = None
            self.arena.give(cache)

    def _guarded(self, request: BatchRequest, step: Callable[[BatchRequest], None]) -> None:
        """Run one request's step; an error ends that request (raised in its consumer), never the scheduler."""
        try:
            step(request)
        except Exception as err:  # surfaced to the request's consumer, which raises it
            request.out.put(err)
            self._release(request)

    def _guarded_all(self, requests: list[BatchRequest], call: Callable[[], None]) -> None:
        """Run a step shared by `requests`; an error ends each of them."""
        try:
            call()
        except Exception as err:
            for request in requests:
                if request.cache is not None:
                    request.out.put(err)
                    self._release(request)
