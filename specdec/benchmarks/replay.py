"""Replaying n-gram drafting over a known greedy output: what a drafting policy could reach.

Under greedy decoding the output is the target's own whatever the drafter does, so the
n-gram drafter's proposals and their fate can be recomputed offline from (prompt, output)
alone. With a cost model in units of one 1-token target step (a call over n tokens costs
t(n), as measured, a rollback after a rejection costs r), this gives the speedup of any
draft-length policy without timing noise, and an upper bound: the oracle, which cuts every
proposal to exactly the tokens the target will accept (no K choice can do better with
this drafter's proposals). Comparing the replayed fixed-K speedup with the measured one
checks the cost model; comparing the oracle with a goal says whether the goal is in reach
of any K policy on this hardware.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.runtime.ngram import NgramIndex
from specdec.runtime.stats import ratio


@dataclass(frozen=True)
class CostModel:
    """Target call costs in 1-token steps, as measured on the machine."""

    verify_cost: float  # v: each verified token beyond the first, on average
    rollback_cost: float  # r: one cache rollback after a rejection
    call_costs: dict[int, float] = field(default_factory=dict)  # n -> t(n) where measured

    def call(self, tokens: int) -> float:
        """Return the cost of a target call over `tokens` tokens: t(n) where measured, else the
        longest measured call plus v per token beyond it (the line 1 + v (n - 1) with no table)."""
        if tokens in self.call_costs:
            return self.call_costs[tokens]
        longest = max((n for n in self.call_costs if n < tokens), default=1)
        return self.call_costs.get(longest, 1.0) + self.verify_cost * (tokens - longest)


@dataclass(frozen=True)
class ReplayResult:
    """One policy replayed over one output."""

    target_calls: int  # decode calls (the prefill is left out, as in decode speedup)
    drafted: int
    accepted: int
    cost: float  # in 1-token steps
    decode_tokens: int  # output tokens after the prefill's first one

    @property
    def speedup(self) -> float:
        """Return decode speedup over target-only: one step per token there."""
        return ratio(self.decode_tokens, self.cost, empty=1.0)

    @property
    def tokens_per_call(self) -> float:
        """Return committed tokens per target call."""
        return ratio(self.decode_tokens, self.target_calls)


def replay_ngram(prompt_ids: list[int], output_ids: list[int], k: int | None, cost: CostModel,
                 ngram_min: int = 2, ngram_max: int = 4) -> ReplayResult:
    """Return the replay of the n-gram drafter over `output_ids` with fixed K (None: the oracle).

    ngram_min: the drafter's shortest suffix (2: what a fixed K drafts from; 1: what `auto`
    drafts from; since the oracle may skip any proposal, its bound never drops with more).
    Follows specdec/runtime/loop.py: the prefill commits output_ids[0]; each iteration drafts
    min(K, tokens left - 1) tokens, one target call verifies them, the accepted prefix and
    one more token are committed. The oracle is the cheapest of all draft-length choices,
    found exactly by dynamic programming: the index only ever holds committed tokens, so
    what it proposes at a position does not depend on how the loop got there.
    """
    available, matched = _proposals(prompt_ids, output_ids, ngram_min, ngram_max)
    if k is None:
        return _cheapest(available, matched, cost)
    position, calls, drafted, accepted, total = 1, 0, 0, 0, 0.0
    while position < len(output_ids):
        n_drafts = min(k, available[position])
        n_accepted = min(n_drafts, matched[position])
        calls += 1
        drafted += n_drafts
        accepted += n_accepted
        total += cost.call(n_drafts + 1) + (cost.rollback_cost if n_accepted < n_drafts else 0.0)
        position += n_accepted + 1
    return ReplayResult(calls, drafted, accepted, total, max(len(output_ids) - 1, 0))


def _proposals(prompt_ids: list[int], output_ids: list[int], ngram_min: int,
               ngram_max: int) -> tuple[list[int], list[int]]:
    """Return, per output position p >= 1, how many tokens the index proposes there (at most the
    tokens left but one) and how many of those match output_ids from p on."""
    index = NgramIndex(ngram_min, ngram_max)
    index.extend(list(prompt_ids) + list(output_ids[:1]))
    available, matched = [0], [0]
    for position in range(1, len(output_ids)):
        room = len(output_ids) - position - 1  # the last token always comes from a target row
        proposal = index.propose(room) if room > 0 else []
        run = 0
        while run < len(proposal) and proposal[run] == output_ids[position + run]:
            run += 1
        available.append(len(proposal))
        matched.append(run)
        index.extend([output_ids[position]])
    return available, matched


def _cheapest(available: list[int], matched: list[int], cost: CostModel) -> ReplayResult:
    """Return the draft-length choice per iteration with the lowest total cost (drafting exactly the
    tokens that will be accepted is never worse than drafting more, so j ranges over 0..matched)."""
    n = len(matched)
    best = [0.0] * (n + 1)  # best[p]: cheapest cost to commit output[p:]
    choice = [0] * (n + 1)
    for position in range(n - 1, 0, -1):
        options = [(cost.call(j + 1) + best[position + j + 1], j) for j in range(matched[position] + 1)]
        best[position], choice[position] = min(options)
    position, calls, accepted = 1, 0, 0
    while position < n:
        calls += 1
        accepted += choice[position]
        position += choice[position] + 1
    return ReplayResult(calls, accepted, accepted, best[1] if n > 1 else 0.0, max(n - 1, 0))
