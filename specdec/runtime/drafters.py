"""Drafters: whatever proposes tokens for the target to verify.

The loop talks to a drafter through four calls, llama.cpp-style:
- `begin(prompt_ids)`: the prompt, once, after the target's prefill (a draft model reads it with its first
  proposal: a request that never drafts never pays its prefill);
- `situation(context)` -> a label for the kind of proposal it would make next (one label
  for a drafter that cannot tell); `-k auto` keeps one acceptance estimate per label;
- `propose(context, k)` -> Proposal: up to k tokens, and their q rows (None: deterministic,
  q is one-hot at each proposed token);
- `accept(context)`: right after the target's rollback, the committed context; the drafter
  drops what is no longer valid (its KV cache, for a model drafter).
Counters live apart, in `stats` (DrafterStats). The batch engine shares draft calls across requests
through `draft_calls` (the same calls `propose` makes, one at a time), and reads what a drafter drafts
with from `draft_model` / `draft_head` / `drafts_by_lookup`, never from its type. A drafter that reads the target's hidden
states (a trained feature-level draft) takes them as `target_hidden` in begin/accept: the
rows of the target call for the positions just committed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generator, Protocol, TypeVar

import numpy as np

from specdec.runtime.kv_cache import KVCache
from specdec.runtime.ngram import PHRASE_TABLE, NgramIndex
from specdec.runtime.phrases import PhraseTable
from specdec.runtime.sampling import SamplingConfig, greedy_tokens, process_logits, sample_token
from specdec.runtime.session import ModelSession

Feed = TypeVar("Feed")  # what one draft call takes
Output = TypeVar("Output")  # what it returns


@dataclass(frozen=True)
class Proposal:
    """Drafted tokens and the distributions they were drawn from."""

    tokens: list[int]  # [k'] with k' <= k (an n-gram drafter may find fewer, or none)
    probs: np.ndarray | None  # [k', vocab] processed q rows; None: one-hot at each token
    # [k' + 1, vocab] bool: a grammar's allowed tokens at each verify row (loop.constrain); None: no grammar
    mask: np.ndarray | None = None


def grammar_row(grammar, drafted: list[int]) -> np.ndarray | None:
    """Return [1, vocab] bool: the tokens a request's grammar (a GrammarState, or None: no mask) allows after
    its committed output and `drafted`. A sampling drafter draws from q under this mask, so its q is the q the
    target's p is tested against, both masked alike."""
    if grammar is None:
        return None
    return grammar.allowed(drafted)[1][-1:]


@dataclass(frozen=True)
class DrafterStats:
    """What a drafter's model calls have cost so far in one request (all zero for model-free drafters)."""

    calls: int = 0  # draft model calls, the prefill included
    session_seconds: float = 0.0  # time inside onnxruntime's session.run
    step_seconds: float | None = None  # mean time of one single-token call (None: none made)


class Drafter(Protocol):
    """What the decoding loop needs from a drafter (one instance per request).

    Every drafter states `reads_hidden`: True makes every target call return its hidden rows, which
    `begin` and `accept` then receive. A drafter is driven with a draft-length policy (the loop
    refuses one without): K comes from the policy, never from the drafter.
    """

    name: str
    reads_hidden: bool

    @property
    def stats(self) -> DrafterStats:
        """Return the drafter's counters so far."""
        ...

    def begin(self, prompt_ids: list[int], target_hidden: np.ndarray | None = None) -> None:
        """Take the prompt before the first proposal (a model drafter runs its prefill)."""
        ...

    def situation(self, context: list[int]) -> str:
        """Return a label for the proposal `propose` would make after `context` (auto learns alpha per label)."""
        ...

    def propose(self, context: list[int], k: int) -> Proposal:
        """Return up to k draft tokens continuing `context` (prompt + committed tokens)."""
        ...

    def accept(self, context: list[int], target_hidden: np.ndarray | None = None) -> None:
        """Forget proposals that `context` (just committed) did not keep."""
        ...

    def draft_calls(self, context: list[int], k: int) -> Generator[Any, Any, Proposal]:
        """Yield what each of `propose`'s model calls feeds, receive its output; return the same Proposal."""
        ...

    @property
    def draft_model(self) -> ModelDrafter | None:
        """Return the drafter whose draft model (its KV cache, its calls) drafts for this one: itself, a combined
        drafter's model side, or None."""
        ...

    @property
    def draft_head(self) -> Drafter | None:
        """Return the drafter whose trained draft head (EAGLE) drafts for this one: itself, a combined drafter's
        model side, or None."""
        ...

    def drafts_by_lookup(self, situation: str | None) -> bool:
        """Return whether the proposal in `situation` comes from prompt lookup (free to ask, reads no model)."""
        ...


class ModelDrafter:
    """Drafts with a small model, sampling each token with the same settings as the target.

    Keeps the full processed q row of every drafted token: the rejection test and the
    residual need q over the whole vocabulary, not only q(x).
    """

    name = "model"
    reads_hidden = False
    draft_head = None  # a draft model, no draft head

    def __init__(self, session: ModelSession, sampling: SamplingConfig, rng: np.random.Generator,
                 capacity: int | None = None):
        self.session = session
        self.sampling = sampling
        self.rng = rng
        self.cache: KVCache = session.new_cache(capacity)  # capacity: positions to expect, if known
        self.grammar = None  # the request's GrammarState, if it has one: drafts are sampled under its mask
        # Single-token calls only: catch-up calls carry several tokens and would inflate c.
        self._step_seconds = 0.0
        self._steps = 0
        # Cache positions already checked against the committed context (which never changes),
        # so accept compares only the newest tail: no rescan of a long context per iteration.
        self._checked = 0

    @property
    def stats(self) -> DrafterStats:
        """Return the draft model's calls, session time and mean single-token call time so far."""
        return DrafterStats(self.cache.run_calls, self.cache.run_seconds,
                            self._step_seconds / self._steps if self._steps else None)

    @property
    def draft_model(self) -> ModelDrafter:
        """Return itself: a draft model drafts."""
        return self

    def drafts_by_lookup(self, situation: str | None) -> bool:
        """Return False: every proposal is the model's."""
        return False

    def begin(self, prompt_ids: list[int], target_hidden: np.ndarray | None = None) -> None:
        """Nothing yet: the draft reads the prompt with its first proposal's catch-up, so a request that never
        drafts (a batch plan that keeps giving it K = 0) never pays the draft's prefill."""

    def situation(self, context: list[int]) -> str:
        """Return "model": a sampled draft gives no cheap hint of how it will fare."""
        return "model"

    def propose(self, context: list[int], k: int) -> Proposal:
        """Return k tokens sampled one at a time from the draft model, with their q rows."""
        catch_up = True

        def call(tokens: list[int]) -> np.ndarray:
            nonlocal catch_up
            before = self.cache.run_seconds
            logits = self.session.forward(self.cache, tokens, logits_rows=1)[-1]
            if not catch_up:  # drafting steps only: catch-up calls carry several tokens and would inflate c
                self._step_seconds += self.cache.run_seconds - before
                self._steps += 1
            catch_up = False
            return logits

        return run_draft_calls(self.draft_calls(context, k), call)

    def draft_calls(self, context: list[int], k: int) -> Generator[list[int], np.ndarray, Proposal]:
        """Yield the tokens each draft call feeds to this drafter's cache, receive that call's last logits row;
        return the Proposal. `propose` makes the calls one by one; the batch engine makes every drafting
        request's calls of a step together (one ragged-rows call each round)."""
        # Catch up on the committed tokens the draft has not seen (at least the last one).
        logits = yield context[self.cache.length:]
        tokens: list[int] = []
        rows: list[np.ndarray] = []
        for i in range(k):
            # the tokens before this draft's position, for a penalty
            seen = [context + tokens] if self.sampling.reads_context else None
            mask = grammar_row(self.grammar, tokens)
            if self.sampling.greedy:
                token = int(greedy_tokens(logits[None, :], self.sampling, seen, mask)[0])  # q one-hot: probs=None
            else:
                q = process_logits(logits[None, :], self.sampling, seen, mask)[0]
                token = sample_token(q, self.rng)
                rows.append(q)
            tokens.append(token)
            if i + 1 < k:
                logits = yield [token]
        return Proposal(tokens, np.stack(rows) if rows else None)

    def accept(self, context: list[int], target_hidden: np.ndarray | None = None) -> None:
        """Roll the draft cache back to its longest prefix that agrees with the committed context."""
        cached = self.cache.token_ids
        limit = min(len(cached), len(context) - 1)  # keep >= 1 token to feed next time
        valid = min(self._checked, limit)
        while valid < limit and cached[valid] == context[valid]:
            valid += 1
        self.cache.rollback(valid)
        self._checked = valid


def run_draft_calls(calls: Generator[Feed, Output, Proposal], call: Callable[[Feed], Output]) -> Proposal:
    """Return the Proposal of a drafter's `draft_calls`, each call made by `call(feed)`: for a draft model, the
    tokens fed -> the last logits row; for a draft head, a HeadFeed -> its HeadOutput."""
    try:
        feed = next(calls)
        while True:
            feed = calls.send(call(feed))
    except StopIteration as done:
        return done.value


class NgramDrafter:
    """Prompt-lookup drafting: copies what followed the latest earlier match of the context's suffix.

    With a phrase table (specdec/runtime/phrases.py), where the context has no 2+-token match the
    target's own usual continuation is proposed instead. A deterministic proposal either way:
    q is one-hot, so acceptance is p(x) and the residual is p without x; the output stays
    exactly the target's.
    """

    name = "ngram"
    reads_hidden = False
    draft_model = draft_head = None  # prompt lookup reads no model and no head

    @property
    def stats(self) -> DrafterStats:
        """Return zero counters: prompt lookup makes no model calls."""
        return DrafterStats()

    def __init__(self, min_n: int = 1, max_n: int = 4, phrases: PhraseTable | None = None):
        self.index = NgramIndex(min_n=min_n, max_n=max_n)
        self.phrases = phrases

    def drafts_by_lookup(self, situation: str | None) -> bool:
        """Return True: every proposal is prompt lookup's."""
        return True

    def begin(self, prompt_ids: list[int], target_hidden: np.ndarray | None = None) -> None:
        """Index the prompt."""
        self._catch_up(prompt_ids)

    def situation(self, context: list[int]) -> str:
        """Return how the matched n-gram continued before: one of ngram.SITUATIONS (+ ONE_TOKEN_MATCH),
        or PHRASE_TABLE where the phrase table will propose."""
        self._catch_up(context)
        if self._phrase_proposal(context, 1):
            return PHRASE_TABLE
        return self.index.situation()

    def match_length(self, context: list[int]) -> int:
        """Return the length of the context's longest suffix that occurred before (0: none)."""
        self._catch_up(context)
        return self.index.match_length()

    def propose(self, context: list[int], k: int) -> Proposal:
        """Return up to k tokens from the n-gram index, or from the phrase table ([] when neither has any)."""
        self._catch_up(context)
        return Proposal(self._phrase_proposal(context, k) or self.index.propose(k), None)

    def draft_calls(self, context: list[int], k: int) -> Generator[list[int], np.ndarray, Proposal]:
        """Return `propose`'s proposal without a call (a generator that yields nothing)."""
        return self.propose(context, k)
        yield  # unreachable: makes this a generator of no calls

    def _phrase_proposal(self, context: list[int], k: int) -> list[int]:
        # A 2+-token match in the context itself beats the target's general habits.
        if self.phrases is None or self.index.match_length() >= 2:
            return []
        return self.phrases.propose(context, k)

    def _catch_up(self, context: list[int]) -> None:
        # Committed context only grows, so the index takes just the new tail.
        self.index.extend(context[len(self.index.tokens):])

    def accept(self, context: list[int], target_hidden: np.ndarray | None = None) -> None:
        """Nothing to forget: the index holds committed tokens only."""
