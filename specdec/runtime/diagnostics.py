"""Diagnostics for comparing two runs of a target: where outputs first differ, and how close the call was.

Greedy outputs of the same model on two providers (CPU and CUDA, fp32 and fp16) may part at a
near-tie, where rounding picks the other of two almost equal logits; these say where and how
near it was.
"""

from __future__ import annotations

import numpy as np

from specdec.runtime.engine import Engine


def first_mismatch(reference: Engine, prompt_ids: list[int], expected: list[int], actual: list[int]) -> dict | None:
    """Return {"position", "top2_logit_gap"} where `actual` first differs from `expected` (which
    `reference` produced after `prompt_ids`), the gap being the reference target's top-2 logit
    gap there (small: a near-tie that rounding may flip); None where they agree."""
    for position, (a, b) in enumerate(zip(expected, actual)):
        if a != b:
            return {"position": position, "top2_logit_gap": top2_logit_gap(reference, prompt_ids + expected[:position])}
    return None


def top2_logit_gap(engine: Engine, context: list[int]) -> float:
    """Return the gap between the two highest logits of `engine`'s target for the token after `context`."""
    top2 = np.sort(engine.target.forward(engine.target.new_cache(len(context)), context, logits_rows=1)[-1])[-2:]
    return float(top2[1] - top2[0])
