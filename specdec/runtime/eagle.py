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
from pathlib import Path

import numpy as np

from specdec.models.errors import ArtifactError
from specdec.models.manifest import FeatureDraftSpec, GraphSpec
from specdec.runtime.drafters import DrafterStats, Proposal
from specdec.runtime.providers import create_session
from specdec.runtime.sampling import SamplingConfig, greedy_tokens, process_logits, sample_token


class EagleHead:
    """The draft head's ONNX session and vocabulary subset, shared by all requests."""

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

    def __init__(self, head: EagleHead, sampling: SamplingConfig, rng: np.random.Generator):
        self.head = head
        self.sampling = sampling
        self.rng = rng
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

    def begin(self, prompt_ids: list[int], target_hidden: np.ndarray | None = None) -> None:
        """Keep the prompt's target features; they are fed with the first proposal (which knows the next token)."""
        if target_hidden is None or len(target_hidden) != len(prompt_ids):
            raise ValueError("the eagle drafter needs the target's hidden state of every prompt position")
        self._pending = target_hidden

    def situation(self, context: list[int]) -> str:
        """Return "eagle": one acceptance estimate for all its proposals."""
        return "eagle"

    def _run(self, hidden: np.ndarray, tokens: list[int], start: int) -> tuple[np.ndarray, np.ndarray]:
        t0 = time.perf_counter()
        logits, features, self.key, self.value = self.head.run(hidden, tokens, start, self.key, self.value)
        elapsed = time.perf_counter() - t0
        self._calls += 1
        self._seconds += elapsed
        if len(tokens) == 1:
            self._step_seconds += elapsed
            self._steps += 1
        return logits[-1], features[-1]

    def propose(self, context: list[int], k: int) -> Proposal:
        """Return k tokens drafted one at a time, with their processed q rows (None under greedy)."""
        pending = self._pending
        if pending is None or self.length + len(pending) != len(context) - 1:
            raise RuntimeError(f"eagle drafter out of step: {self.length} pairs + "
                               f"{0 if pending is None else len(pending)} pending for a context of {len(context)}")
        # Pairs (f_j, t_{j+1}) for the newly committed positions j; the last one predicts context[-1]'s feature.
        logits, feature = self._run(pending, context[self.length + 1:], self.length)
        self.length += len(pending)
        self._pending = None
        tokens: list[int] = []
        rows: list[np.ndarray] = []
        for i in range(k):
            # the tokens before this draft's position, for a repetition penalty
            seen = [context + tokens] if self.sampling.reads_context else None
            if self.sampling.raw_argmax:
                token = int(self.head.subset[int(np.argmax(logits))])
            elif self.sampling.greedy:
                token = int(greedy_tokens(self.head.full_logits(logits[None]), self.sampling, seen)[0])
            else:
                q = process_logits(self.head.full_logits(logits[None]), self.sampling, seen)[0]
                token = sample_token(q, self.rng)
                rows.append(q)
            tokens.append(token)
            if i + 1 < k:
                logits, feature = self._run(self.head.own_feature(feature), [token], len(context) - 1 + i)
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
