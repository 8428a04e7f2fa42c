"""Admission control: at most N generations run, at most Q requests wait, the rest are turned away.

A rejected request gets 429 with Retry-After at once instead of a slot in an unbounded queue,
so a burst cannot pile up work the server will finish only after the clients gave up.
"""

from __future__ import annotations

import asyncio
import math


class Overloaded(Exception):
    """Every slot is busy and the queue is full; `retry_after` is a hint in whole seconds."""

    def __init__(self, retry_after: int):
        super().__init__(f"server is at capacity; retry in {retry_after} s")
        self.retry_after = retry_after


class Draining(Exception):
    """The server is shutting down and takes no new requests."""


class QueueTimeout(Exception):
    """The request's deadline passed while it waited for a slot."""


class Admission:
    """Counts running and waiting requests; `acquire` waits for a slot in arrival order (asyncio).

    `serving`: how many of the admitted requests generate at once, where that is fewer (a batch engine
    admits its queue too, and picks from it: with the prefix cache, the request a free slot serves best).
    """

    def __init__(self, max_running: int, max_waiting: int, serving: int | None = None):
        self.max_running, self.max_waiting = max_running, max_waiting
        self.serving = serving or max_running
        self.running = 0
        self.waiting = 0
        self.draining = False
        self._slots: asyncio.Semaphore | None = None  # made in the serving loop on first use
        self._service_seconds = 1.0  # EWMA of a request's time in its slot, for Retry-After

    async def acquire(self, timeout: float) -> float:
        """Take a slot within `timeout` seconds; return the seconds waited.

        Raises Draining, Overloaded (queue full) or QueueTimeout.
        """
        if self.draining:
            raise Draining()
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_running)
        if not self._slots.locked() and not self.waiting:  # a free slot: taken now, never counted as waiting
            await self._slots.acquire()
            self.running += 1
            return 0.0
        if self.waiting >= self.max_waiting:
            raise Overloaded(self.retry_after())
        loop = asyncio.get_running_loop()
        start = loop.time()
        self.waiting += 1
        try:
            await asyncio.wait_for(self._slots.acquire(), timeout=max(timeout, 0.0))
        except asyncio.TimeoutError:
            raise QueueTimeout() from None
        finally:
            self.waiting -= 1
        self.running += 1
        return loop.time() - start

    def release(self, service_seconds: float | None = None) -> None:
        """Give a slot back; `service_seconds` (time it was held) refines Retry-After."""
        self.running -= 1
        assert self._slots is not None
        self._slots.release()
        if service_seconds is not None:
            self._service_seconds = 0.8 * self._service_seconds + 0.2 * service_seconds

    def retry_after(self) -> int:
        """Return seconds until the queue ahead has likely drained once: whole seconds, at least 1."""
        rounds = (self.waiting + self.running) / max(self.serving, 1)
        return max(1, math.ceil(rounds * self._service_seconds))
