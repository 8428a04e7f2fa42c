"""Where a batch engine request's time to first token goes: the points it passes, and the parts between them.

The scheduler stamps each point once (time.perf_counter()) as the request passes it; a server adds the
part before the engine (its checks and admission) and the part after it (detokenizing, the event loop),
so the parts sum to the TTFT its clients see (specdec/serve/app.py, `specdec:ttft_part_seconds`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

# The engine's parts, in the order a request passes them.
ENGINE_PARTS = ("step_boundary", "slot_wait", "chunk_wait", "prefill")


@dataclass
class FirstTokenTimeline:
    """When one request reached each point on its way to its first token (perf_counter seconds; None: not yet)."""

    submitted: float  # handed to the engine (BatchEngine.stream)
    seen: float | None = None  # the scheduler's first look at it, between steps (the running step had to end)
    admitted: float | None = None  # it took a KV slot (all were busy, or outside the slot window, until then)
    first_chunk: float | None = None  # the step carrying its first prompt chunk began (older prompts took the budget)
    first_token: float | None = None  # its first token was computed and handed to its stream

    @classmethod
    def now(cls) -> FirstTokenTimeline:
        """Return a timeline submitted now."""
        return cls(time.perf_counter())

    def mark(self, point: str) -> None:
        """Stamp `point` now unless it was stamped already (a point is passed once)."""
        if getattr(self, point) is None:
            setattr(self, point, time.perf_counter())

    def parts(self) -> dict[str, float] | None:
        """Return {part: seconds} of ENGINE_PARTS, from submission to the first token (None before the first token)."""
        points = (self.submitted, self.seen, self.admitted, self.first_chunk, self.first_token)
        if any(point is None for point in points):
            return None
        return {part: max(end - start, 0.0) for part, start, end in zip(ENGINE_PARTS, points, points[1:])}
