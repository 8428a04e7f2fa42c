"""One request's generation, run on a pool thread, its text pieces handed to the event loop.

The engine is synchronous (numpy + onnxruntime), so each generation runs in a thread of a pool
sized to the requests admitted (with a batch engine, those waiting in its queue too). Cancellation
is cooperative: `cancel()` cancels the engine's stream (a batch engine drops a request still
waiting before its prefill) and sets a flag the per-iteration callback checks; raising there ends
the decode loop before its next target call, and the engine's `finally` frees the request's KV cache.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Executor, Future
from typing import Callable

from specdec.runtime import Engine, GenerationConfig, GenerationStream, Iteration
from specdec.runtime.timeline import FirstTokenTimeline


class _Stop(Exception):
    """Raised inside the engine's iteration callback to end a cancelled generation."""


class Generation:
    """Runs `engine.stream` on a thread; `events` receives ("piece", str), each after ("covers", the tokens
    the text so far holds), then one of
    ("done", GenerationResult), ("cancelled", reason) or ("error", exception). `started` is set when
    the engine starts the request (a batch engine: when a KV slot takes it)."""

    def __init__(self, engine: Engine, prompt_ids: list[int], config: GenerationConfig,
                 on_iteration: Callable[[Iteration], None] | None = None, on_end: Callable[[], None] | None = None):
        self.engine, self.prompt_ids, self.config = engine, prompt_ids, config
        self._on_iteration = on_iteration
        self._on_end = on_end  # called on the event loop once the thread is done with the engine
        self._cancel = threading.Event()
        self.cancel_reason: str | None = None
        self.iterations = 0  # decode iterations run (the prefill included)
        self.finished = threading.Event()  # set when the thread is done with the engine
        self.events: asyncio.Queue = asyncio.Queue()
        self.started = asyncio.Event()
        self._stream: GenerationStream | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, executor: Executor) -> Future:
        """Submit the generation to `executor`; call from the event loop that reads `events`."""
        self._loop = asyncio.get_running_loop()
        return executor.submit(self._run)

    def cancel(self, reason: str) -> None:
        """Ask the generation to stop before its next iteration (thread-safe, idempotent)."""
        if not self._cancel.is_set():
            self.cancel_reason = reason
            self._cancel.set()
            stream = self._stream
            if stream is not None:
                stream.cancel()

    @property
    def timeline(self) -> FirstTokenTimeline | None:
        """Return the engine's record of where the first token's wait went (a batch engine's; else None)."""
        stream = self._stream
        return stream.timeline if stream is not None else None

    @property
    def cancelled(self) -> bool:
        """Return whether cancel() was called."""
        return self._cancel.is_set()

    def emit(self, kind: str, value) -> None:
        """Hand one event to the request's reader (thread-safe): what `on_iteration` adds beside the text."""
        self._put((kind, value))

    def _put(self, event: tuple) -> None:
        try:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop has closed (shutdown): nobody is listening any more
            pass

    def _ended(self) -> None:
        if self._on_end is None:
            return
        try:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._on_end)
        except RuntimeError:  # the loop has closed (shutdown)
            pass

    def _started(self) -> None:
        try:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self.started.set)
        except RuntimeError:  # the loop has closed (shutdown)
            pass

    def _iteration(self, iteration: Iteration) -> None:
        self.iterations += 1
        if self._on_iteration is not None:
            self._on_iteration(iteration)
        if self._cancel.is_set():
            raise _Stop()

    def _run(self) -> None:
        try:
            if self._cancel.is_set():  # cancelled while it waited for a thread
                self._put(("cancelled", self.cancel_reason))
                return
            stream = self.engine.stream(self.prompt_ids, self.config, on_iteration=self._iteration,
                                        on_start=self._started)
            self._stream = stream
            if self._cancel.is_set():  # cancelled while the stream was made: cancel() did not see it
                stream.cancel()
            pieces = iter(stream)
            try:
                for piece in pieces:
                    self._put(("covers", stream.tokens_in_text))  # ahead of its piece, on the same queue
                    self._put(("piece", piece))
                    if self._cancel.is_set():
                        break
            except _Stop:
                pass
            finally:
                pieces.close()  # runs the engine's finally now, not at garbage collection
            if self._cancel.is_set():
                self._put(("cancelled", self.cancel_reason))
            else:
                self._put(("done", stream.result))
        except Exception as err:  # surfaced to the request as a 4xx/5xx in OpenAI's shape
            self._put(("error", err))
        finally:
            self.finished.set()
            self._started()  # also when it never started (cancelled, failed): nothing is left to wait for
            self._ended()

