"""The phrase table: what the target itself usually writes next, as a drafter's second source.

Prompt lookup only proposes what the context already holds, so on open chat it has little to
copy. A small instruct model also repeats its own phrasing from answer to answer ("Here are
some ...", "In summary, ..."). `specdec phrases` has the target answer a shipped set of
prompts (none of the bench's or the tests') and counts, for every 1..max_n-token context in
those answers, the tokens that followed. The table keeps, per context, the follower if it is
confident (seen at least `min_count` times and at least `min_share` of the time) and a stop
mark otherwise; a proposal walks the longest known suffix one token at a time, and the
longest suffix decides (a stop mark there ends the proposal rather than falling back to a
shorter, less informed context). Proposals are deterministic (q one-hot), so decoding stays
exact whatever they are.

Example (max_n 2, min_count 2, min_share 0.5), answers [[7, 8, 9], [7, 8, 9], [7, 8, 4]]:
    (7,) -> 8 (3 of 3), (8,) -> 9 and (7, 8) -> 9 (2 of 3); nothing ever followed 9.
    propose([1, 7], k=3) walks (7,) -> 8, then (7, 8) -> 9, then neither (8, 9) nor (9,) is
    known: [8, 9]. With two more answers, [7, 8, 5] and [7, 8, 6], 9 follows (7, 8) 2 times
    in 5, under min_share: (7, 8) becomes a stop mark and the proposal is [8].
"""

from __future__ import annotations

import zipfile
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

STOP = -1  # a context seen in the answers whose follower is not confident: the walk ends there


@dataclass(frozen=True)
class PhraseTableConfig:
    """How a phrase table is counted."""

    max_n: int = 4  # longest context, in tokens
    min_count: int = 2  # the follower must have been seen this often...
    min_share: float = 0.5  # ...and be this share of what followed the context


class PhraseTable:
    """Context (1..max_n tokens) -> the follower the target wrote most, or STOP."""

    def __init__(self, followers: dict[tuple[int, ...], int], max_n: int):
        self.followers = followers
        self.max_n = max_n

    @classmethod
    def count(cls, answers: Iterable[list[int]], config: PhraseTableConfig = PhraseTableConfig()) -> "PhraseTable":
        """Return the table of `answers` (token id lists, each counted on its own: no context crosses two)."""
        seen: dict[tuple[int, ...], Counter] = defaultdict(Counter)
        for answer in answers:
            for end in range(1, len(answer)):
                for n in range(1, min(config.max_n, end) + 1):
                    seen[tuple(answer[end - n:end])][answer[end]] += 1
        followers = {}
        for context, counts in seen.items():
            token, times = counts.most_common(1)[0]
            confident = times >= config.min_count and times >= config.min_share * sum(counts.values())
            followers[context] = int(token) if confident else STOP
        return cls(followers, config.max_n)

    def propose(self, context: list[int], k: int) -> list[int]:
        """Return up to k tokens, each the confident follower of the longest known suffix ([] if none)."""
        tail = list(context[-self.max_n:])
        out: list[int] = []
        while len(out) < k:
            token = self._follower(tail)
            if token is None or token == STOP:
                break
            out.append(token)
            tail = (tail + [token])[-self.max_n:]
        return out

    def _follower(self, tail: list[int]) -> int | None:
        for n in range(min(self.max_n, len(tail)), 0, -1):
            token = self.followers.get(tuple(tail[len(tail) - n:]))
            if token is not None:
                return token  # the longest known context decides, STOP included
        return None

    def confident_contexts(self) -> int:
        """Return how many contexts have a confident follower."""
        return sum(1 for token in self.followers.values() if token != STOP)

    def save(self, path: str | Path) -> None:
        """Write the table as .npz: per context length n, `contexts_n` [m, n] and `followers_n` [m] (int32)."""
        arrays: dict[str, np.ndarray] = {"max_n": np.array(self.max_n, dtype=np.int32)}
        for n in range(1, self.max_n + 1):
            items = [(c, t) for c, t in self.followers.items() if len(c) == n]
            arrays[f"contexts_{n}"] = np.array([c for c, _ in items], dtype=np.int32).reshape(len(items), n)
            arrays[f"followers_{n}"] = np.array([t for _, t in items], dtype=np.int32)
        with open(path, "wb") as handle:
            np.savez_compressed(handle, **arrays)

    @classmethod
    def load(cls, path: str | Path, vocab_size: int) -> "PhraseTable":
        """Return the table saved at `path`; raise ValueError for a malformed file or ids outside the vocabulary."""
        try:
            with np.load(path, allow_pickle=False) as data:
                max_n = int(data["max_n"])
                arrays = {n: (data[f"contexts_{n}"], data[f"followers_{n}"]) for n in range(1, max_n + 1)}
        except (OSError, KeyError, EOFError, ValueError, zipfile.BadZipFile) as err:
            raise ValueError(f"not a phrase table ({err})") from None
        followers: dict[tuple[int, ...], int] = {}
        for n, (contexts, tokens) in arrays.items():
            if contexts.shape != (len(tokens), n):
                raise ValueError(f"contexts_{n} has shape {contexts.shape}, expected ({len(tokens)}, {n})")
            if contexts.size and (contexts.min() < 0 or contexts.max() >= vocab_size):
                raise ValueError(f"contexts_{n} holds ids outside the vocabulary of {vocab_size}")
            if tokens.size and (tokens.min() < STOP or tokens.max() >= vocab_size):
                raise ValueError(f"followers_{n} holds ids outside the vocabulary of {vocab_size}")
            followers.update(zip(map(tuple, contexts.tolist()), tokens.tolist()))
        return cls(followers, max_n)
