"""The batch engine's target calls: the three ways a step's rows are scored, and their measured costs.

Every path returns each row's logits as a RowLogits (the request, its logits rows, the seconds auto's
t(n) may learn from), so the step commits them the same way whichever call made them:
- `ragged`: ONE call of the artifact's ragged-rows graph over every running request's last token and
  drafts (specdec/exporter/ragged_rows.py), which can also prefill chunks of admitted requests' prompts;
- `batched`: the batched decode call, one token per row, where no row of it speculates;
- `verify`: a speculating request's batch-1 call, as the single loop makes (an artifact without a
  ragged-rows graph, or a slot beyond its rows).
Each call's time goes into the cost tables the batch plan reads (batch_plan.BatchCallCosts); the
calibration calls (`time_batch_calls`) fill them before any request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from specdec.models.errors import GenerationError
from specdec.runtime.batch_plan import BatchCallCosts
from specdec.runtime.batch_request import BatchRequest
from specdec.runtime.engine import Engine
from specdec.runtime.loop import verify_call
from specdec.runtime.slots import SlotArena

_CALIBRATION_ROWS = (1, 2, 4, 8, 16)
CALIBRATION_PAST = 256  # positions each row of a timed ragged call attends over
IDLE_SMOOTHING = 0.2  # weight of the newest step in `idle_step`


@dataclass(frozen=True)
class RowLogits:
    """One request's rows of a target call."""

    request: BatchRequest
    logits: np.ndarray  # [its last token + its drafts, vocab]
    target_seconds: float  # the call's time where it was a batch-1 call, else 0 (auto's t(n) learns from it)


@dataclass(frozen=True)
class PromptLogits:
    """One admitted request's prompt chunk (`request.chunk`), prefilled in a shared call."""

    request: BatchRequest
    last_logits: np.ndarray  # [vocab] the chunk's last row (the prompt's, after its last chunk)
    seconds: float  # its share of the call


@dataclass(frozen=True)
class RaggedCall:
    """What one ragged-rows call returned: the running requests' rows, the prompt chunks', its tokens."""

    rows: list[RowLogits]
    prompts: list[PromptLogits]
    tokens: int


class TargetCalls:
    """Makes the batch engine's target calls over the slots of `arena`, and keeps what they cost."""

    def __init__(self, engine: Engine, arena: SlotArena, on_step: Callable[[int], None] | None = None):
        self.engine = engine
        self.arena = arena
        self.on_step = on_step  # called with the requests of every batched call (a metrics histogram)
        self.batch_costs = BatchCallCosts()
        self.verify_costs = BatchCallCosts()  # a speculating request's drafting + batch-1 verify call, by tokens
        self.ragged_costs = BatchCallCosts()  # one ragged-rows call (every slot's row), by tokens
        self._ragged_shapes: set[int] = set()
        self._verify_shapes: set[int] = set()
        self.ragged_calls = 0  # steps whose verify rows shared one ragged-rows call
        self.ragged_prefills = 0  # prefills of several admitted requests in one ragged-rows call
        self.idle_step: float | None = None  # recent steps without prompt tokens, seconds (EWMA; None: none yet)

    def in_ragged_rows(self, requests: list[BatchRequest]) -> bool:
        """Return whether every request's slot lies among the rows of the ragged-rows graph (False without one)."""
        return all(r.slot < self.arena.ragged_span for r in requests)

    def ragged_mode(self, running: list[BatchRequest]) -> bool:
        """Return whether this step's rows would share a ragged-rows call: several requests run, and one drafts
        or the plain graph cannot batch them."""
        return len(running) > 1 and self.in_ragged_rows(running) and (
            not self.arena.plain_batches or any(r.state.drafting for r in running))

    def plain_steps_ragged(self) -> bool:
        """Return whether a step without drafts also takes the ragged-rows graph (in ragged mode).

        On per-session thread pools it does (8 x 1 tokens cost ~6% more than the batched decode call):
        two sessions taking turns would each spin its threads through the other's calls. On one shared
        pool (Engine.load(shared_threads=True), as `specdec serve` loads) it takes the batched decode call, where
        the plain graph has one (not int4's).
        """
        return not self.engine.shared_pool or not self.arena.plain_batches

    def ragged(self, running: list[BatchRequest], admitted: list[BatchRequest] = ()) -> RaggedCall:
        """Score every running request's last token and drafts (`row.proposal`) in ONE ragged-rows call, which
        also prefills the `admitted` requests' prompt chunks (each row its `chunk`); a draft head's request gets
        its rows' hidden states (`state.states`)."""
        fed = {r.slot: (r.cache, [r.state.context[-1]] + r.row.proposal.tokens) for r in running}
        fed.update({r.slot: (r.cache, r.chunk) for r in admitted})
        caches, rows, lengths = self.arena.ragged_rows(fed)  # a free slot's row takes no token
        greedy = all(r.raw_argmax for r in [*running, *admitted])
        heads = [r for r in running if r.hidden]
        start = time.perf_counter()
        logits = self.engine.target.forward_ragged(self.arena.ragged_binding(), caches, rows, lengths, greedy,
                                                   hidden=bool(heads))
        seconds = time.perf_counter() - start
        if heads:
            logits, states = logits
            for request in heads:  # what commit hands the head: the features of the rows it keeps
                request.state.states = states[request.slot]
        self.ragged_calls += 1
        tokens = sum(len(row) for row in rows)
        if self.on_step is not None:
            self.on_step(len(running) + len(admitted))
        for request in running:
            request.cache.count_call(seconds * len(rows[request.slot]) / tokens)
        # A shared call is not a batch-1 call: auto's t(n) does not learn from it (target_seconds 0).
        return RaggedCall([RowLogits(r, logits[r.slot], 0.0) for r in running],
                          [PromptLogits(r, logits[r.slot][-1], seconds * len(rows[r.slot]) / tokens) for r in admitted],
                          tokens)

    def observe_ragged(self, tokens: int, step_start: float, prompt_tokens: int = 0) -> None:
        """Price a step of one ragged-rows call over `tokens` tokens (all of it: planning, drafting, commits), of
        which `prompt_tokens` were prompt chunks riding it."""
        seconds = time.perf_counter() - step_start
        if tokens in self._ragged_shapes:  # a shape's first call also plans its buffers: not its cost
            self.ragged_costs.observe(tokens, seconds)
            if not prompt_tokens:
                self._observe_idle_step(seconds)
        self._ragged_shapes.add(tokens)

    def _observe_idle_step(self, seconds: float) -> None:
        """Fold a step that carried no prompt tokens into `idle_step` (an EWMA: what running requests wait between
        tokens when nothing is prefilled, the base of the prefill budget's ITL bound)."""
        self.idle_step = seconds if self.idle_step is None else self.idle_step + IDLE_SMOOTHING * (
            seconds - self.idle_step)

    def ragged_prefill(self, group: list[BatchRequest]) -> list[PromptLogits]:
        """Prefill admitted requests' prompt chunks in ONE ragged-rows call, each row its request's `chunk`."""
        fed = {r.slot: (r.cache, r.chunk) for r in group}
        caches, rows, lengths = self.arena.ragged_rows(fed)  # running requests' slots take no token
        start = time.perf_counter()
        logits = self.engine.target.forward_ragged(self.arena.ragged_binding(), caches, rows, lengths,
                                                   all(r.raw_argmax for r in group))
        seconds = time.perf_counter() - start
        self.ragged_prefills += 1
        tokens = sum(len(row) for row in rows)
        return [PromptLogits(r, logits[r.slot][-1], seconds * len(rows[r.slot]) / tokens) for r in group]

    def batched(self, plain: list[BatchRequest]) -> list[RowLogits]:
        """Score the last token of each request in `plain` (none speculates) in ONE batched decode call."""
        by_slot = {r.slot: r for r in plain}
        # Rows first..last, the slots between them parked: with the prefix cache a light load may sit in high
        # slots, and binding from slot 0 would step every row below them for nothing.
        first = min(by_slot)
        window = range(first, max(by_slot) + 1)
        caches = [by_slot[s].cache if s in by_slot else None for s in window]
        tokens = [by_slot[s].state.context[-1] if s in by_slot else 0 for s in window]
        greedy = all(r.raw_argmax for r in plain)
        start = time.perf_counter()
        parked = [self.arena.idle_length(s) for s in window]  # where a row not decoding writes
        logits = self.engine.target.forward_batch(lambda head: self.arena.binding(len(window), head, first), caches,
                                                  tokens, parked, self.arena.parked_position, greedy)
        seconds = time.perf_counter() - start
        if self.on_step is not None:
            self.on_step(len(plain))
        for request in plain:
            request.cache.count_call(seconds / len(plain))
        # A call shared by several rows is not a batch-1 call: auto's t(n) must not learn from it.
        shared = seconds if len(plain) == 1 else 0.0
        return [RowLogits(r, logits[r.slot - first][None, :], shared) for r in plain]

    def observe_batched(self, rows: int, step_start: float) -> None:
        """Price a step of one batched decode call over `rows` rows (all of it: planning, commits)."""
        seconds = time.perf_counter() - step_start
        self.batch_costs.observe(rows, seconds)
        self._observe_idle_step(seconds)

    def verify(self, request: BatchRequest) -> RowLogits:
        """Score one request's last token and drafts in a batch-1 call of its own, as the single loop does."""
        state = request.state
        drafting = state.draft_seconds
        start = time.perf_counter()
        logits = verify_call(self.engine.target, request.cache, state, request.row.proposal.tokens)
        seconds = time.perf_counter() - start
        tokens = len(request.row.proposal.tokens) + 1
        if tokens in self._verify_shapes:  # a shape's first call also plans its buffers: not its cost
            self.verify_costs.observe(tokens, seconds + drafting)
        self._verify_shapes.add(tokens)
        return RowLogits(request, logits, seconds)

    def verify_seconds(self) -> Callable[[int], float]:
        """Return t_v(n): a request's verify call over n tokens, drafting included, measured here once timed;
        before, the 1-row batched call scaled by auto's t(n)."""
        costs = self.engine.target_call_costs
        one_row = self.batch_costs.seconds(1)
        verify = self.verify_costs.table()
        return lambda tokens: verify.get(tokens) or one_row * costs.relative(tokens)

    def time_batch_calls(self, repeats: int = 3) -> dict[int, float]:
        """Time batched calls over 1, 2, 4, ... rows, and ragged-rows calls over 1, half and all rows of 1 token and
        all rows of 3 and 5 (every row attending over CALIBRATION_PAST positions); return the batched calls'
        seconds by rows. Not beside the scheduler."""
        plain_rows = _CALIBRATION_ROWS if self.arena.plain_batches else (1,)
        for rows in (r for r in plain_rows if r <= self.arena.slots):
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
            raise GenerationError(f"no ragged-rows graph of {self.arena.slots} rows or fewer here (the artifact's "
                                  f"has {self.engine.target.spec.ragged_rows}): export with --batch-rows "
                                  f"{self.arena.slots}")
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
