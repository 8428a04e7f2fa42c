"""The batch engine's admission: which waiting requests take KV slots between steps, and how they are prefilled.

New requests are admitted into KV slots (slots.py) while one is free within `_slot_window`: there may
be more slots than the ragged-rows graph has rows, and new requests take its rows while the load fits
them, the rest only under more load. With the prefix cache the next request is the one whose prompt
a slot holds most of (`_next_waiting`). Those admitted together are prefilled in one ragged-rows call;
a short prompt rest rides the running requests' next step call instead (`_rides_step`), a long one
is prefilled first in a call of its own.
"""

from __future__ import annotations

import itertools

import numpy as np

from specdec.runtime.batch_request import BatchRequest
from specdec.runtime.loop import Iteration, first_token, prefill
from specdec.runtime.session import LONG_CALL_ROWS
from specdec.runtime.slots import MIN_PREFIX, common_prefix


class SlotAdmission:
    """BatchEngine's admission steps (a part of BatchEngine, split off by job).

    Reads the engine's queues (`_waiting`, `_running`, `_admitting`, under `_wake`), its slots (`arena`,
    `draft_arena`), its target calls (`calls`) and its guards (`_guarded`, `_guarded_all`, `_deliver`).
    """

    def _wait_for_work(self) -> bool:
        """Wait until a request waits or runs; return False once the engine stops. Requests cancelled while they
        waited end here, never prefilled."""
        with self._wake:
            while not self._stopping and not self._waiting and not self._running:
                self._wake.wait()
            if self._stopping:
                return False
            for request in [r for r in self._waiting if r.cancelled.is_set()]:  # gone before its prefill
                self._waiting.remove(request)
                request.end()
        return True

    def _admit(self) -> list[BatchRequest]:
        """Give free slots to waiting requests; return those that took one and are not prefilled yet.

        Every request a slot takes now is prefilled in one ragged-rows call (a burst of arrivals waits for one
        call, not one after another); but a prompt that starts like one already in the group, for MIN_PREFIX
        tokens more than some slot holds already, waits for that one's prefill, then copies the prefix it
        computed (a document many requests start with). A chat template's system prompt that a slot holds is
        copied now: waiting for it would prefill every chat arrival alone.
        """
        group: list[BatchRequest] = []
        window = self._slot_window()
        while (request := self._admissible(window)) is not None:
            self._admitting = [*group, request]
            prompt = request.prompt_ids
            if self.prefix_cache and group:
                held = self.arena.cached_prefix(prompt)
                if any(common_prefix(r.prompt_ids, prompt) >= held + MIN_PREFIX for r in group):
                    self._prefill_all(group)
                    group = []
            request.cache = self.arena.take(prompt if self.prefix_cache else None, window=window)
            self.prefix_tokens_reused += request.cache.length
            self.prefix_tokens_queried += len(prompt) if self.prefix_cache else 0
            group.append(request)
        return group

    def _admissible(self, window: int) -> BatchRequest | None:
        """Return (and dequeue) the next waiting request to admit while one of slots 0..window-1 is free, else None."""
        with self._wake:
            while self._waiting and self.arena.free_below(window) and not self._stopping:
                request = self._next_waiting()
                if request.cancelled.is_set():
                    request.end()
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
        if any(r.hidden for r in requests):
            return rows
        return max(rows, min(len(requests), self.arena.slots))

    def _next_waiting(self) -> BatchRequest:
        """Return (and dequeue) the next request to admit: the first waiting, unless the prefix cache holds a
        longer prefix for one of the next 2 x `max_batch` (then that one; no request is passed over more than
        `max_batch` times). Requests of equal length otherwise land on each other's cached prompts whenever
        slots free one at a time."""
        if not self.prefix_cache or len(self._waiting) == 1:
            return self._waiting.popleft()
        window = list(itertools.islice(self._waiting, 2 * self.max_batch))
        shared = [self.arena.cached_prefix(r.prompt_ids) for r in window]
        best = shared.index(max(shared))  # the first of the longest: order kept among equals
        best = next((i for i in range(best) if window[i].passed_over >= self.max_batch), best)
        for request in window[:best]:
            request.passed_over += 1
        del self._waiting[best]
        return window[best]

    def _rides_step(self, group: list[BatchRequest]) -> list[BatchRequest]:
        """Return the requests that just took slots whose prompts are prefilled in the running requests' next
        step: none unless some run, every slot lies among the ragged-rows graph's rows and no draft head needs
        a prefill's hidden rows (the head's prefill runs in the single loop's call); then those whose prompt
        rest is at most LONG_CALL_ROWS tokens. A ragged call computes every row's logits, so beyond that a
        prefill of its own (the last row's logits, the long-call kernel) costs less than the call it saves."""
        requests = self._running + group
        if not self._running or not self.calls.in_ragged_rows(requests) or any(r.hidden for r in requests):
            return []
        return [r for r in group if r.rest_tokens <= LONG_CALL_ROWS]

    def _open_all(self, group: list[BatchRequest]) -> list[BatchRequest]:
        """Open every request that just took a slot; return those still holding one."""
        for request in group:
            self._guarded(request, self._open)
        return [r for r in group if r.holds_slot]

    def _open(self, request: BatchRequest) -> None:
        """Start a request that took a slot: tell its caller, give its draft model the slot's draft KV."""
        if request.on_start is not None:
            request.on_start()
        model = request.draft_model
        if model is not None and self.draft_arena is not None:
            model.cache = self.draft_arena.cache_at(request.slot, request.prompt_ids)
        cache = request.cache
        cache.run_seconds = cache.rollback_seconds = 0.0
        cache.run_calls = 0

    def _prefill_all(self, group: list[BatchRequest]) -> None:
        """Prefill the requests that just took slots: in one ragged-rows call where there are several (each row
        its prompt's rest), else in the single loop's call."""
        group = self._open_all(group)
        if len(group) < 2 or not self.calls.in_ragged_rows(group) or any(r.hidden for r in group):
            for request in group:
                self._guarded(request, lambda r: self._join_running(r, prefill(self.engine.target, r.cache, r.state)))
            return
        self._guarded_all(group, lambda: self._start_all(self.calls.ragged_prefill(group)))

    def _start_all(self, prompts) -> None:
        """Start every request whose prompt a shared call prefilled (a list of batch_calls.PromptLogits)."""
        for prompt in prompts:
            self._start_from(prompt.request, prompt.last_logits, prompt.seconds)

    def _start_from(self, request: BatchRequest, last_logits: np.ndarray, seconds: float) -> None:
        """Start a request whose prompt a shared call prefilled: its first token from the prompt's last logits
        row; `seconds` is its share of the call."""
        request.cache.count_call(seconds)
        self._guarded(request, lambda r: self._join_running(r, first_token(r.state, last_logits, None, seconds)))

    def _join_running(self, request: BatchRequest, first: Iteration) -> None:
        """Deliver a just-prefilled request's first iteration; it runs on unless that ended it."""
        if not first.finished:
            self._running.append(request)
        self._deliver(request, first)
