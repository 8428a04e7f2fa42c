"""What the batch engine does while no request waits or runs: re-prefill the replies its slots keep.

A reply decoded in 1-token steps is not reusable by the chat's next turn: a lone query row rounds otherwise
than the prefill of that turn would (batch_chunks.py), so the prefix cache stops at the reply's first such
step, and the next turn prefills the reply again before its first token. Between a reply and the user's next
message there is usually time: once the engine has been idle for `IDLE_BEFORE_REPREFILL`, it computes the
kept replies again as a prefill does, one small query at a time (`SlotArena.reprefill`), so the next turn pays
for its new tokens only. A request that arrives meanwhile waits for one query at most (PREFILL_GRANULE rows).
A closed-loop client, whose next request comes within milliseconds, never waits for one.
"""

from __future__ import annotations

import time

IDLE_BEFORE_REPREFILL = 0.05  # seconds without work before re-prefilling: longer than a client's turnaround


class IdleReprefill:
    """BatchEngine's idle work (a part of BatchEngine, split off by job).

    Reads the engine's queues (under `_wake`), its target slots (`arena`), its target (`engine.target`) and
    `reprefill_when_idle`; counts `reprefilled_tokens`.
    """

    def _idle_wait(self) -> float | None:
        """Return how long the idle scheduler may sleep before re-prefilling (0: now), or None: until woken (nothing
        to re-prefill). Call with `_wake` held, the engine idle."""
        if not self.reprefill_when_idle or self.arena.reply_to_reprefill() is None:
            return None
        now = time.perf_counter()
        if self._idle_since is None:
            self._idle_since = now
        return max(0.0, self._idle_since + IDLE_BEFORE_REPREFILL - now)

    def _is_idle(self) -> bool:
        """Return whether no request waits, prefills or runs."""
        with self._wake:
            return not self._waiting and not self._prefilling and not self._running

    def _reprefill_piece(self) -> None:
        """Re-prefill one piece of the reply given back last (SlotArena.reprefill)."""
        cache = self.arena.reply_to_reprefill()
        if cache is None:
            return
        target = self.engine.target
        try:
            self.reprefilled_tokens += self.arena.reprefill(
                cache, lambda slot_cache, tokens: target.forward(slot_cache, tokens, logits_rows=1, greedy=True))
        except Exception:  # optional work: the slot forgets its tokens (no retry), the scheduler serves on
            cache.kept_ids, cache.exact = (), 0
