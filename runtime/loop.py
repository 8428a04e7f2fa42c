"""The decoding loop: speculative (Leviathan et al. 2023, Algorithm 1) and plain.

One iteration, top to bottom:
  1. draft   - the drafter proposes K tokens (and their q rows);
  2. verify  - ONE target call scores the last committed token plus the K drafts;
  3. accept  - greedy matching, or rejection sampling against p;
  4. roll back - the target cache drops the rejected drafts' positions;
  5. commit  - the accepted drafts and one more token (recovered or bonus) join the context.
With no drafter, or K = 0, the same code is plain autoregressive decoding.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from specdec.models.errors import GenerationError
from specdec.runtime.acceptance import Verdict, greedy_verify, rejection_sample
from specdec.runtime.draft_length import AdaptiveDraftLength, FixedDraftLength
from specdec.runtime.drafters import Drafter, Proposal
from specdec.runtime.kv_cache import KVCache
from specdec.runtime.sampling import SamplingConfig, next_token, process_logits
from specdec.runtime.session import ModelSession
from specdec.runtime.stats import GenerationStats


MAX_DRAFT_ROOM = 33  # K up to 32 (the CLI's cap), plus one


@dataclass(frozen=True)
class Iteration:
    """What one target call committed."""

    drafted: list[int]  # tokens the drafter proposed (empty in plain decoding and the prefill)
    num_accepted: int  # how many of them passed
    committed: list[int]  # tokens appended to the output, after cutting at EOS and max_new_tokens
    is_bonus: bool  # the last committed token came from the (K+1)-th row
    finished: str | None  # "eos", "length" (max_new_tokens) or "max_positions"; None to go on
    situation: str | None = None  # the drafter's label for this proposal (Drafter.situation); None: no drafter


def decode(
    target: ModelSession,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: SamplingConfig,
    rng: np.random.Generator,
    eos_token_ids: set[int],
    stats: GenerationStats,
    drafter: Drafter | None = None,
    draft_length: FixedDraftLength | AdaptiveDraftLength | None = None,
    max_positions: int | None = None,
) -> Iterator[Iteration]:
    """Yield one Iteration per target call until EOS, max_new_tokens or the position limit.

    The output is distributed exactly as the target's own (token for token under greedy).
    """
    limit = max_positions or target.spec.max_positions
    if len(prompt_ids) == 0:
        raise GenerationError("the prompt is empty: give at least one token")
    if len(prompt_ids) > limit:
        raise GenerationError(f"prompt of {len(prompt_ids)} tokens is longer than the model's {limit} positions")
    start = time.perf_counter()
    # Room for the whole generation plus one verify call's drafts: a shared buffer never regrows.
    cache = target.new_cache(capacity=len(prompt_ids) + max_new_tokens + MAX_DRAFT_ROOM)
    try:
        yield from _iterations(target, cache, prompt_ids, max_new_tokens, sampling, rng, eos_token_ids,
                               stats, drafter, draft_length, limit, start)
    finally:
        # Runs on exhaustion and on close() (a stop string ends the loop early).
        stats.session_run_seconds = cache.run_seconds
        stats.rollback_seconds = cache.rollback_seconds
        if drafter is not None:
            stats.draft_calls = drafter.calls
            stats.session_run_seconds += drafter.session_seconds


def _iterations(target: ModelSession, cache: KVCache, prompt_ids: list[int], max_new_tokens: int,
                sampling: SamplingConfig, rng: np.random.Generator, eos_token_ids: set[int],
                stats: GenerationStats, drafter: Drafter | None,
                draft_length: FixedDraftLength | AdaptiveDraftLength | None, limit: int,
                start: float) -> Iterator[Iteration]:
    logits = target.forward(cache, prompt_ids)
    first = next_token(logits[-1], sampling, rng)
    context = list(prompt_ids) + [first]
    stats.prefill_seconds = time.perf_counter() - start
    stats.target_calls = 1
    generated = 1
    finished = _finish_reason([first], generated, max_new_tokens, eos_token_ids, len(context), limit)
    yield Iteration([], 0, [first], False, finished)
    if finished:
        return

    drafting = drafter is not None and draft_length is not None
    while True:
        remaining = max_new_tokens - generated
        situation = drafter.situation(context) if drafting else None
        # The target call takes k+1 tokens on a cache of len(context)-1 positions.
        k = min(draft_length.choose(situation) if drafting else 0, remaining - 1, limit - len(context))

        # 1. draft
        proposal = Proposal([], None)
        if k > 0:
            t0 = time.perf_counter()
            proposal = drafter.propose(context, k)
            stats.draft_seconds += time.perf_counter() - t0
        drafts = proposal.tokens

        # 2. verify: one target call over the last committed token and the drafts
        t0 = time.perf_counter()
        logits = target.forward(cache, [context[-1]] + drafts)  # [len(drafts) + 1, vocab]
        target_call = time.perf_counter() - t0
        stats.target_seconds += target_call
        stats.call_log.append((len(context) - 1, len(drafts) + 1, target_call))

        # 3. accept
        verdict = _verify(drafts, proposal, logits, sampling, rng)

        # 4. roll back: keep the last committed token and the accepted drafts
        cache.rollback(len(context) + verdict.num_accepted)
        new_tokens = verdict.committed(drafts)

        # 5. commit
        context.extend(new_tokens)
        if drafter is not None and drafts:
            drafter.sync(context)
        _count(stats, drafts, verdict, situation)
        if drafting:
            draft_length.observe(len(drafts), verdict.num_accepted,
                                 rejected=not verdict.is_bonus and bool(drafts), draft_step_seconds=drafter.step_seconds,
                                 target_tokens=len(drafts) + 1, target_seconds=target_call, situation=situation)

        committed = _cut_at_eos(new_tokens, eos_token_ids)
        generated += len(committed)
        finished = _finish_reason(committed, generated, max_new_tokens, eos_token_ids, len(context), limit)
        yield Iteration(drafts, verdict.num_accepted, committed, verdict.is_bonus, finished, situation)
        if finished:
            return


def _verify(drafts: list[int], proposal: Proposal, logits: np.ndarray, sampling: SamplingConfig,
            rng: np.random.Generator) -> Verdict:
    if sampling.greedy:
        return greedy_verify(drafts, np.argmax(logits, axis=-1))
    target_probs = process_logits(logits, sampling)  # same processing as the draft's q
    return rejection_sample(drafts, target_probs, proposal.probs, rng)


def _count(stats: GenerationStats, drafts: list[int], verdict: Verdict, situation: str | None) -> None:
    stats.iterations += 1
    stats.target_calls += 1
    stats.drafted += len(drafts)
    stats.draft_lengths[len(drafts)] = stats.draft_lengths.get(len(drafts), 0) + 1
    stats.accepted += verdict.num_accepted
    tests = 0
    if drafts:
        # Every accepted draft was one test; a rejection is one more; a bonus token is none.
        tests = verdict.num_accepted + (0 if verdict.is_bonus else 1)
        stats.acceptance_tests += tests
        stats.bonus_tokens += int(verdict.is_bonus)
    if situation is not None:
        stats.count_situation(situation, len(drafts), verdict.num_accepted, tests)


def _cut_at_eos(tokens: list[int], eos_token_ids: set[int]) -> list[int]:
    for index, token in enumerate(tokens):
        if token in eos_token_ids:
            return tokens[: index + 1]
    return tokens


def _finish_reason(committed: list[int], generated: int, max_new_tokens: int, eos_token_ids: set[int],
                   context_length: int, limit: int) -> str | None:
    if committed and committed[-1] in eos_token_ids:
        return "eos"
    if generated >= max_new_tokens:
        return "length"
    if context_length > limit:  # the last token would need a position past the model's limit
        return "max_positions"
    return None
