"""Prompt lookup where a copy is likely, a draft model elsewhere: one drafter over two.

Prompt lookup is free and, after an n-gram that was continued before, nearly always right;
a draft model costs c per token but proposes everywhere. The combined drafter asks the
n-gram index first: when the longest matching suffix (2+ tokens) was seen once, or always
continued the same way, it copies; otherwise (no match, an ambiguous n-gram, a 1-token
match) the model drafts. Its situations carry that choice in their label ("ngram: seen
once", "model: no match", ...), so `-k auto` learns alpha and, with
`AdaptiveDraftLength(cost_per_situation=True)`, c per situation: long drafts in copy runs
at no cost, short model drafts elsewhere, plain decoding where neither pays.

Any drafter with the Drafter protocol can be the model side (a draft model, a quantized
copy of the target, a trained head); q rows come from whichever side proposed (one-hot for
the n-gram side), so the output stays exactly the target's.
"""

from __future__ import annotations

from typing import Generator

import numpy as np

from specdec.runtime.drafters import Drafter, DrafterStats, NgramDrafter, Proposal
from specdec.runtime.ngram import ONE_TOKEN_MATCH, REPEATED, SEEN_ONCE

# n-gram situations where prompt lookup drafts: a 2+-token match continued one way before.
COPY_SITUATIONS = (SEEN_ONCE, REPEATED)


def serves_by_lookup(ngram_situation: str) -> bool:
    """Return whether prompt lookup drafts in this n-gram situation (else the model does)."""
    return ngram_situation in COPY_SITUATIONS and not ngram_situation.endswith(ONE_TOKEN_MATCH)


class CombinedDrafter:
    """Drafts by prompt lookup where a copy is likely, by `model` (any Drafter) elsewhere."""

    def __init__(self, ngram: NgramDrafter, model: Drafter):
        self.ngram = ngram
        self.model = model
        self.name = f"ngram+{model.name}"
        self.reads_hidden = model.reads_hidden  # the loop hands the target's rows to a feature drafter through it

    @property
    def stats(self) -> DrafterStats:
        """Return the model side's counters (prompt lookup makes no model calls)."""
        return self.model.stats

    @property
    def draft_model(self) -> Drafter | None:
        """Return the model side's draft model (None when the model side is a draft head)."""
        return self.model.draft_model

    @property
    def draft_head(self) -> Drafter | None:
        """Return the model side's draft head (None when the model side is a draft model)."""
        return self.model.draft_head

    def drafts_by_lookup(self, situation: str | None) -> bool:
        """Return whether `situation` (one of situation()'s labels; None: not asked) is prompt lookup's."""
        return not (situation or "").startswith("model")

    def begin(self, prompt_ids: list[int], target_hidden: np.ndarray | None = None) -> None:
        """Index the prompt and run the model side's prefill."""
        self.ngram.begin(prompt_ids)
        self.model.begin(prompt_ids, target_hidden)

    def situation(self, context: list[int]) -> str:
        """Return "ngram: <n-gram situation>" where prompt lookup will draft, else "model: <n-gram situation>"."""
        found = self.ngram.situation(context)
        return f"{'ngram' if serves_by_lookup(found) else 'model'}: {found}"

    def propose(self, context: list[int], k: int) -> Proposal:
        """Return up to k tokens from the side situation() names for `context` (the n-gram side may find fewer)."""
        by_lookup = serves_by_lookup(self.ngram.situation(context))
        return self.ngram.propose(context, k) if by_lookup else self.model.propose(context, k)

    def draft_calls(self, context: list[int], k: int) -> Generator[list[int], np.ndarray, Proposal]:
        """Return the proposal `propose` would, as the model side's draft calls (none where prompt lookup drafts)."""
        if serves_by_lookup(self.ngram.situation(context)):
            return self.ngram.propose(context, k)
        return (yield from self.model.draft_calls(context, k))

    def accept(self, context: list[int], target_hidden: np.ndarray | None = None) -> None:
        """Let both sides drop what `context` did not keep (the model catches up lazily on its next proposal)."""
        self.ngram.accept(context)
        self.model.accept(context, target_hidden)
