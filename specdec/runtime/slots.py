"""KV slots for the batch engine: one preallocated [slots, kv_heads, capacity, head_dim] buffer per tensor.

Row s of every buffer is slot s. A request's cache is a KVCache over views of its row (KVView: an
address, which an IOBinding takes on the CPU and on CUDA alike), so a prefill and a verify call are
today's batch-1 calls, written in place; a batched decode call binds rows 0..n-1 of the same buffers
(one contiguous prefix: batch is the outermost axis). Nothing is copied per step, a rollback is
still only a shorter length, and a finished request's slot goes to the next one. The lowest free
slot is taken first, so the rows a batched call spans stay few. The buffers live where the session
runs; a prompt's prefix is copied from another slot only on the CPU (onnxruntime's Python API has
no device-to-device copy of part of a buffer), while a slot's own kept prefix is reused anywhere.
"""

from __future__ import annotations

import heapq
import threading
from typing import Callable

import numpy as np

from specdec.models.errors import GenerationError
from specdec.runtime.kv_cache import KVCache, KVView
from specdec.runtime.providers import ort
from specdec.runtime.batch_chunks import AMONG, last_row, prefill_start, reprefill_piece
from specdec.runtime.session import CallBinding, ModelSession

NEAR_PREFIX = 4  # tokens of reuse a request gives up to take a lower free slot (`SlotArena._lowest_near`)
HOST_DEVICES = ("cpu",)  # where the arena's buffers are numpy arrays (prefix copies between slots need them)
MIN_PREFIX = 16  # prompt tokens a cached prefix must cover to be reused (fewer: a prefill of them costs ~nothing)


class SlotCache(KVCache):
    """A request's cache inside the arena: its row's views, which never grow (no copy out of the arena)."""

    slot: int = -1
    kept_ids: tuple[int, ...] = ()  # the last request's tokens, whose KV stays valid in the row while it is free
    salt: str | None = None  # the cache_salt of the request whose tokens it holds: only its equals reuse them
    # Leading positions of its tokens (or kept ones) whose KV a fresh chunked prefill of them computes bit for bit
    # alike: those a prefill or a verify call wrote (SlotArena.prefilled, .scored), not a query's lone last row nor a
    # 1-token step's.
    exact: int = 0
    released: int = 0  # when it was last given back (the arena's count of releases)

    def reserve(self, positions: int) -> None:
        """Raise GenerationError when `positions` do not fit the slot (the arena's capacity is fixed)."""
        if positions > self.capacity:
            raise GenerationError(f"a sequence of {positions} positions does not fit a KV slot of {self.capacity}; "
                                  "start the engine with a larger KV capacity")

    def release(self) -> None:
        """Forget the tokens (keeping them as `kept_ids`); the views stay, for the slot's next request."""
        if self.token_ids:
            self.kept_ids = tuple(self.token_ids)
        self.token_ids = []


class SlotArena:
    """`slots` KV slots of `capacity` positions for one shared-buffer model session, on its device."""

    def __init__(self, session: ModelSession, slots: int, capacity: int, keep_prefixes: bool = False,
                 exact_prefixes: bool = False):
        if not session.shared_kv:
            raise GenerationError("this artifact's target graph returns a new KV cache every call (concat: "
                                  "--no-shared-kv, or a family without a shared buffer); the batch engine needs "
                                  "a shared-buffer graph: re-export without --no-shared-kv, or serve with "
                                  "--max-batch 1")
        spec = session.spec
        padded = spec.pads_calls  # its plain graph's batched op would take 1 row
        if not session.batches and not (padded and spec.ragged_rows == slots and session.ragged_session()):
            raise GenerationError(
                spec.slots_refusal(slots) or
                "this artifact's target graph runs one sequence per call (exported before the batch engine, or "
                "int4 before its ragged-rows graph): re-export it with `specdec export` to serve several requests "
                "in one call")
        self.session = session
        self.slots = slots
        # A free slot keeps its last request's KV for the prefix cache; else its row attends over nothing.
        self.keep_prefixes = keep_prefixes
        # With `exact_prefixes` (the target's slots, prefilled in aligned chunks: batch_chunks.py) a prompt reuses
        # only positions a fresh prefill of it computes alike (SlotCache.exact), never a lone query row's. A graph
        # whose attention never runs on one query row (int4, --exact-steps) computes every position alike, decoded
        # ones included, and so does not limit. A draft's slots reuse any position (drafts never change the text).
        self.limits_reuse = exact_prefixes and not spec.attention_pad_rows
        # Requests stay below the last position (a check against the fixed capacity, kept from when parked rows
        # wrote there; they now write just past what their slot holds: idle_length).
        self.capacity = min(capacity, spec.max_positions)
        self.parked_position = self.capacity - 1
        shape = (slots, spec.num_kv_heads, self.capacity, spec.head_dim)
        dtype = np.dtype(spec.kv_dtype)
        device = session.device
        if device in HOST_DEVICES:  # numpy arrays, which the OrtValues share and the prefix copies write
            self.host_buffers: list[np.ndarray] | None = [np.zeros(shape, dtype) for _ in range(2 * spec.num_layers)]
            self.buffers = [ort.OrtValue.ortvalue_from_numpy(b) for b in self.host_buffers]
        else:  # onnxruntime's memory on the device, zeroed by one copy from the host (no device memset)
            self.host_buffers = None
            self.buffers = [ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, device, 0)
                            for _ in range(2 * spec.num_layers)]
            zeros = np.zeros(shape, dtype)
            for buffer in self.buffers:
                buffer.update_inplace(zeros)
        row_bytes = dtype.itemsize * int(np.prod(shape[1:]))

        def views(first: int, rows: int) -> list[KVView]:
            return [KVView(device, dtype, (rows,) + shape[1:], b.data_ptr() + first * row_bytes) for b in self.buffers]

        self._views = views
        self._caches = [SlotCache(tensors=views(s, 1), slicer=None, device=device, max_positions=self.parked_position)
                        for s in range(slots)]
        for slot, cache in enumerate(self._caches):
            cache.slot = slot
        self._window_bindings: dict[tuple[int, int, bool], CallBinding] = {}
        self._ragged_binding: CallBinding | None = None
        self._free = list(range(slots))
        self._releases = 0
        self.prefix_copies = 0  # prompts that took their prefix from another slot's KV
        self.prefix_stashes = 0  # kept prefixes moved above the window before their slot was overwritten
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Return the bytes the arena holds (allocated once, at start)."""
        return sum(b.tensor_size_in_bytes() for b in self.buffers)

    @property
    def copies_prefixes(self) -> bool:
        """Return whether a prompt's prefix can be copied from another slot's KV (host memory: the CPU)."""
        return self.host_buffers is not None

    @property
    def used(self) -> int:
        """Return how many slots requests hold now."""
        return self.slots - len(self._free)

    @property
    def positions_used(self) -> int:
        """Return the positions cached across all held slots (for KV-usage metrics)."""
        with self._lock:
            free = set(self._free)
        return sum(c.length for s, c in enumerate(self._caches) if s not in free)

    def cached_prefix(self, prompt_ids: list[int], min_prefix: int = MIN_PREFIX, salt: str | None = None) -> int:
        """Return the longest prefix of `prompt_ids` that a slot's KV holds for requests of `salt` and `take` can
        give it: any slot's where prefixes are copied, else a free slot's (0 below `min_prefix`)."""
        with self._lock:
            _, shared = self._longest_prefix(prompt_ids, range(self.slots) if self.copies_prefixes else self._free,
                                             salt)
        return shared if shared >= min_prefix else 0

    def _shared(self, slot: int, prompt_ids: list[int], salt: str | None) -> int:
        """Return how many leading tokens of `prompt_ids` slot `slot` holds for requests of `salt` (0: another
        salt's tokens). Call with the lock held."""
        cache = self._caches[slot]
        return common_prefix(self._reusable_ids(cache), prompt_ids) if cache.salt == salt else 0

    def _longest_prefix(self, prompt_ids: list[int], slots, salt: str | None = None) -> tuple[int | None, int]:
        """Return (the slot, tokens) of the longest prefix of `prompt_ids` whose KV one of `slots` holds for
        requests of `salt`: a free slot's kept prefix, or a running request's context (its positions never change
        while it runs); the first such slot among equals, (None, 0) where none shares a token. Call with the lock
        held."""
        best, shared = None, 0
        for slot in slots:
            common = self._shared(slot, prompt_ids, salt)
            if common > shared:
                best, shared = slot, common
        return best, shared

    def _lowest_near(self, prompt_ids: list[int], free: list[int], at_least: int,
                     salt: str | None = None) -> tuple[int, int]:
        """Return (the lowest of `free` (sorted) holding `at_least` tokens of the prompt's prefix, those tokens).
        Prompts that share a system prompt land on slots whose kept prefixes differ by a word or two: the longest
        one would scatter a light load over the window, and every batched call spans from its lowest running slot
        to its highest. Call with the lock held."""
        for slot in free:
            common = self._shared(slot, prompt_ids, salt)
            if common >= at_least:
                return slot, common
        raise AssertionError("the longest prefix's slot is among them")

    @property
    def ragged_span(self) -> int:
        """Return how many slots, from slot 0, the ragged-rows graph spans (0: no ragged-rows graph here)."""
        return self.session.spec.ragged_rows if self.ragged else 0

    def free_below(self, window: int) -> int:
        """Return how many of slots 0..window-1 are free."""
        with self._lock:
            return sum(1 for s in self._free if s < window)

    def take(self, prompt_ids: list[int] | None = None, min_prefix: int = MIN_PREFIX,
             window: int | None = None, salt: str | None = None) -> SlotCache | None:
        """Return a free slot's cache among slots 0..window-1 (None: all), or None when all of those are held.

        Without `prompt_ids` (or no slot sharing `min_prefix` tokens with it), the lowest free slot,
        empty. With them, the free slot whose last request shares the longest prefix with the prompt: its
        cache then already holds that prefix (up to where the prefill starts: batch_chunks.prefill_start),
        which the prefill skips; but an empty slot where that prefix is under half the prompt and the slot
        holds more. Only positions a fresh prefill computes alike count (`exact_prefixes`).
        Where a running request's context (or a free slot's outside the window) shares `min_prefix` more
        tokens (a system prompt or a document many requests start with), those positions are copied into the
        free slot instead of prefilled (on the CPU). On the CPU, a prompt that shares a head with what a free slot above
        the lowest keeps (a system prompt, not its own earlier turn) takes a lower free slot and a copy of the head.
        Only tokens held for requests of `salt` count.
        """
        window = self.slots if window is None else window
        with self._lock:
            free = sorted(s for s in self._free if s < window)
            if not free:
                return None
            best, shared = self._longest_prefix(prompt_ids, free, salt) if prompt_ids else (None, 0)
            if shared >= min_prefix:
                best, shared = self._lowest_near(prompt_ids, free, max(min_prefix, shared - NEAR_PREFIX), salt)
            # Copied from: a running request's context, or what a free slot outside the window kept.
            source, copied = (self._longest_prefix(prompt_ids, [s for s in range(self.slots) if s not in free], salt)
                              if prompt_ids and self.copies_prefixes else (None, 0))
            empty = [s for s in free if not self._reusable_ids(self._caches[s])]
            if (self.copies_prefixes and best is not None and best != free[0] and min_prefix <= shared
                    and len(self._reusable_ids(self._caches[best])) > shared and copied < shared + min_prefix):
                # A head the prompt shares with another prompt (a system prompt), kept in a higher slot: a lower free
                # one (empty if one is) takes a copy of it, and either way one kept prompt is overwritten. Other
                # prompts (another cache_salt's) may keep the slots between, and a light load spread over them
                # would widen every batched call.
                lower = min((s for s in free if s < best), key=lambda s: (s not in empty, s))
                source, copied, shared, best = best, shared, 0, lower
            # Reusing under half the prompt (a shared system prompt) would cut a longer cached context short:
            # an empty slot costs only those few tokens' prefill (or their copy).
            elif best is None or shared < min_prefix or copied >= shared + min_prefix or (
                    empty and 2 * shared < len(prompt_ids) and len(self._reusable_ids(self._caches[best])) > shared):
                shared = 0
                # Keep the cached prefixes most likely to be asked for again: an empty slot, else one whose
                # prefix another slot holds too, else the one given back longest ago. Without a prompt, the
                # lowest slot (the batched calls' rows stay few).
                best = min(free, key=lambda s: (self._holds_only_copy(s, min_prefix),
                                                bool(self._reusable_ids(self._caches[s])),
                                                self._caches[s].released)) if prompt_ids else free[0]
            if self.keep_prefixes:  # never onto the slot the prompt's prefix is about to be copied from
                self._stash(best, window, shared, min_prefix, source if copied >= min_prefix else None)
            self._free.remove(best)
            heapq.heapify(self._free)
        cache = self._caches[best]
        cache.kept_ids, cache.salt = (), salt  # from now on its positions are the new request's
        if not shared and source is not None and copied >= min_prefix:
            shared = self._copy_prefix(source, best, self._start(prompt_ids, copied))
        shared = self._start(prompt_ids, shared) if shared else 0
        cache.token_ids = list(prompt_ids[:shared]) if shared else []
        cache.exact = shared
        return cache

    def extend(self, cache: SlotCache, prompt_ids: list[int], min_prefix: int = MIN_PREFIX) -> int:
        """Copy more of a prompt into `cache` (its request's, prefilling it) from another slot, where one holds at
        least `min_prefix` more of its positions (an older request prefilled them meanwhile; on the CPU); return
        the positions copied."""
        if not self.copies_prefixes:
            return 0
        with self._lock:
            source, shared = self._longest_prefix(prompt_ids, [s for s in range(self.slots) if s != cache.slot],
                                                  cache.salt)
        start = self._start(prompt_ids, shared)
        held = cache.length
        if source is None or start < held + min_prefix:
            return 0
        self._copy_positions(source, cache.slot, start, held)
        self.prefix_copies += 1
        cache.token_ids = list(prompt_ids[:start])
        cache.exact = start
        return start - held

    def prefilled(self, cache: SlotCache, rows: int) -> None:
        """Note that a prefill just wrote `rows` positions at the end of `cache` in one query: a later prompt may reuse
        them, but not the last where the query computed it alone (a lone row, or a block's tail: batch_chunks.last_row;
        a longer prompt's prefill computes it among others) nor any after it (SlotCache.exact)."""
        if cache.exact == cache.length - rows:
            cache.exact = cache.length - (0 if last_row(rows) == AMONG else 1)

    def scored(self, cache: SlotCache, start: int, rows: int) -> None:
        """Note that a step's query of `rows` rows from position `start` (the last token and its drafts) was
        committed: the positions it kept are computed as a fresh prefill computes them where the query had 2+ rows
        (a lone row rounds otherwise), all but its last row unless that row lies among others (`last_row`), and
        every position before `start` was (SlotCache.exact). So a reply decoded with drafts every step is reused
        on the chat's next turn; one 1-token step ends what may be reused there."""
        if cache.exact != start or rows < 2:
            return
        cache.exact = min(cache.length, start + rows - (0 if last_row(rows) == AMONG else 1))

    def reply_to_reprefill(self) -> SlotCache | None:
        """Return the free slot whose kept tokens' KV a later prompt could reuse only in part (a reply's 1-token steps
        round otherwise than a prefill), the one given back last, or None: nothing to re-prefill, or reuse is not
        limited to exact positions (no prefix cache; a graph whose attention never runs on one query row)."""
        if not (self.keep_prefixes and self.limits_reuse):
            return None
        with self._lock:
            free = list(self._free)
        candidates = [self._caches[s] for s in free
                      if reprefill_piece(self._caches[s].exact, len(self._caches[s].kept_ids)) is not None]
        return max(candidates, key=lambda c: c.released, default=None)

    def reprefill(self, cache: SlotCache, forward: Callable[[SlotCache, list[int]], object]) -> int:
        """Compute the next piece of a free slot's kept tokens past its exact ones as a fresh prefill does
        (`forward(cache, tokens)` runs the target over them; batch_chunks.reprefill_piece), so a later prompt reuses
        them; return the positions computed. Only the scheduler thread takes slots, so this one stays free."""
        kept = cache.kept_ids
        piece = reprefill_piece(cache.exact, len(kept))
        if piece is None or cache.token_ids:
            return 0
        start, end = piece
        cache.token_ids = list(kept[:start])
        try:
            forward(cache, list(kept[start:end]))
            cache.exact = end
        finally:
            cache.token_ids, cache.kept_ids = [], kept  # the positions past `end` keep their KV (not yet exact)
        return end - start

    def _start(self, prompt_ids: list[int], reusable: int) -> int:
        """Return where the prompt's prefill starts when `reusable` of its positions could be reused
        (batch_chunks.prefill_start)."""
        return prefill_start(reusable, len(prompt_ids), self.limits_reuse)

    def _reusable_ids(self, cache: SlotCache) -> list[int] | tuple[int, ...]:
        """Return the tokens whose KV a slot holds for a later prompt: its running request's, else what its last
        request left; only the leading `exact` ones where reuse is limited to them."""
        ids = cache.token_ids or cache.kept_ids
        return ids[:cache.exact] if self.limits_reuse else ids

    def _copy_prefix(self, source: int, slot: int, positions: int) -> int:
        """Copy a prompt's first `positions` from slot `source` into slot `slot`; return `positions`."""
        self._copy_positions(source, slot, positions)
        self.prefix_copies += 1
        return positions

    def _copy_positions(self, source: int, slot: int, positions: int, first: int = 0) -> None:
        """Copy positions first..positions-1 of every KV buffer from slot `source` to slot `slot`."""
        for buffer in self.host_buffers:
            buffer[slot, :, first:positions] = buffer[source, :, first:positions]

    def _holds_only_copy(self, slot: int, slack: int) -> bool:
        """Return whether slot `slot` keeps a prefix no other slot holds (all of it but `slack` last tokens at
        most). Call with the lock held."""
        kept = tuple(self._reusable_ids(self._caches[slot]))
        need = len(kept) - slack
        if need < 1:
            return False
        head = kept[:need]
        salt = self._caches[slot].salt
        return not any(other != slot and self._caches[other].salt == salt
                       and tuple(self._reusable_ids(self._caches[other])[:need]) == head for other in range(self.slots))

    def _stash(self, slot: int, window: int, shared: int, min_prefix: int, keep: int | None = None) -> None:
        """Before a request that reuses `shared` of its tokens overwrites free slot `slot`, copy the prefix the
        slot keeps (where the request keeps under half of it and no other slot holds it) into a free slot outside
        the window that keeps nothing or an older prefix, so a later prompt copies it back instead of prefilling
        it. Slots above the window take no new requests under a light load (`BatchEngine._slot_window`); this
        keeps them useful. Never onto slot `keep`: the prompt's prefix is copied from it next. Call with the
        lock held."""
        victim = self._caches[slot]
        kept = len(self._reusable_ids(victim))
        if not self.copies_prefixes or 2 * shared >= kept or kept < min_prefix or \
                not self._holds_only_copy(slot, min_prefix):
            return
        spares = [s for s in self._free if s >= window and s not in (slot, keep)]
        if not spares:
            return
        spare = min(spares, key=lambda s: (bool(self._reusable_ids(self._caches[s])), self._caches[s].released))
        held = self._caches[spare]
        if self._reusable_ids(held) and held.released > victim.released:
            return  # every spare keeps a prefix given back more recently than this one
        self._copy_positions(slot, spare, kept)
        held.kept_ids, held.released, held.exact, held.salt = victim.kept_ids, victim.released, victim.exact, victim.salt
        self.prefix_stashes += 1

    def ragged_rows(self, fed: dict[int, tuple[KVCache, list[int]]]
                    ) -> tuple[list[KVCache | None], list[list[int]], list[int]]:
        """Return (caches, rows, past lengths) of one ragged-rows call, a row per slot it spans: slot s's request
        cache and tokens where `fed` has s, else no cache, no token and the slot's idle length."""
        if any(slot >= self.ragged_span for slot in fed):
            raise ValueError(f"a ragged-rows call spans slots 0..{self.ragged_span - 1}, asked for {sorted(fed)}")
        caches, rows, lengths = [], [], []
        for slot in range(self.ragged_span):
            cache, tokens = fed.get(slot, (None, []))
            caches.append(cache)
            rows.append(tokens)
            lengths.append(self.idle_length(slot) if cache is None else cache.length)
        return caches, rows, lengths

    def cache_at(self, slot: int, prompt_ids: list[int], min_prefix: int = MIN_PREFIX,
                 salt: str | None = None) -> SlotCache:
        """Return slot `slot`'s cache for a request of `prompt_ids` (and `salt`), for a second model whose slots
        follow the target's (the draft). With the prefix cache it holds the longest prefix of the prompt that it
        kept or (`min_prefix` tokens more) another slot holds for requests of `salt`, copied; else it is empty."""
        cache = self._caches[slot]
        shared = min(common_prefix(cache.kept_ids, prompt_ids) if cache.salt == salt else 0, len(prompt_ids) - 1)
        cache.kept_ids, cache.salt = (), salt
        if self.keep_prefixes and self.copies_prefixes:
            with self._lock:
                source, copied = self._longest_prefix(prompt_ids, [s for s in range(self.slots) if s != slot], salt)
            if source is not None and copied >= shared + min_prefix:
                shared = self._copy_prefix(source, slot, min(copied, len(prompt_ids) - 1))
        cache.token_ids = list(prompt_ids[:shared]) if self.keep_prefixes else []
        return cache

    def free(self, cache: SlotCache) -> None:
        """Forget a cache's tokens when its request ends (kept as a prefix with the prefix cache), for a second
        model whose slots follow the target's: its slot is the target slot's, never taken or given here."""
        cache.release()
        if not self.keep_prefixes:
            cache.kept_ids = ()

    def give(self, cache: SlotCache) -> None:
        """Take back a slot whose request has ended."""
        cache.release()
        if not self.keep_prefixes:
            cache.kept_ids = ()
        with self._lock:
            self._releases += 1
            cache.released = self._releases
            heapq.heappush(self._free, cache.slot)

    def binding(self, rows: int, greedy_head: bool, first: int = 0) -> CallBinding:
        """Return the reusable binding of a batched call over slots first..first+rows-1 (KV bound to those rows,
        contiguous in every buffer)."""
        key = (first, rows, greedy_head)
        call = self._window_bindings.get(key)
        if call is None:
            session = self.session
            call = self._window_bindings[key] = CallBinding(session.session.io_binding())
            call.bind_cache(session._past_names, session._present_names, self._views(first, rows))
        return call

    @property
    def plain_batches(self) -> bool:
        """Return whether steps without drafts can be one batched call of the plain graph (one token a row);
        else every shared step is a ragged-rows call (int4 and --exact-steps targets: their attention never
        runs on one query row, and the plain graph's batched op takes one)."""
        return self.session.batches

    @property
    def ragged(self) -> bool:
        """Return whether one call can take the rows of slots 0..R-1 with any token count (the ragged-rows graph
        of R rows, R <= slots: a step whose requests all lie below R)."""
        spec = self.session.spec
        return 0 < spec.ragged_rows <= self.slots and self.session.ragged_session() is not None

    def ragged_binding(self) -> CallBinding:
        """Return the reusable binding of the ragged-rows graph: row r's KV bound to slot r, once for all calls."""
        if self._ragged_binding is None:
            session = self.session
            call = CallBinding(session.ragged_session().io_binding())
            rows = range(self.ragged_span)
            call.bind_cache([f"{name}.{r}" for r in rows for name in session._past_names],
                            [f"{name}.{r}" for r in rows for name in session._present_names],
                            [tensor for r in rows for tensor in self._caches[r].tensors])
            self._ragged_binding = call
        return self._ragged_binding

    def idle_length(self, slot: int) -> int:
        """Return where the row of a slot that is not decoding may write a throwaway token: past what the slot
        holds (a running request's cache, or the prefix a free slot keeps for the prefix cache), so the row
        attends over no more than that."""
        cache = self._caches[slot]
        # a graph with an attention pad also writes one throwaway position after the token
        return min(max(cache.length, len(cache.kept_ids)), self.parked_position - self.session.spec.attention_pad_rows)


def common_prefix(kept: tuple[int, ...] | list[int], prompt: list[int]) -> int:
    """Return how many leading tokens `kept` and `prompt` share."""
    n = 0
    for a, b in zip(kept, prompt):
        if a != b:
            break
        n += 1
    return n
