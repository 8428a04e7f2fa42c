"""Helpers for comparing speculative output with the target's own."""

from __future__ import annotations

import numpy as np

from specdec.runtime.call_costs import TargetCallCosts
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


def chi2_critical(dof):
    """Return the 0.001 upper quantile of chi-square(dof) (Wilson-Hilferty approximation)."""
    return dof * (1 - 2 / (9 * dof) + 3.09 * np.sqrt(2 / (9 * dof))) ** 3


def chi2_fits(counts, probs):
    """Return (chi2, critical): goodness of fit of counts to probs over the cells with probs > 0."""
    counts = np.asarray(counts, dtype=float)
    assert counts[probs == 0].sum() == 0, "drew a token of probability 0"
    n, cells = counts.sum(), probs > 0
    chi2 = float((((counts[cells] - n * probs[cells]) ** 2) / (n * probs[cells])).sum())
    return chi2, chi2_critical(int(cells.sum()) - 1)


def flat_call_costs(engine: Engine) -> TargetCallCosts:
    """Return a call-cost table with the engine's calibrated prior but live times where a call over 33 tokens
    costs what a 1-token call does: an `auto` K that read live times would grow under it."""
    costs = TargetCallCosts(prior=dict(engine.target_call_costs.prior))
    for _ in range(8):
        for tokens in range(1, 34):
            costs.observe(tokens, 0.01)
    return costs
