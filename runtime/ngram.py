"""Prompt-lookup (n-gram) drafting: propose what followed the latest earlier occurrence of the context's suffix."""

from __future__ import annotations


def ngram_propose(context: list[int], k: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    """Return up to k tokens that followed the most recent earlier match of the longest suffix.

    Reference implementation (a scan per call); the drafter uses `NgramIndex`, which gives
    the same answers incrementally. Example, with min_n=1, max_n=3 and k=2:

        context = [5, 6, 7, 9, 5, 6, 7]
        suffix [5, 6, 7] (n=3) occurred at positions 0..2, so propose [9, 5].
    Returns [] when no n-gram of size min_n..max_n recurs.
    """
    length = len(context)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = context[length - n:]
        # Most recent earlier occurrence: scan end positions from the right, excluding the suffix itself.
        for end in range(length - 1, n - 1, -1):
            if context[end - n:end] == suffix:
                return context[end:end + k]
    return []


class NgramIndex:
    """Incremental n-gram index over a growing token sequence; O(max_n) work per appended token.

    Maps every n-gram (min_n <= n <= max_n) that ends before the last token to the position
    right after its most recent occurrence. The final n-grams are left out until a token
    follows them, so a lookup of the current suffix finds only earlier occurrences.
    """

    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []
        self._next_after: dict[tuple[int, ...], int] = {}

    def extend(self, new_tokens: list[int]) -> None:
        """Append tokens to the indexed sequence."""
        for token in new_tokens:
            end = len(self.tokens)  # the n-grams ending here now have a follower: index them
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._next_after[tuple(self.tokens[end - n:end])] = end
            self.tokens.append(int(token))

    def propose(self, k: int) -> list[int]:
        """Return up to k tokens following the most recent earlier match of the longest suffix ([] if none)."""
        length = len(self.tokens)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            start = self._next_after.get(tuple(self.tokens[length - n:]))
            if start is not None:
                return self.tokens[start:start + k]
        return []
