"""Guess rows: a reply stays reusable on the chat's next turn where a second query row is nearly free.

A position's KV is reusable by a later prompt only where a fresh prefill would compute it bit for bit alike
(SlotCache.exact): a verify call of 2+ rows does, a 1-token step's lone query row does not (MLAS's M = 1
kernel sums in another order). On open chat most steps find no draft (87% of SmolLM2's steps at one client,
measured), so a reply decoded as is would be prefilled again on the next turn. A step whose request would run
one row verifies a 1-token guess instead: prompt lookup's next token, else a repeat of the last one. The guess
is a draft like any other (q one-hot, the target's test), so the output is unchanged; it costs one more row,
and the batch engine adds such rows only where the measured call costs say they add little to the step
(`guesses_within`, under BatchEngine's `reply_reuse_share`: off by default). One request at a time on a
2-core AVX-512 CPU, SmolLM2-135M fp32: a 2-row call 13.8-15.1 ms against 11-13.5 ms for one row (+10-20%), and
5% of lone steps' lookup guesses would have been kept: a trade of the reply's time between tokens for the next
turn's first token, which a service of multi-turn chats may want and one of single questions does not.
"""

from __future__ import annotations

from typing import Callable

from specdec.runtime.drafters import Proposal
from specdec.runtime.ngram import ngram_propose

GUESS = "lone-row guess"  # the situation a guess's iteration reports (the K policy keeps its acceptance apart)
MAX_REPLY_REUSE_SHARE = 1.0  # a step may at most double for its guesses


def guess(context: list[int], lookup: Callable[[list[int], int], Proposal] | None = None) -> Proposal:
    """Return a 1-token proposal after `context`: the drafter's own lookup where it finds one, else the longest
    earlier match's follower, else the last token again (one-hot q). Example: [5, 6, 7, 5] -> [6]; [5] -> [5]."""
    tokens = lookup(context, 1).tokens[:1] if lookup is not None else []
    return Proposal(tokens or ngram_propose(context, 1) or [context[-1]], None)


def guesses_within(lone: int, step_seconds: Callable[[int], float], share: float) -> int:
    """Return how many of `lone` requests may verify a guess this step: the most g whose step costs at most
    (1 + share) x the step without them, `step_seconds(g)` being the step's cost with g guesses.
    Example (share 0.1, a step of 10 ms): 3 requests at 1 ms a guess -> 1; at 0.2 ms a guess -> 3."""
    limit = (1 + share) * step_seconds(0)
    return max((g for g in range(lone + 1) if step_seconds(g) <= limit), default=0)
