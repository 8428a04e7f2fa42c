"""Drafting from a predicted output: the text a client expects the answer to be (OpenAI's Predicted Outputs).

An edit request sends the file it wants changed as `prediction`: nearly every token of the answer
is already written there. The drafter keeps a cursor into the prediction where the answer's
continuation should be and proposes the tokens from there. Where the answer departs from the
prediction (the edited span), the cursor is lost; it is found again by matching the answer's
latest tokens in the prediction, as prompt lookup matches the prompt, so an insertion or a
deletion does not end the drafting. While the prediction has nothing to offer, or prompt lookup
over the context matches a longer suffix than the cursor's (an answer that loops or rewrites in
its own words), prompt lookup proposes instead (a fallback drafter).

Drafts are deterministic (q one-hot), verified by the target like any others: the output is
exactly the target's whatever the prediction says.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Generator, Sequence

import numpy as np

from specdec.runtime.drafters import DrafterStats, NgramDrafter, Proposal

PREDICTION = "prediction"  # the situation label of drafts copied from the prediction
# ...where the cursor rests on one agreeing token only (a 1-token realignment): a far weaker hint, so the
# adaptive K keeps its acceptance apart.
PREDICTION_1_TOKEN = PREDICTION + ", 1-token match"
MAX_MATCH = 6  # longest suffix of the answer matched against the prediction when realigning
# A 1-token match realigns only this close after the last aligned place: anywhere else, a common token
# (a space, a comma) would send the cursor to a random spot.
NEAR = 48


class PredictionIndex:
    """Where each n-gram (1..MAX_MATCH tokens) of a prediction ends, for realigning after a departure."""

    def __init__(self, prediction: Sequence[int], max_n: int = MAX_MATCH):
        self.tokens = list(prediction)
        self.max_n = max_n
        self._ends: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for n in range(1, max_n + 1):
            for end in range(n, len(self.tokens) + 1):
                self._ends[tuple(self.tokens[end - n:end])].append(end)

    def realign(self, recent: Sequence[int], last: int) -> int | None:
        """Return the prediction index that should follow `recent` (the answer's latest tokens), or None.

        The longest suffix of `recent` found in the prediction wins; among its places, the first at or after
        `last` (the cursor before the departure: edits move forward), else the last before it. A 1-token
        suffix counts only within NEAR tokens after `last`.

        >>> PredictionIndex([5, 6, 7, 8, 6, 9]).realign([1, 6], last=3)
        5
        """
        found = self.realign_match(recent, last)
        return found[0] if found is not None else None

    def realign_match(self, recent: Sequence[int], last: int) -> tuple[int, int] | None:
        """Return `realign`'s index and the length of the suffix that placed it, or None."""
        for n in range(min(self.max_n, len(recent)), 0, -1):
            ends = self._ends.get(tuple(recent[-n:]))
            if not ends:
                continue
            after = [end for end in ends if end >= last]
            if n == 1:
                near = [end for end in after if end - last <= NEAR]
                if near:
                    return near[0], 1
                continue
            return (after[0] if after else ends[-1]), n
        return None


class PredictionDrafter:
    """Drafts the prediction's tokens from a cursor kept aligned with the answer; prompt lookup elsewhere."""

    name = PREDICTION
    reads_hidden = False
    draft_model = draft_head = None  # a prediction reads no model and no head

    def __init__(self, prediction: Sequence[int], fallback: NgramDrafter | None = None):
        self.index = PredictionIndex(prediction)
        self.fallback = fallback
        self.cursor: int | None = 0  # the prediction index of the answer's next token (None: lost)
        # How many of the answer's latest tokens agree with the prediction before the cursor (capped at
        # MAX_MATCH); the answer's start counts as one, since a prediction begins where the answer does.
        self.agreement = 1
        self._last = 0  # the cursor's last known place
        self._prompt_length: int | None = None
        self._seen = 0  # context tokens the cursor has followed

    @property
    def stats(self) -> DrafterStats:
        """Return zero counters: the prediction costs no model calls."""
        return DrafterStats()

    @property
    def prediction(self) -> list[int]:
        """Return the predicted tokens."""
        return self.index.tokens

    def drafts_by_lookup(self, situation: str | None) -> bool:
        """Return True: every proposal is copied, from the prediction or the context."""
        return True

    def draft_calls(self, context: list[int], k: int) -> Generator[list[int], np.ndarray, Proposal]:
        """Return `propose`'s proposal without a call (a generator that yields nothing)."""
        return self.propose(context, k)
        yield  # unreachable: makes this a generator of no calls

    def begin(self, prompt_ids: list[int], target_hidden: np.ndarray | None = None) -> None:
        """Note where the answer starts (after the prompt; the first token is committed next)."""
        self._prompt_length = self._seen = len(prompt_ids)
        if self.fallback is not None:
            self.fallback.begin(prompt_ids)

    def situation(self, context: list[int]) -> str:
        """Return PREDICTION (or PREDICTION_1_TOKEN) where the prediction proposes, else the fallback's situation."""
        self._follow(context)
        if self._from_prediction(context):
            return PREDICTION if self.agreement >= 2 else PREDICTION_1_TOKEN
        return self.fallback.situation(context) if self.fallback is not None else PREDICTION

    def propose(self, context: list[int], k: int) -> Proposal:
        """Return up to k tokens of the prediction from the cursor, else the fallback's proposal."""
        self._follow(context)
        if self._from_prediction(context):
            return Proposal(self.prediction[self.cursor:self.cursor + k], None)
        return self.fallback.propose(context, k) if self.fallback is not None else Proposal([], None)

    def _from_prediction(self, context: list[int]) -> bool:
        """Whether the prediction proposes next: it has tokens at the cursor, and prompt lookup does not match
        a longer suffix of the context than the one agreeing with the prediction."""
        if not self._offers():
            return False
        return self.fallback is None or self.fallback.match_length(context) <= self.agreement

    def accept(self, context: list[int], target_hidden: np.ndarray | None = None) -> None:
        """Move the cursor over the committed tokens (realigning where they depart from the prediction)."""
        self._follow(context)
        if self.fallback is not None:
            self.fallback.accept(context)

    def _offers(self) -> bool:
        return self.cursor is not None and self.cursor < len(self.prediction)

    def _follow(self, context: list[int]) -> None:
        """Advance the cursor over the context's tokens it has not followed yet."""
        if self._prompt_length is None:
            self.begin(context[:-1])
        prediction = self.prediction
        for position in range(self._seen, len(context)):
            token = context[position]
            if self.cursor is not None and self.cursor < len(prediction) and prediction[self.cursor] == token:
                self.cursor += 1
                self._last = self.cursor
                self.agreement = min(self.agreement + 1, MAX_MATCH)
            else:
                recent = context[max(self._prompt_length, position + 1 - MAX_MATCH):position + 1]  # the answer's tail
                found = self.index.realign_match(recent, self._last)
                self.cursor, self.agreement = found if found is not None else (None, 0)
                if self.cursor is not None:
                    self._last = self.cursor
        self._seen = len(context)
