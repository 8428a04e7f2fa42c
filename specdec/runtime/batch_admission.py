"""The batch engine's admission: which waiting requests take KV slots between steps, and how their prompts are
prefilled.

New requests are admitted into KV slots (slots.py) while one is free within `_slot_window`: there may
be more slots than the ragged-rows graph has rows, and new requests take its rows while the load fits
them, the rest only under more load. With the prefix cache the next request is the one whose prompt
a slot holds most of (`_next_waiting`), and it skips what the slot holds (or copies what another holds).
An admitted prompt is then prefilled in chunks aligned to absolute positions (batch_chunks.py) under a
per-step token budget, the oldest prompt first (`_plan_chunks`). Its chunks ride the running requests'
step, rows of its ragged-rows call; where they cannot (nothing runs, a slot beyond the graph's rows, a
draft head), they are prefilled between steps, in ONE ragged-rows call where several can share it, else
in the plain graph's calls (`_prefill_apart`). A request starts, its first token, after its last chunk.
"""

from __future__ import annotations

import itertools
import time

import numpy as np

from specdec.runtime.batch_chunks import chunk_end, chunk_pieces, granule_end, prefill_end
from specdec.runtime.batch_request import BatchRequest
from specdec.runtime.loop import Iteration, first_token, prefill
from specdec.runtime.slots import MIN_PREFIX, common_prefix


class SlotAdmission:
    """BatchEngine's admission steps (a part of BatchEngine, split off by job).

    Reads the engine's queues (`_waiting`, `_prefilling`, `_running`, `_admitting`, under `_wake`), its
    slots (`arena`, `draft_arena`), its target calls (`calls`), its `budget` and its guards
    (`_guarded`, `_guarded_all`, `_deliver`).
    """

    def _wait_for_work(self) -> bool:
        """Wait until a request waits, prefills or runs, or idle work is due (batch_idle.py); return False once the
        engine stops. Requests cancelled while they waited end here, never prefilled."""
        with self._wake:
            while not self._stopping and not self._waiting and not self._running and not self._prefilling:
                wait = self._idle_wait()
                if wait == 0:
                    self._idle_due = True
                    return True
                self._wake.wait(wait)
            if self._stopping:
                return False
            self._idle_since = None
            for request in [r for r in self._waiting if r.cancelled.is_set()]:  # gone before its prefill
                self._waiting.remove(request)
                request.end()
            for request in self._waiting:
                request.timeline.mark("seen")
        return True

    def _admit(self) -> None:
        """Give free slots to waiting requests, which then prefill (`_prefilling`, in admission order). With the
        prefix cache each skips the prefix its slot holds or copies one another slot holds (SlotArena.take); a
        request whose draft head reads every prompt row's features takes an empty slot."""
        window = self._slot_window()
        while (request := self._admissible(window)) is not None:
            self._admitting = [request]
            prompt = request.prompt_ids
            reuse = self.prefix_cache and not request.hidden
            request.cache = self.arena.take(prompt if reuse else None, window=window, salt=request.cache_salt)
            request.timeline.mark("admitted")
            self.prefix_tokens_reused += request.cache.length
            self.prefix_tokens_queried += len(prompt) if self.prefix_cache else 0
            self._prefilling.append(request)
            self._guarded(request, self._open)
        self._admitting = []
        self._prefilling = [r for r in self._prefilling if r.holds_slot]

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
        """Return how many slots, from slot 0, this round's new requests may take: as many as are running,
        prefilling and waiting, but no fewer than the ragged-rows graph's rows (and no more while a draft head's
        request is among them: it needs that graph every step). Requests then stay in the slots a ragged call spans
        while the load fits them, and a batched call spans no more rows than the load needs (a row past the
        running ones costs a MatMul row)."""
        rows = self.arena.ragged_span
        if not rows or rows == self.arena.slots:
            return self.arena.slots
        with self._wake:
            requests = self._running + self._prefilling + list(self._waiting)
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
        shared = [self.arena.cached_prefix(r.prompt_ids, salt=r.cache_salt) for r in window]
        best = shared.index(max(shared))  # the first of the longest: order kept among equals
        best = next((i for i in range(best) if window[i].passed_over >= self.max_batch), best)
        for request in window[:best]:
            request.passed_over += 1
        del self._waiting[best]
        return window[best]

    def _open(self, request: BatchRequest) -> None:
        """Start a request that took a slot: tell its caller, give its draft model the slot's draft KV."""
        if request.on_start is not None:
            request.on_start()
        model = request.draft_model
        if model is not None and self.draft_arena is not None:
            model.cache = self.draft_arena.cache_at(request.slot, request.prompt_ids, salt=request.cache_salt)
        cache = request.cache
        cache.run_seconds = cache.rollback_seconds = 0.0
        cache.run_calls = 0

    def _plan_chunks(self) -> list[BatchRequest]:
        """Give the prefilling requests this step's prompt tokens (`chunk`), oldest first, as many whole aligned
        chunks as the step's budget leaves (prefill_budget.py; the oldest takes at least one); return those given some.
        Where the budget is bounded by the running requests' ITL, pieces of 16-token granules instead (granule_end).

        First come, first served: once a prompt's next chunk does not fit, no younger one passes it. With the
        prefix cache a request first copies what another slot now holds of its prompt, and one whose prompt an
        older request is prefilling (MIN_PREFIX tokens more than it holds) waits to copy those positions.
        """
        budget = self.budget.for_step(len(self._running), self.calls.ragged_costs.seconds, self.calls.idle_step)
        bounded = self.budget.bounds_itl(len(self._running))  # then a step may cut a chunk (granule_end)
        planned = []
        for request in self._prefilling:
            request.chunk = []
            if self._copies_prefixes(request):
                if request.awaits_copy:  # the older one it waits for prefilled more: copy all of it (cheaper)
                    self.prefix_tokens_reused += self.arena.extend(request.cache, request.prompt_ids, min_prefix=1)
                request.awaits_copy = self._waits_to_copy(request)
                if request.awaits_copy:
                    continue
            prompt, start = request.prompt_ids, request.cache.length
            if bounded:
                end = granule_end(start, len(prompt), budget, self.arena.limits_reuse)
                if end - start > budget and planned:
                    break
            else:
                end = prefill_end(start, len(prompt), budget, self.arena.limits_reuse)  # limits: lone rows differ
                if end == start:
                    if planned:
                        break
                    end = chunk_end(start, len(prompt))  # a chunk a step at least, whatever the budget
            request.chunk = prompt[start:end]
            budget -= end - start
            planned.append(request)
            request.timeline.mark("first_chunk")
        return planned

    def _copies_prefixes(self, request: BatchRequest) -> bool:
        """Return whether a prefilling request may copy positions from another slot (the prefix cache, on the CPU)."""
        return self.prefix_cache and self.arena.copies_prefixes and not request.hidden

    def _waits_to_copy(self, request: BatchRequest) -> bool:
        """Return whether an older prefilling request computes MIN_PREFIX or more positions of this one's prompt past
        what it holds (a document several requests start with: prefilled once, then copied)."""
        needed = request.cache.length + MIN_PREFIX
        for older in itertools.takewhile(lambda r: r is not request, self._prefilling):
            if older.cache_salt == request.cache_salt and common_prefix(older.prompt_ids, request.prompt_ids) >= needed:
                return True
        return False

    def _prefill_apart(self, planned: list[BatchRequest]) -> list[BatchRequest]:
        """Prefill the planned chunks that cannot ride this step's call; return those that ride it.

        A chunk rides where requests run, all in the ragged-rows graph's rows with its own, and no draft head is
        among them (a head's prefill reads the hidden rows of its own calls). The others are prefilled now: those
        in the graph's rows in ONE ragged-rows call where there are several, the rest in the plain graph's calls.
        """
        shareable = [r for r in planned if self.calls.in_ragged_rows([r]) and not r.hidden]
        for request in planned:
            if request not in shareable:
                self._guarded(request, self._prefill_plain)
        # After those: one that ends its prompt joins the running requests, maybe in a slot past the graph's rows.
        running = self._running
        rideable = bool(running) and self.calls.in_ragged_rows(running) and not any(r.hidden for r in running)
        if rideable:
            return shareable
        if len(shareable) > 1:
            self._guarded_all(shareable, lambda: self._chunks_fed(self.calls.ragged_prefill(shareable)))
        else:
            for request in shareable:
                self._guarded(request, self._prefill_plain)
        return []

    def _prefill_plain(self, request: BatchRequest) -> None:
        """Prefill a request's chunk in the plain graph's calls, one aligned piece each (none reaches the long-call
        kernel); after its prompt's last piece, start it. That piece is the single loop's prefill, unless a draft
        head needs the features of pieces before it."""
        target, cache, state, prompt = self.engine.target, request.cache, request.state, request.prompt_ids
        for first, end in chunk_pieces(cache.length, cache.length + len(request.chunk)):
            last = end == len(prompt)
            if last and not request.prefill_states:
                iteration = prefill(target, cache, state)
            else:
                start = time.perf_counter()
                output = target.forward(cache, prompt[first:end], logits_rows=1, hidden=request.hidden,
                                        greedy=request.raw_argmax)
                request.prefill_seconds += time.perf_counter() - start
                logits = output[0] if request.hidden else output
                if request.hidden:
                    request.prefill_states.append(output[1])
                iteration = first_token(state, logits[-1], np.concatenate(request.prefill_states),
                                        request.prefill_seconds) if last else None
            self.arena.prefilled(cache, end - first)
            if iteration is not None:
                self._join_running(request, iteration)
        request.chunk = []

    def _chunks_fed(self, prompts) -> None:
        """Account the chunks a shared call prefilled (a list of batch_calls.PromptLogits)."""
        for prompt in prompts:
            self._chunk_fed(prompt.request, prompt.last_logits, prompt.seconds)

    def _chunk_fed(self, request: BatchRequest, last_logits: np.ndarray, seconds: float) -> bool:
        """Account a chunk a shared call prefilled (`seconds`: the request's share of it); after its prompt's last,
        start the request from the chunk's last logits row. Return whether it started."""
        self.arena.prefilled(request.cache, len(request.chunk))
        request.chunk = []
        request.cache.count_call(seconds)
        request.prefill_seconds += seconds
        if request.cache.length < len(request.prompt_ids):
            return False
        self._guarded(request, lambda r: self._join_running(
            r, first_token(r.state, last_logits, None, r.prefill_seconds)))
        return True

    def _join_running(self, request: BatchRequest, first: Iteration) -> None:
        """Deliver a just-prefilled request's first iteration; it runs on unless that ended it."""
        request.timeline.mark("first_token")
        if request in self._prefilling:
            self._prefilling.remove(request)
        if not first.finished:
            self._running.append(request)
        self._deliver(request, first)
