"""The decoding loop: speculative (Leviathan et al. 2023, Algorithm 1) and plain.

One iteration, top to bottom:
  1. draft    - the drafter proposes K tokens (and their q rows);
  2. verify   - ONE target call scores the last committed token plus the K drafts;
  3. accept   - greedy matching, or rejection sampling against p;
  4. roll back - the target cache and the drafter drop the rejected drafts, side by side;
  5. commit   - the accepted drafts and one more token (recovered or bonus) join the context.
With no drafter, or K = 0, the same code is plain autoregressive decoding. Statistics are
not kept here: each Iteration carries its counts and timings, and the caller tallies them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Iterator, Protocol

import numpy as np

from specdec.models.errors import GenerationError
from specdec.runtime.acceptance import Verdict, greedy_verify, rejection_sample
from specdec.runtime.config import MAX_DRAFT_TOKENS
from specdec.runtime.drafters import Drafter, Proposal
from specdec.runtime.kv_cache import KVCache
from specdec.runtime.sampling import SamplingConfig, next_token, process_logits
from specdec.runtime.session import ModelSession


MAX_DRAFT_ROOM = MAX_DRAFT_TOKENS + 1  # one verify call's tokens beyond the committed context


@dataclass(frozen=True)
class DecodeRequest:
    """What one generation asks of the loop."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingConfig
    eos_token_ids: frozenset[int]
    max_positions: int  # the longest sequence every model of the request accepts

    @property
    def cache_capacity(self) -> int:
        """Return the positions a cache needs: the whole generation plus one verify call's drafts."""
        return len(self.prompt_ids) + self.max_new_tokens + MAX_DRAFT_ROOM

    def check(self) -> None:
        """Raise GenerationError for a prompt the models cannot take."""
        if not self.prompt_ids:
            raise GenerationError("the prompt is empty: give at least one token")
        if len(self.prompt_ids) > self.max_positions:
            raise GenerationError(f"prompt of {len(self.prompt_ids)} tokens is longer than the model's "
                                  f"{self.max_positions} positions")


@dataclass(frozen=True)
class Iteration:
    """What one target call committed, and what it cost.

    Counts follow specdec/runtime/acceptance.py's terms. An EOS among the accepted drafts ends the
    iteration there: the drafts after it are neither committed nor counted.
    """

    drafted: list[int]  # tokens the drafter proposed (empty in plain decoding and the prefill)
    num_accepted: int  # committed drafts that passed the acceptance test
    committed: list[int]  # tokens appended to the output, after cutting at EOS
    is_bonus: bool  # the last committed token came from the (K+1)-th row
    finished: str | None  # "eos", "length" (max_new_tokens) or "max_positions"; None to go on
    situation: str | None = None  # the drafter's label for this proposal (Drafter.situation); None: no drafter
    rejected: bool = False  # an acceptance test failed; the last committed token is the recovered one
    prefill: bool = False  # the prompt's call, which gives the first token
    past_length: int = 0  # target cache positions before this call
    draft_seconds: float = 0.0  # drafting (the draft's prefill included, on the first decode iteration)
    target_seconds: float = 0.0  # this target call; for the prefill, prompt in to first token out
    draft_step_seconds: float | None = None  # the drafter's mean 1-token call so far (None: no model)

    @property
    def acceptance_tests(self) -> int:
        """Return the acceptance tests run on committed drafts: each accepted draft, plus a rejection."""
        return self.num_accepted + int(self.rejected)


class DraftLengthPolicy(Protocol):
    """Chooses K before each iteration and learns from the Iteration it produced."""

    def choose(self, situation: str) -> int:
        """Return K for the next iteration drafted in `situation` (0: decode one token plainly)."""
        ...

    def observe(self, iteration: Iteration) -> None:
        """Learn from one finished iteration."""
        ...


def decode(target: ModelSession, cache: KVCache, request: DecodeRequest, rng: np.random.Generator,
           drafter: Drafter | None = None, draft_length: DraftLengthPolicy | None = None) -> Iterator[Iteration]:
    """Yield one Iteration per target call until EOS, max_new_tokens or the position limit.

    `cache` is the target's, empty, owned by the caller. The output is distributed exactly
    as the target's own (token for token under greedy).
    """
    request.check()
    # A drafter that reads the target's features (specdec/runtime/eagle.py) gets the hidden rows of every call.
    hidden = drafter is not None and draft_length is not None and getattr(drafter, "reads_hidden", False)
    states = None
    start = time.perf_counter()
    # Greedy calls may read the target's 8-bit LM head instead of its fp32 one (specdec/runtime/greedy_head.py):
    # the same argmax, fewer bytes.
    greedy = request.sampling.greedy
    logits = target.forward(cache, request.prompt_ids, logits_rows=1, hidden=hidden, greedy=greedy)  # the last row
    if hidden:
        logits, states = logits
    context = list(request.prompt_ids) + [next_token(logits[-1], request.sampling, rng)]
    iteration = _finish(Iteration([], 0, context[-1:], False, None, prefill=True,
                                  target_seconds=time.perf_counter() - start), request, context, generated=1)
    generated = 1
    yield iteration
    drafting = drafter is not None and draft_length is not None and not iteration.finished
    draft_seconds = _timed(drafter.begin, request.prompt_ids, states) if drafting else 0.0  # the draft's prefill
    while not iteration.finished:
        situation = drafter.situation(context) if drafting else None
        # The target call takes k+1 tokens on a cache of len(context)-1 positions.
        k = min(draft_length.choose(situation) if drafting else 0,
                request.max_new_tokens - generated - 1, request.max_positions - len(context))

        # 1. draft
        t0 = time.perf_counter()
        proposal = drafter.propose(context, k) if k > 0 else Proposal([], None)
        draft_seconds += time.perf_counter() - t0
        drafts = proposal.tokens

        # 2. verify: one target call over the last committed token and the drafts
        t0 = time.perf_counter()
        logits = target.forward(cache, [context[-1]] + drafts, hidden=hidden, greedy=greedy)  # [len(drafts) + 1, vocab]
        if hidden:
            logits, states = logits
        target_seconds = time.perf_counter() - t0

        # 3. accept
        verdict = _verify(drafts, proposal, logits, request.sampling, rng)

        # 4. roll back: the target keeps the last committed token and the accepted drafts; so does the draft
        past_length = len(context) - 1
        cache.rollback(len(context) + verdict.num_accepted)
        context.extend(verdict.committed(drafts))
        if drafts or hidden:  # a feature drafter needs the committed rows after plain steps too
            drafter.accept(context, states[: verdict.num_accepted + 1] if hidden else None)

        # 5. commit
        iteration = _cut_at_eos(Iteration(
            drafts, verdict.num_accepted, verdict.committed(drafts), verdict.is_bonus, None, situation,
            rejected=bool(drafts) and not verdict.is_bonus, past_length=past_length, draft_seconds=draft_seconds,
            target_seconds=target_seconds, draft_step_seconds=drafter.stats.step_seconds if drafting else None),
            request.eos_token_ids)
        generated += len(iteration.committed)
        iteration = _finish(iteration, request, context, generated)
        if drafting:
            draft_length.observe(iteration)
        draft_seconds = 0.0
        yield iteration


def _timed(function, *args) -> float:
    start = time.perf_counter()
    function(*args)
    return time.perf_counter() - start


def _verify(drafts: list[int], proposal: Proposal, logits: np.ndarray, sampling: SamplingConfig,
            rng: np.random.Generator) -> Verdict:
    if sampling.greedy:
        return greedy_verify(drafts, np.argmax(logits, axis=-1))
    target_probs = process_logits(logits, sampling)  # same processing as the draft's q
    return rejection_sample(drafts, target_probs, proposal.probs, rng)


def _cut_at_eos(iteration: Iteration, eos_token_ids: frozenset[int]) -> Iteration:
    """Return the iteration ending at its first EOS; an EOS among the drafts is the last accepted one."""
    for index, token in enumerate(iteration.committed):
        if token in eos_token_ids and index + 1 < len(iteration.committed):
            return replace(iteration, committed=iteration.committed[: index + 1], num_accepted=index + 1,
                            is_bonus=False, rejected=False)
    return iteration


def _finish(iteration: Iteration, request: DecodeRequest, context: list[int], generated: int) -> Iteration:
    """Return the iteration with its finish reason set (None: the loop goes on)."""
    if iteration.committed[-1] in request.eos_token_ids:
        reason = "eos"
    elif generated >= request.max_new_tokens:
        reason = "length"
    elif len(context) > request.max_positions:  # the last token would need a position past the limit
        reason = "max_positions"
    else:
        return iteration
    return replace(iteration, finished=reason)
