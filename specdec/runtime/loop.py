"""The decoding loop: speculative (Leviathan et al. 2023, Algorithm 1) and plain.

One iteration, top to bottom:
  1. draft    - the drafter proposes K tokens (and their q rows); under a grammar, the tokens it
                forces are the drafts, and drafts it refuses are cut (`constrain`);
  2. verify   - ONE target call scores the last committed token plus the K drafts;
  3. accept   - greedy matching, or rejection sampling against p;
  4. roll back - the target cache and the drafter drop the rejected drafts, side by side;
  5. commit   - the accepted drafts and one more token (recovered or bonus) join the context.
With no drafter, or K = 0, the same code is plain autoregressive decoding. Statistics are
not kept here: each Iteration carries its counts and timings, and the caller tallies them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Iterator, Protocol

import numpy as np

from specdec.models.errors import GenerationError
from specdec.runtime.acceptance import Verdict, greedy_verify, rejection_sample
from specdec.runtime.config import MAX_DRAFT_TOKENS
from specdec.runtime.drafters import Drafter, Proposal
from specdec.runtime.grammar import GrammarState, allowed_many
from specdec.runtime.kv_cache import KVCache
from specdec.runtime.logprobs import TokenLogprobs, token_logprobs
from specdec.runtime.sampling import (SamplingConfig, greedy_tokens, next_token, process_logits,
                                      seen_before_rows)
from specdec.runtime.session import ModelSession


MAX_DRAFT_ROOM = MAX_DRAFT_TOKENS + 1  # one verify call's tokens beyond the committed context
FORCED = "grammar: forced"  # the situation of drafts a grammar forces (a key, a brace): nearly always accepted


@dataclass(frozen=True)
class DecodeRequest:
    """What one generation asks of the loop."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingConfig
    eos_token_ids: frozenset[int]
    max_positions: int  # the longest sequence every model of the request accepts
    logprobs: int | None = None  # report each committed token's log p and this many alternatives (None: off)

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
    logprobs: TokenLogprobs | None = None  # of `committed`, from the target's rows (DecodeRequest.logprobs)
    mask_seconds: float = 0.0  # the grammar's masks and matcher moves for this iteration (structured outputs)

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


@dataclass
class DecodeState:
    """One request between target calls: what the steps below read and advance.

    The single-request loop (`decode`) and the batch engine (specdec/runtime/batch.py) keep one
    each and call the same steps on it; only who makes the target call differs.
    """

    request: DecodeRequest
    rng: np.random.Generator
    drafter: Drafter | None = None
    policy: DraftLengthPolicy | None = None
    context: list[int] = field(default_factory=list)
    generated: int = 0
    states: np.ndarray | None = None  # the target's hidden rows of the last call, for a feature drafter
    iteration: Iteration | None = None  # the last one committed
    draft_seconds: float = 0.0  # drafting since the last target call
    grammar: GrammarState | None = None  # what the output must match (structured outputs); None: free text
    forced: list[int] = field(default_factory=list)  # the tokens the grammar forces next, as `plan` found them
    mask_seconds: float = 0.0  # grammar work since the last target call

    def __post_init__(self):
        if self.drafter is not None and self.policy is None:
            # K comes from the policy: without one the drafter would sit unused and the request decode plainly.
            raise GenerationError(f"the {self.drafter.name} drafter needs a draft-length policy (a fixed K or auto)")

    @property
    def drafting(self) -> bool:
        """Return whether a drafter proposes (it always comes with its policy)."""
        return self.drafter is not None

    @property
    def hidden(self) -> bool:
        """Return whether target calls must return hidden rows (a drafter that reads the target's features)."""
        return self.drafting and self.drafter.reads_hidden

    @property
    def finished(self) -> bool:
        """Return whether the request has ended (EOS, length or position limit)."""
        return self.iteration is not None and self.iteration.finished is not None


def prefill(target: ModelSession, cache: KVCache, state: DecodeState) -> Iteration:
    """Run the prompt through the target and the drafter; return the first token's Iteration.

    The cache is empty, or holds a prefix of the prompt already (a batch slot's prefix cache): only the
    rest is fed.
    """
    request = state.request
    start = time.perf_counter()
    # Greedy calls may read the target's 8-bit LM head instead of its fp32 one (specdec/runtime/greedy_head.py):
    # the same argmax, fewer bytes.
    logits, states = _rows(target.forward(cache, prompt_rest(state, cache), logits_rows=1, hidden=state.hidden,
                                          greedy=request.sampling.raw_argmax), state.hidden)
    return first_token(state, logits[-1], states, time.perf_counter() - start)


def prompt_rest(state: DecodeState, cache: KVCache) -> list[int]:
    """Return the prompt tokens a prefill feeds: those the cache does not hold yet (it holds none, or a strict
    prefix of the prompt)."""
    request = state.request
    request.check()
    if cache.token_ids != request.prompt_ids[:cache.length] or cache.length >= len(request.prompt_ids):
        raise ValueError("the cache must be empty or hold a strict prefix of the prompt")
    return request.prompt_ids[cache.length:]


def first_token(state: DecodeState, logits: np.ndarray, states: np.ndarray | None, seconds: float) -> Iteration:
    """Sample the first token from the prompt's last logits row (a prefill call took `seconds`), hand the
    drafter the prompt; return the first Iteration."""
    request = state.request
    state.states = states
    mask = state.grammar.allowed([])[1] if state.grammar is not None else None
    token = next_token(logits, request.sampling, state.rng, request.prompt_ids, None if mask is None else mask[0])
    logprobs = _logprobs(request, logits[None, :], [token], request.prompt_ids, [], mask)
    if state.grammar is not None:
        state.grammar.advance([token])
    state.context = list(request.prompt_ids) + [token]
    state.generated = 1
    state.iteration = _finish(Iteration([], 0, [token], False, None, prefill=True, target_seconds=seconds,
                                        logprobs=logprobs), request, state.context, 1)
    if state.drafting and not state.iteration.finished:
        state.draft_seconds = _timed(state.drafter.begin, request.prompt_ids, state.states)  # the drafter takes the prompt
    return state.iteration


def plan(state: DecodeState) -> tuple[str | None, int]:
    """Return (the drafting situation, K) for the next iteration: the policy's K within the request's limits."""
    if not state.drafting:
        return None, 0
    room = draft_room(state)
    # Tokens a grammar forces cost no drafter and are nearly always accepted: they are the drafts, whatever K.
    state.forced = state.grammar.forced(min(room, MAX_DRAFT_TOKENS)) if state.grammar is not None else []
    if state.forced:
        return FORCED, len(state.forced)
    situation = state.drafter.situation(state.context)
    return situation, min(state.policy.choose(situation), room)


def draft_room(state: DecodeState) -> int:
    """Return how many drafts the next target call may verify before max_new_tokens or the position limit."""
    request = state.request
    # The target call takes k+1 tokens on a cache of len(context)-1 positions.
    return min(request.max_new_tokens - state.generated - 1, request.max_positions - len(state.context))


def draft(state: DecodeState, k: int) -> Proposal:
    """Return the drafter's proposal of `k` tokens (none for k = 0; the forced ones where `plan` found some), its
    time counted to the iteration."""
    start = time.perf_counter()
    if k > 0 and state.forced:
        proposal = Proposal(state.forced[:k], None)
    else:
        proposal = state.drafter.propose(state.context, k) if k > 0 else Proposal([], None)
    state.draft_seconds += time.perf_counter() - start
    return proposal


def constrain(states: list[DecodeState], proposals: list[Proposal]) -> list[Proposal]:
    """Return each proposal cut to the drafts its request's grammar accepts, with the grammar's mask for each
    verify row attached (Proposal.mask); a request without a grammar keeps its proposal. Every mask of the batch
    is filled in one engine call.

    Cutting is exact for one-hot drafts (lookup, forced, a greedy draft model): a draft the grammar refuses has
    p = 0 and would be rejected, and the target then samples from p, as it does at the cut. A sampling drafter
    draws under the same mask (drafters.grammar_row), so its drafts are never cut.
    """
    constrained = [i for i, state in enumerate(states) if state.grammar is not None]
    if not constrained:
        return proposals
    start = time.perf_counter()
    masks = allowed_many([states[i].grammar for i in constrained], [proposals[i].tokens for i in constrained])
    share = (time.perf_counter() - start) / len(constrained)
    out = list(proposals)
    for i, (n, mask) in zip(constrained, masks):
        proposal = proposals[i]
        after_eos = n > 0 and proposal.tokens[n - 1] in states[i].request.eos_token_ids  # never committed
        if n < len(proposal.tokens) and proposal.probs is not None and not after_eos:
            raise GenerationError(f"a sampled draft broke the grammar at {proposal.tokens[n]} (draft {n}): the "
                                  "drafter must sample under its mask")
        out[i] = Proposal(proposal.tokens[:n], None if proposal.probs is None else proposal.probs[:n], mask)
        states[i].mask_seconds += share
    return out


def verify_call(target: ModelSession, cache: KVCache, state: DecodeState, drafts: list[int]) -> np.ndarray:
    """Score the last committed token and `drafts` in ONE target call; return logits [len(drafts) + 1, vocab]."""
    logits, state.states = _rows(target.forward(cache, [state.context[-1]] + drafts, hidden=state.hidden,
                                                greedy=state.request.sampling.raw_argmax), state.hidden)
    return logits


def commit(state: DecodeState, cache: KVCache, situation: str | None, proposal: Proposal, logits: np.ndarray,
           target_seconds: float) -> Iteration:
    """Accept, roll back, commit, cut at EOS and finish, after the target scored `proposal`; return the Iteration."""
    request, drafts = state.request, proposal.tokens
    verdict = _verify(state.context, proposal, logits, request.sampling, state.rng)  # 3. accept
    committed = verdict.committed(drafts)
    logprobs = _logprobs(request, logits, committed, state.context, drafts, proposal.mask)
    # 4. roll back: the target keeps the last committed token and the accepted drafts; so does the draft
    past_length = len(state.context) - 1
    cache.rollback(len(state.context) + verdict.num_accepted)
    state.context.extend(committed)
    # every step: a feature drafter needs the committed rows after plain steps too, and a draft model whose
    # drafts a grammar cut to none still holds them in its cache
    if state.drafting:
        state.drafter.accept(state.context, state.states[: verdict.num_accepted + 1] if state.hidden else None)
    iteration = _cut_at_eos(Iteration(  # 5. commit
        drafts, verdict.num_accepted, committed, verdict.is_bonus, None, situation,
        rejected=bool(drafts) and not verdict.is_bonus, past_length=past_length, draft_seconds=state.draft_seconds,
        target_seconds=target_seconds, draft_step_seconds=state.drafter.stats.step_seconds if state.drafting else None,
        logprobs=logprobs), request.eos_token_ids)
    state.generated += len(iteration.committed)
    if state.grammar is not None:  # the matcher moves over what was kept; the rejected drafts never entered it
        state.mask_seconds += _timed(state.grammar.advance, iteration.committed)
        iteration = replace(iteration, mask_seconds=state.mask_seconds)
        state.mask_seconds = 0.0
    state.iteration = _finish(iteration, request, state.context, state.generated)
    if state.drafting:
        state.policy.observe(state.iteration)
    state.draft_seconds = 0.0
    return state.iteration


def decode(target: ModelSession, cache: KVCache, request: DecodeRequest, rng: np.random.Generator,
           drafter: Drafter | None = None, draft_length: DraftLengthPolicy | None = None,
           grammar: GrammarState | None = None) -> Iterator[Iteration]:
    """Yield one Iteration per target call until EOS, max_new_tokens or the position limit.

    `cache` is the target's, empty, owned by the caller. The output is distributed exactly
    as the target's own (token for token under greedy), under `grammar`'s mask where given.
    """
    state = DecodeState(request, rng, drafter, draft_length, grammar=grammar)
    yield prefill(target, cache, state)
    while not state.finished:
        situation, k = plan(state)
        proposal = constrain([state], [draft(state, k)])[0]  # 1. draft
        start = time.perf_counter()
        logits = verify_call(target, cache, state, proposal.tokens)  # 2. verify, in one target call
        yield commit(state, cache, situation, proposal, logits, time.perf_counter() - start)  # 3.-5.


def _rows(output, hidden: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """Return (logits, hidden rows or None) of a ModelSession.forward output."""
    return output if hidden else (output, None)


def _timed(function, *args) -> float:
    start = time.perf_counter()
    function(*args)
    return time.perf_counter() - start


def _verify(context: list[int], proposal: Proposal, logits: np.ndarray, sampling: SamplingConfig,
            rng: np.random.Generator) -> Verdict:
    drafts = proposal.tokens
    seen = seen_before_rows(context, drafts, len(logits)) if sampling.reads_context else None
    if sampling.greedy:
        return greedy_verify(drafts, greedy_tokens(logits, sampling, seen, proposal.mask))
    target_probs = process_logits(logits, sampling, seen, proposal.mask)  # same processing as the draft's q
    return rejection_sample(drafts, target_probs, proposal.probs, rng)


def _logprobs(request: DecodeRequest, logits: np.ndarray, tokens: list[int], context: list[int],
              drafts: list[int], mask: np.ndarray | None) -> TokenLogprobs | None:
    """Return the TokenLogprobs of `tokens` committed after `context` (row r after drafts[:r]), read from the
    target's rows, if the request asks for them."""
    if request.logprobs is None:
        return None
    sampling = request.sampling
    seen = seen_before_rows(context, drafts, len(tokens)) if sampling.reads_context else None
    return token_logprobs(logits, tokens, sampling, seen, request.logprobs, mask)


def _cut_at_eos(iteration: Iteration, eos_token_ids: frozenset[int]) -> Iteration:
    """Return the iteration ending at its first EOS; an EOS among the drafts is the last accepted one."""
    for index, token in enumerate(iteration.committed):
        if token in eos_token_ids and index + 1 < len(iteration.committed):
            logprobs = iteration.logprobs
            if logprobs is not None:
                logprobs = TokenLogprobs(logprobs.chosen[: index + 1], logprobs.top_ids[: index + 1],
                                         logprobs.top_values[: index + 1])
            return replace(iteration, committed=iteration.committed[: index + 1], num_accepted=index + 1,
                            is_bonus=False, rejected=False, logprobs=logprobs)
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
