"""The batch engine's draft calls: every drafting request's calls of a step, shared round by round.

A drafter's `draft_calls` (specdec/runtime/drafters.py) yields what each of its calls feeds and
receives the call's output, so the calls of many requests can be made together: round by round
(catch-up, then one token at a time), each round ONE call of the draft model's ragged-rows graph
over every request still drafting (a lone one: its own batch-1 call, as the single loop makes); a
draft head's (EAGLE) rounds go through the head's ragged-rows graph where `specdec distill` wrote
one. What is not shared (prompt lookup, a slot beyond the draft graph's rows) drafts as the single
loop does.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from specdec.runtime.batch_request import BatchRequest, first_drafts
from specdec.runtime.engine import Engine
from specdec.runtime.loop import draft
from specdec.runtime.slots import SlotArena


class DraftRounds:
    """Drafts every running request's row of a step, sharing the draft models' and heads' calls."""

    def __init__(self, engine: Engine, draft_arena: SlotArena | None):
        self.engine = engine
        self.draft_arena = draft_arena  # the draft model's KV slots (None: no batched draft graph)
        self.model_rounds = 0  # rounds of draft calls that shared one ragged-rows call
        self.head_rounds = 0  # rounds of draft head calls that shared the head's ragged-rows graph

    def draft_all(self, running: list[BatchRequest]) -> None:
        """Set every running request's `row.proposal` to its row.k tokens: the first k of what prompt lookup
        proposed (`row.looked_up`), or drafted now, the draft calls of all requests shared round by round."""
        by_model, by_head = {}, {}  # request -> (its draft calls, what its next call feeds)
        for request in running:
            row, state = request.row, request.state
            if row.looked_up is not None:
                row.proposal = first_drafts(row.looked_up, row.k)
                continue
            pending = self._shared_rounds(request, by_model, by_head)
            if pending is None:
                row.proposal = draft(state, row.k)
                continue
            calls = state.drafter.draft_calls(state.context, row.k)
            try:
                pending[request] = (calls, next(calls))
            except StopIteration as done:  # prompt lookup's side of a combined drafter: no call
                row.proposal = done.value
        self._rounds(by_model, self._model_round)
        self._rounds(by_head, self._head_round)

    def _shared_rounds(self, request: BatchRequest, by_model: dict, by_head: dict) -> dict | None:
        """Return the rounds whose calls the request's drafts share (of its draft model, of its head), or None:
        it drafts alone (no drafts asked, or no shared graph for it)."""
        if not request.row.k:
            return None
        if (request.draft_model is not None and self.draft_arena is not None
                and request.slot < self.draft_arena.ragged_span):
            return by_model
        head = request.draft_head
        if head is not None and head.head.ragged_session is not None:
            return by_head
        return None

    def _rounds(self, pending: dict, round_call: Callable[[dict], dict]) -> None:
        """Run the pending requests' draft calls round by round, `round_call(pending)` making each round's calls;
        set each request's row.proposal when its calls end."""
        while pending:
            start = time.perf_counter()
            outputs = round_call(pending)
            share = (time.perf_counter() - start) / len(pending)
            for request in list(pending):
                request.state.draft_seconds += share
                calls, fed = pending[request]
                self._count_call(request, fed, share, len(pending) > 1)
                try:
                    pending[request] = (calls, calls.send(outputs[request]))
                except StopIteration as done:
                    request.row.proposal = done.value
                    del pending[request]

    def _model_round(self, pending: dict) -> dict[BatchRequest, np.ndarray]:
        """Return each pending request's last logits row of its draft model's call: one ragged-rows call."""
        session = self.engine.draft
        if len(pending) == 1:
            (request, (_, feed)), = pending.items()
            return {request: session.forward(request.draft_model.cache, feed, logits_rows=1)[-1]}
        by_slot = {request.slot: request for request in pending}
        caches, rows, lengths = self.draft_arena.ragged_rows({s: (r.draft_model.cache, pending[r][1])
                                                              for s, r in by_slot.items()})
        out = session.forward_ragged(self.draft_arena.ragged_binding(), caches, rows, lengths)
        self.model_rounds += 1
        return {r: out[s][-1] for s, r in by_slot.items()}

    def _head_round(self, pending: dict) -> dict:
        """Return each pending request's HeadOutput of its draft head's call: one ragged-rows call of the head."""
        order = list(pending)
        outputs = self.engine.eagle.run_rows([pending[r][1] for r in order])
        self.head_rounds += len(order) > 1
        return dict(zip(order, outputs))

    @staticmethod
    def _count_call(request: BatchRequest, fed, seconds: float, shared: bool) -> None:
        """Count one draft call (its share of a shared one) on the drafter that made it."""
        head = request.draft_head
        if head is not None:
            head.count_call(len(fed.token_ids), seconds)
        elif shared:  # a draft model's batch-1 call counted itself
            request.draft_model.cache.count_call(seconds)
