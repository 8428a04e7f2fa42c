"""How many prompt tokens a batch engine step prefills: a cap, and while requests run, what their next token can wait.

Prompt chunks ride the running requests' call (batch_admission.py), so every prompt token a step takes
delays their next token. With an ITL factor F, a step takes at most the prompt tokens whose estimated
cost stays within (F - 1) x a recent step without them (vLLM's chunked prefill caps tokens only). When
nothing runs, nobody waits for a token and the cap alone applies. On 2 CPU cores F 2 held a burst's ITL
p99 at ~4x idle, not 2x: the smallest piece (16 tokens, ~1 ms each in a small ragged row) already costs
about a 2-row step, and the burst's requests join the steps as they start (benchmarks/SERVE-BATCH.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

# Prompt tokens a step takes (vLLM's max_num_batched_tokens, prompts only): two chunks. Measured against 64, 256
# and 512 on SmolLM2, 2 AVX-512 cores, 8 clients on distinct ~46-token chats: as fast (within 2%), a burst's TTFT
# p90 0.28 s (256: 0.32, 512: 0.36), its running requests' ITL p99 7-8x idle (256: 10-13x).
DEFAULT_PREFILL_TOKENS = 128
SCAN_STEP = 16  # prompt-token counts priced past the first few: a step cuts prompts at 16-token granules anyway


@dataclass(frozen=True)
class PrefillBudget:
    """A step's prompt-token budget: at most `tokens`, and while requests run, what `itl_factor` allows (None: the
    cap alone)."""

    tokens: int = DEFAULT_PREFILL_TOKENS
    itl_factor: float | None = None

    def __post_init__(self):
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 1:
            raise ValueError(f"prefill_budget must be an integer >= 1 (prompt tokens a step), got {self.tokens!r}")
        if self.itl_factor is not None and not self.itl_factor > 1:
            raise ValueError(f"the prefill ITL factor must be > 1 (or none), got {self.itl_factor!r}")

    def bounds_itl(self, running_tokens: int) -> bool:
        """Return whether a step beside `running_tokens` running tokens is bounded by their ITL (then it may cut a
        prompt's chunk into 16-token granules: batch_chunks.granule_end)."""
        return self.itl_factor is not None and running_tokens >= 1

    def for_step(self, running_tokens: int, step_seconds: Callable[[int], float], idle_step: float | None = None) -> int:
        """Return the prompt tokens this step may prefill, where the running requests feed `running_tokens` tokens,
        `step_seconds(n)` estimates a step's seconds over n tokens (the measured ragged-call costs) and `idle_step`
        is what recent steps without prompt tokens took (None: step_seconds(running_tokens))."""
        if not self.bounds_itl(running_tokens):
            return self.tokens
        return itl_bounded_tokens(running_tokens, step_seconds, self.itl_factor, self.tokens, idle_step)


def itl_bounded_tokens(running_tokens: int, step_seconds: Callable[[int], float], factor: float, cap: int,
                       idle_step: float | None = None) -> int:
    """Return the most prompt tokens p <= cap whose estimated extra cost, step_seconds(running_tokens + p) -
    step_seconds(running_tokens), is at most (factor - 1) x the step without them (`idle_step`, as measured; None:
    step_seconds(running_tokens)), counting 1..15, then multiples of 16, then cap, up to the first count that does
    not fit (0 where none does). The table prices the prompt tokens only: its small-call entries come from
    calibration calls, whose rows attend over more positions than a light load's, so a measured step is the
    better base.

    Example (a step of n tokens costing 20 ms + 1 ms a token, 2 running tokens, factor 2): 16 tokens (32 would
    cost 32 ms more than the step's 22); with steps measured at 10 ms, 10 tokens.
    """
    base = step_seconds(running_tokens)
    extra = (factor - 1) * (base if idle_step is None else idle_step)
    fits = 0
    # Upwards, stopping at the first count that does not fit: a table of noisy averages may dip further on.
    for tokens in [t for t in (*range(1, SCAN_STEP), *range(SCAN_STEP, cap, SCAN_STEP)) if t < cap] + [cap]:
        if step_seconds(running_tokens + tokens) - base > extra:
            break
        fits = tokens
    return fits
