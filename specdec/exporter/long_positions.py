"""An exported graph checked against PyTorch at long positions, where fp16 rounding of positions shows.

The export's own validation uses prompts of at most 32 tokens. fp16 holds every integer
only up to 2048, so a graph that rounds position ids or rotary angles to fp16 passes it
and drifts later. This check decodes one random sequence through the runtime's session
and cache (a prefill up to just before `start`, then one token a step across it) and
compares every row with PyTorch's fp32 logits over the same tokens.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specdec.models.manifest import GraphSpec
from specdec.runtime.session import ModelSession

LONG_START = 2048  # the first position fp16 cannot hold exactly (2049 rounds to 2048)


@dataclass(frozen=True)
class LongPositionReport:
    """Max |logit difference| against PyTorch, split at `start`."""

    start: int
    last_position: int
    max_diff_before: float  # rows of positions < start
    max_diff_from_start: float  # rows of positions >= start
    max_abs_logit: float  # PyTorch's largest |logit| over the sequence, for scale
    atol: float
    passed: bool

    def as_dict(self) -> dict[str, Any]:
        """Return the report as JSON-ready data."""
        return asdict(self)


def check_long_positions(artifact_dir: Path, spec: GraphSpec, torch_model: Any, atol: float,
                         start: int = LONG_START, steps: int = 16, seed: int = 0) -> LongPositionReport:
    """Return how far the graph's logits stray from PyTorch's at positions around and past `start`.

    Prefill positions 0..start-9 in one call, then decode one token a step through position
    start+steps-1; every row is compared. Needs `spec.max_positions` >= start + steps.
    """
    import torch

    last = start + steps - 1
    if last >= spec.max_positions:
        raise ValueError(f"the model has {spec.max_positions} positions; the check needs {last + 1}")
    ids = np.random.default_rng(seed).integers(3, spec.vocab_size, size=last + 1).tolist()
    with torch.no_grad():
        expected = torch_model(torch.tensor([ids])).logits[0].float().numpy()
    session = ModelSession(artifact_dir, spec, provider="cpu")
    cache = session.new_cache(last + 1)
    prefill = start - 8  # a few one-token steps before `start` too: the decode path on both sides of it
    rows = [session.forward(cache, ids[:prefill])]
    rows += [session.forward(cache, [token]) for token in ids[prefill:]]
    got = np.concatenate(rows).astype(np.float32)
    diff = np.abs(got - expected[:, : got.shape[1]]).max(axis=1)
    before, after = float(diff[:start].max()), float(diff[start:].max())
    return LongPositionReport(start=start, last_position=last, max_diff_before=before, max_diff_from_start=after,
                              max_abs_logit=float(np.abs(expected).max()), atol=atol,
                              passed=max(before, after) <= atol)
