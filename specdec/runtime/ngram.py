"""Prompt-lookup (n-gram) drafting: propose what followed the latest earlier occurrence of the context's suffix."""

from __future__ import annotations


def ngram_propose(context: list[int], k: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    """Return up to k tokens that followed the most recent earlier match of the longest suffix.

    Reference implementation (a scan per call); the drafter uses `NgramIndex`, which gives
    the same answers incrementally. Example, with min_n=1, max_n=3 and k=2:

        context = [5, 6, 7, 9, 5, 6, 7]
        suffix [5, 6, 7] (n=3) occurred at positions 0..2, so propose [9, 5].
    A continuation that reaches the end of the context goes on copying itself (`overlapping_copy`).
    Returns [] when no n-gram of size min_n..max_n recurs.
    """
    length = len(context)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = context[length - n:]
        # Most recent earlier occurrence: scan end positions from the right, excluding the suffix itself.
        for end in range(length - 1, n - 1, -1):
            if context[end - n:end] == suffix:
                return overlapping_copy(context, end, k)
    return []


def overlapping_copy(tokens: list[int], start: int, k: int) -> list[int]:
    """Return k tokens copied from tokens[start:], going on through the copy itself past the end.

    A match that recurs within k tokens of the end is a loop (period len(tokens) - start): a small
    greedy model's repeats run hundreds of tokens, and stopping the copy at the end would draft one
    period a call. As in LZ77, the copy's source may overlap what it writes:

    >>> overlapping_copy([4, 5, 4, 5], 2, 5)
    [4, 5, 4, 5, 4]
    """
    copied = tokens[start:start + k]
    period = len(tokens) - start
    while 0 < period and len(copied) < k:
        copied.append(copied[len(copied) - period])
    return copied


# What the index knows about the n-gram it would copy from; the adaptive draft length keeps
# one acceptance estimate per situation, since they differ widely (docs/DESIGN.md, "Drafters").
NO_MATCH = "no match"  # no suffix of min_n..max_n tokens occurred before: nothing to propose
SEEN_ONCE = "seen once"  # the matched n-gram occurred once before
REPEATED = "repeated"  # it occurred several times, followed by the same token every time
AMBIGUOUS = "ambiguous"  # it occurred several times, followed by different tokens
SITUATIONS = (NO_MATCH, SEEN_ONCE, REPEATED, AMBIGUOUS)
PHRASE_TABLE = "phrase table"  # no 2+-token match in the context: the target's own phrasing proposes (specdec/runtime/phrases.py)
# A match of a single token is a much weaker hint than one of two or more, so it gets labels
# of its own (under min_n = 1 only): "seen once, 1-token match" and so on.
ONE_TOKEN_MATCH = ", 1-token match"


class NgramIndex:
    """Incremental n-gram index over a growing token sequence; O(max_n) work per appended token.

    Maps every n-gram (min_n <= n <= max_n) that ends before the last token to the position
    right after its most recent occurrence, and to whether its earlier occurrences all had
    that same follower. The final n-grams are left out until a token follows them, so a
    lookup of the current suffix finds only earlier occurrences.
    """

    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []
        self._latest: dict[tuple[int, ...], tuple[int, str]] = {}  # n-gram -> (follower position, situation)

    def extend(self, new_tokens: list[int]) -> None:
        """Append tokens to the indexed sequence."""
        for token in new_tokens:
            token = int(token)
            end = len(self.tokens)  # the n-grams ending here now have a follower, `token`: index them
            for n in range(self.min_n, min(self.max_n, end) + 1):
                gram = tuple(self.tokens[end - n:end])
                previous = self._latest.get(gram)
                if previous is None:
                    situation = SEEN_ONCE
                elif previous[1] != AMBIGUOUS and self.tokens[previous[0]] == token:
                    situation = REPEATED
                else:
                    situation = AMBIGUOUS
                self._latest[gram] = (end, situation)
            self.tokens.append(token)

    def propose(self, k: int) -> list[int]:
        """Return up to k tokens following the most recent earlier match of the longest suffix ([] if none)."""
        start, _, _ = self._longest_match()
        return overlapping_copy(self.tokens, start, k) if start is not None else []

    def situation(self) -> str:
        """Return what `propose` would copy from: one of SITUATIONS, + ONE_TOKEN_MATCH for a 1-token match."""
        _, situation, n = self._longest_match()
        return situation + ONE_TOKEN_MATCH if n == 1 else situation

    def match_length(self) -> int:
        """Return the length of the longest recurring suffix (0: none)."""
        return self._longest_match()[2]

    def _longest_match(self) -> tuple[int | None, str, int]:
        """Return (follower position, situation, n) of the longest recurring suffix ((None, NO_MATCH, 0): none)."""
        length = len(self.tokens)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            match = self._latest.get(tuple(self.tokens[length - n:]))
            if match is not None:
                return match[0], match[1], n
        return None, NO_MATCH, 0
