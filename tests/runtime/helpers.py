"""Helpers for comparing speculative output with the target's own."""

from __future__ import annotations

from specdec.runtime.diagnostics import first_mismatch
from specdec.runtime.engine import Engine, GenerationConfig


def near_tie_mismatches(engine: Engine, prompt_ids: list[int], reference: list[int], other: list[int],
                        tie: float = 1e-4) -> list[tuple[int, float]]:
    """Return [(position, top-2 logit gap)] where `other` first differs from `reference`.

    Raises AssertionError if the first difference is not at a near-tie of the target's
    top two logits (gap <= `tie`): only there may rounding legitimately flip argmax.
    """
    mismatch = first_mismatch(engine, prompt_ids, reference, other)
    if mismatch is not None:
        position, gap = mismatch["position"], mismatch["top2_logit_gap"]
        assert gap <= tie, f"mismatch at position {position} with top-2 logit gap {gap:.3g} > {tie}"
        return [(position, gap)]
    assert len(reference) == len(other) or reference[-1] in engine.eos_token_ids or other[-1] in engine.eos_token_ids
    return []


def greedy(engine: Engine, prompt: str | list[int], on_iteration=None, **overrides):
    """Return the GenerationResult of a greedy generation with the given overrides."""
    return engine.generate(prompt, GenerationConfig(**{"max_new_tokens": 48, **overrides}), on_iteration)
