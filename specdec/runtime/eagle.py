"""The trained draft head of `specdec distill` at run time: EAGLE-style drafting from the target's features.

The head reads pairs (f_j, t_{j+1}): the target's LM-head input at position j and the
token after it. After each verify call the loop hands the drafter the target's hidden
rows for the positions it just committed; the drafter feeds them, paired with the
committed tokens, into its own one-layer KV cache, then drafts by feeding its own
predicted feature back with each drafted token. Those speculative positions are dropped
on the next accept (the target's real features replace them), so the cache holds only
target-fed pairs between iterations: rollback is a length, as for the target's cache.

q is the head's distribution over its vocabulary subset processed exactly like p
(temperature, top-k, top-p over the full vocabulary with -inf outside the subset), so
q = 0 outside it and rejection sampling stays exact.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Generator

import numpy as np

from specdec.models.errors import ArtifactError
from specdec.models.manifest import FeatureDraftSpec, GraphSpec
from specdec.runtime.drafters import DrafterStats, Proposal, grammar_row, run_draft_calls
from specdec.runtime.providers import create_session
from specdec.runtime.sampling import SamplingConfig, greedy_tokens, process_logits, sample_token


@dataclass(frozen=True)
class HeadFeed:
    """One request's head call: n pairs (features [n, width], the tokens after them) from position `start`,
    over its past (key/value [1, kv_heads, start, head_dim])."""

    hidden: np.ndarray
    token_ids: list[int]
    start: int
    past_key: np.ndarray
    past_value: np.ndarray


@dataclass(frozen=True)
class HeadOutput:
    """What one request's head call returns: its last pair's subset logits [subset], the features [n, hidden] of
    its pairs, and its presents."""

    logits: np.ndarray
    features: np.ndarray
    key: np.ndarray
    value: np.ndarray


class EagleHead:
    """The draft head's ONNX session(s) and vocabulary subset, shared by all requests."""

    def __init__(self, artifact_dir: str | Path, spec: FeatureDraftSpec, target: GraphSpec, vocab_limit: int,
                 provider: str = "cpu", threads: int | None = None):
        folder = Path(artifact_dir)
        expected = target.sha256.get(target.graph_file)
        if spec.target_graph_sha256 != expected:
            raise ArtifactError(
                f"the draft head in '{folder}' was trained for another target graph (sha256 "
                f"{spec.target_graph_sha256[:12]}…, this target's is {str(expected)[:12]}…): run `specdec distill` again")
        if not target.hidden_name:
            raise ArtifactError(f"the target graph in '{folder}' has no hidden-state output for the draft head; "
                                "run `specdec distill` again")
        self.spec = spec
        # The head is ~5% of a target step: it runs where the host arrays are, without spinning.
        self.session, self.device = create_session(str(folder / spec.graph_file), provider, threads, spin=False)
        inputs = {i.name: i.shape for i in self.session.get_inputs()}
        # The target's hidden output: its last feature, then the normed inputs of target.hidden_layers.
        self.feature_width = spec.hidden_size * (1 + len(target.hidden_layers))
        if inputs.get("hidden", [None])[-1] != self.feature_width or inputs.get("past_key", [None, None])[1] != \
                spec.num_kv_heads:
            raise ArtifactError(f"draft head graph '{spec.graph_file}' does not match its manifest entry "
                                f"(features {self.feature_width} wide, {spec.num_kv_heads} KV heads): "
                                "re-run `specdec distill`")
        self.subset = np.load(folder / spec.subset_file, allow_pickle=False).astype(np.int64)
        if self.subset.shape != (spec.vocab_subset,) or self.subset.max(initial=0) >= vocab_limit:
            raise ArtifactError(f"draft head subset '{spec.subset_file}' does not fit the target's "
                                f"{vocab_limit}-token vocabulary: re-run `specdec distill`")
        self.vocab_limit = vocab_limit
        # The batch engine's: one round of several requests' calls in one call (None: each request's alone).
        self.ragged_session = (create_session(str(folder / spec.ragged_file), provider, threads, spin=False)[0]
                               if spec.ragged_file else None)
        self.ragged_rows = spec.ragged_rows if spec.ragged_file else 0
        self.ragged_calls = 0
        # The fewest feeds one ragged call serves faster than their calls alone: timed at the first call of
        # several (the graph's idle rows cost too: SmolLM2's int8 head, 2 threads, pays from 3-4 feeds).
        self.ragged_from: int | None = None

    def run_feed(self, feed: HeadFeed) -> HeadOutput:
        """Return one request's call, made alone (the batch-1 graph)."""
        logits, features, key, value = self.run(feed.hidden, feed.token_ids, feed.start, feed.past_key,
                                                feed.past_value)
        return HeadOutput(logits[-1], features, key, value)

    def run_rows(self, feeds: list[HeadFeed]) -> list[HeadOutput]:
        """Return every feed's call: the ragged-rows graph's, `ragged_rows` feeds a call (each row equal to its
        batch-1 call, checked at distill), or one call each where the head has no such graph or one feed is left."""
        if self.ragged_session is None or len(feeds) < 2:
            return [self.run_feed(feed) for feed in feeds]
        if self.ragged_from is None:
            self.ragged_from = self._time_ragged_calls()
        outputs: list[HeadOutput] = []
        for first in range(0, len(feeds), self.ragged_rows):
            group = feeds[first:first + self.ragged_rows]
            outputs += (self._ragged_call(group) if len(group) >= self.ragged_from
                        else [self.run_feed(feed) for feed in group])
        return outputs

    def _time_ragged_calls(self, past: int = 64, repeats: int = 3) -> int:
        """Return the fewest one-pair feeds (of `past` positions each) that one ragged call serves faster than
        their calls alone, best of `repeats` each (ragged_rows + 1 where none does)."""
        shape = (1, self.spec.num_kv_heads, past, self.spec.head_dim)
        feed = HeadFeed(np.zeros((1, self.feature_width), np.float32), [int(self.subset[0])], past,
                        np.zeros(shape, np.float32), np.zeros(shape, np.float32))
        calls = self.ragged_calls  # timing calls are not the engine's
        try:
            for count in range(2, self.ragged_rows + 1):
                alone = shared = float("inf")
                for _ in range(repeats):
                    start = time.perf_counter()
                    for _ in range(count):
                        self.run_feed(feed)
                    alone = min(alone, time.perf_counter() - start)
                    start = time.perf_counter()
                    self._ragged_call([feed] * count)
                    shared = min(shared, time.perf_counter() - start)
                if shared < alone:
                    return count
            return self.ragged_rows + 1
        finally:
            self.ragged_calls = calls

    def _ragged_call(self, feeds: list[HeadFeed]) -> list[HeadOutput]:
        # An idle row feeds no pairs over one zero position: a zero-length past and query would meet
        # Reshapes that read a 0 as "keep this dimension"
        idle = np.zeros((1, self.spec.num_kv_heads, 1, self.spec.head_dim), np.float32)
        counts = [len(f.token_ids) for f in feeds] + [0] * (self.ragged_rows - len(feeds))
        inputs = {"hidden": np.concatenate([f.hidden for f in feeds]).astype(np.float32, copy=False)[None],
                  "input_ids": np.asarray([[t for f in feeds for t in f.token_ids]], np.int64),
                  "position_ids": np.concatenate([np.arange(f.start, f.start + len(f.token_ids)) for f in feeds])
                  .astype(np.int64)[None],
                  "row_tokens": np.asarray(counts, np.int64)}
        for r in range(self.ragged_rows):
            feed = feeds[r] if r < len(feeds) else None
            inputs[f"past_key.{r}"] = feed.past_key if feed is not None else idle
            inputs[f"past_value.{r}"] = feed.past_value if feed is not None else idle
        logits, features, *presents = self.ragged_session.run(None, inputs)
        self.ragged_calls += 1
        ends = np.cumsum(counts)
        return [HeadOutput(logits[r], features[0, ends[r] - counts[r]:ends[r]], presents[2 * r], presents[2 * r + 1])
                for r in range(len(feeds))]

    def run(self, hidden: np.ndarray, token_ids: list[int], start: int, past_key: np.ndarray,
            past_value: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Return (subset logits [1, subset], features [n, hidden], present key, present value) for n pairs.

        The logits are the last pair's (heads exported before that gave [n, subset]: the last row is the same).

        hidden [n, hidden]: the features of positions start..start+n-1; token_ids [n]: the tokens after them.
        """
        n = len(token_ids)
        feed = {"hidden": hidden.astype(np.float32, copy=False)[None], "input_ids": np.asarray([token_ids], np.int64),
                "position_ids": np.arange(start, start + n, dtype=np.int64)[None],
                "past_key": past_key, "past_value": past_value}
        logits, features, key, value = self.session.run(None, feed)
        return logits[0], features[0], key, value

    def own_feature(self, feature: np.ndarray) -> np.ndarray:
        """Return the head's own feature [hidden] as a head input row [1, feature_width]: the lower layers' part 0,
        as in training."""
        if feature.shape[-1] == self.feature_width:  # no lower layers: the feature is the whole input
            return feature[None]
        row = np.zeros((1, self.feature_width), np.float32)
        row[0, : feature.shape[-1]] = feature
        return row

    def full_logits(self, subset_logits: np.ndarray) -> np.ndarray:
        """Return logits [rows, vocab_limit]: the subset's, and -inf for every id outside it."""
        full = np.full((subset_logits.shape[0], self.vocab_limit), -np.inf, dtype=np.float32)
        full[:, self.subset] = subset_logits
        return full


class EagleDrafter:
    """Drafts with the trained head; one instance per request (its KV cache is the request's)."""

    name = "eagle"
    reads_hidden = True  # the loop passes the target's hidden rows to begin/accept
    draft_model = None  # the head is no draft model (it has no KV slot of the draft's)

    def __init__(self, head: EagleHead, sampling: SamplingConfig, rng: np.random.Generator):
        self.head = head
        self.sampling = sampling
        self.rng = rng
        self.grammar = None  # the request's GrammarState, if it has one: drafts are sampled under its mask
        shape = (1, head.spec.num_kv_heads, 0, head.spec.head_dim)
        self.key = np.zeros(shape, np.float32)
        self.value = np.zeros(shape, np.float32)
        self.length = 0  # target-fed pairs in the cache: positions 0..length-1
        self._pending: np.ndarray | None = None  # target rows for positions length.. not yet fed
        self._calls = 0
        self._seconds = 0.0
        self._step_seconds = 0.0
        self._steps = 0

    @property
    def stats(self) -> DrafterStats:
        """Return the head's calls, time and mean single-pair call time so far."""
        return DrafterStats(self._calls, self._seconds, self._step_seconds / self._steps if self._steps else None)

    @property
    def draft_head(self) -> EagleDrafter:
        """Return itself: a draft head drafts."""
        return self

    def drafts_by_lookup(self, situation: str | None) -> bool:
        """Return False: every proposal is the head's."""
        return False

    def begin(self, prompt_ids: list[int], target_hidden: np.ndarray | None = None) -> None:
        """Keep the prompt's target features; they are fed with the first proposal (which knows the next token)."""
        if target_hidden is None or len(target_hidden) != len(prompt_ids):
            raise ValueError("the eagle drafter needs the target's hidden state of every prompt position")
        self._pending = target_hidden

    def situation(self, context: list[int]) -> str:
        """Return "eagle": one acceptance estimate for all its proposals."""
        return "eagle"

    def count_call(self, pairs: int, seconds: float) -> None:
        """Count one head call over `pairs` pairs that took (or whose share of a shared call was) `seconds`."""
        self._calls += 1
        self._seconds += seconds
        if pairs == 1:
            self._step_seconds += seconds
            self._steps += 1

    def _call_alone(self, feed: HeadFeed) -> HeadOutput:
        start = time.perf_counter()
        output = self.head.run_feed(feed)
        self.count_call(len(feed.token_ids), time.perf_counter() - start)
        return output

    def propose(self, context: list[int], k: int) -> Proposal:
        """Return k tokens drafted one at a time, with their processed q rows (None under greedy)."""
        return run_draft_calls(self.draft_calls(context, k), self._call_alone)

    def draft_calls(self, context: list[int], k: int) -> Generator[HeadFeed, HeadOutput, Proposal]:
        """Yield each head call's HeadFeed, receive its HeadOutput; return the Proposal. `propose` makes the calls
        one by one; the batch engine makes every drafting request's calls of a round together (`run_rows`)."""
        pending = self._pending
        if pending is None or self.length + len(pending) != len(context) - 1:
            raise RuntimeError(f"eagle drafter out of step: {self.length} pairs + "
                               f"{0 if pending is None else len(pending)} pending for a context of {len(context)}")
        # Pairs (f_j, t_{j+1}) for the newly committed positions j; the last one predicts context[-1]'s feature.
        output = yield HeadFeed(pending, context[self.length + 1:], self.length, self.key, self.value)
        self.key, self.value = output.key, output.value
        self.length += len(pending)
        self._pending = None
        logits, feature = output.logits, output.features[-1]
        tokens: list[int] = []
        rows: list[np.ndarray] = []
        for i in range(k):
            # the tokens before this draft's position, for a repetition penalty
            seen = [context + tokens] if self.sampling.reads_context else None
            mask = grammar_row(self.grammar, tokens)
            if self.sampling.raw_argmax:
                token = int(self.head.subset[int(np.argmax(logits))])
            elif self.sampling.greedy:
                token = int(greedy_tokens(self.head.full_logits(logits[None]), self.sampling, seen, mask)[0])
            else:
                q = process_logits(self.head.full_logits(logits[None]), self.sampling, seen, mask)[0]
                token = sample_token(q, self.rng)
                rows.append(q)
            tokens.append(token)
            if i + 1 < k:
                output = yield HeadFeed(self.head.own_feature(feature), [token], len(context) - 1 + i, self.key,
                                        self.value)
                self.key, self.value = output.key, output.value
                logits, feature = output.logits, output.features[-1]
        return Proposal(tokens, np.stack(rows) if rows else None)

    def accept(self, context: list[int], target_hidden: np.ndarray | None = None) -> None:
        """Drop the drafted pairs; keep the target's rows for the newly committed positions, fed next time.

        target_hidden [m, hidden]: the verify call's rows for its first m positions, the last
        committed token before it and the m - 1 accepted drafts.
        """
        if target_hidden is None:
            raise ValueError("the eagle drafter needs the target's hidden rows of the committed positions")
        self.key = self.key[:, :, : self.length]
        self.value = self.value[:, :, : self.length]
        # After a plain step (K = 0) nothing was proposed: the rows queue up behind the earlier ones.
        self._pending = target_hidden if self._pending is None else np.concatenate([self._pending, target_hidden])
