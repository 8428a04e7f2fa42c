import random

import pytest

from specdec.runtime.ngram import AMBIGUOUS, NO_MATCH, ONE_TOKEN_MATCH, REPEATED, SEEN_ONCE, NgramIndex, ngram_propose


def _index(tokens, min_n=1, max_n=4):
    index = NgramIndex(min_n, max_n)
    index.extend(tokens)
    return index


@pytest.mark.parametrize("context, k, expected", [
    # longest match wins: suffix [1, 2, 3] matched at 0..2 (continuation 9) beats [3] matched at 5
    ([1, 2, 3, 9, 8, 3, 7, 1, 2, 3], 2, [9, 8]),
    # most recent occurrence: [5, 6] occurs twice, the later one continues with 8
    ([5, 6, 7, 5, 6, 8, 0, 5, 6], 1, [8]),
    # no n-gram recurs
    ([1, 2, 3, 4], 3, []),
    # match at the very end: the continuation runs into the suffix itself and goes on copying the loop
    ([4, 5, 4, 5, 4, 5], 3, [4, 5, 4]),
    ([7, 8, 7], 5, [8, 7, 8, 7, 8]),
    # a loop of period 3 whose latest match is one period back
    ([1, 2, 3, 1, 2, 3, 1], 7, [2, 3, 1, 2, 3, 1, 2]),
    # empty and single-token contexts propose nothing
    ([], 3, []),
    ([1], 3, []),
])
def test_hand_made_proposals(context, k, expected):
    assert ngram_propose(context, k, 1, 4) == expected
    assert _index(context).propose(k) == expected


def test_min_n_excludes_short_matches():
    context = [1, 2, 3, 2]  # only a 1-gram ([2]) recurs
    assert _index(context, min_n=2).propose(2) == []
    assert _index(context, min_n=1).propose(2) == [3, 2]


def _situation_by_scan(context, min_n, max_n):
    """Reference: how every earlier occurrence of the longest recurring suffix continued."""
    length = len(context)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        followers = [context[end] for end in range(n, length) if context[end - n:end] == context[length - n:]]
        if followers:
            kind = SEEN_ONCE if len(followers) == 1 else REPEATED if len(set(followers)) == 1 else AMBIGUOUS
            return kind + ONE_TOKEN_MATCH if n == 1 else kind
    return NO_MATCH


@pytest.mark.parametrize("context, expected", [
    ([1, 2, 3, 4], NO_MATCH),
    ([1, 2, 9, 1, 2], SEEN_ONCE),
    ([1, 2, 9, 1, 2, 9, 5, 1, 2], REPEATED),  # [1, 2] was followed by 9 both times
    ([1, 2, 9, 1, 2, 8, 5, 1, 2], AMBIGUOUS),  # by 9, then by 8
    # the longest match decides: [7, 1, 2] was seen once, though [1, 2] is ambiguous
    ([7, 1, 2, 9, 1, 2, 8, 7, 1, 2], SEEN_ONCE),
    # once ambiguous, always ambiguous, even if the latest followers agree again
    ([1, 2, 9, 3, 1, 2, 8, 4, 1, 2, 8, 5, 1, 2], AMBIGUOUS),
])
def test_situation_of_the_match(context, expected):
    assert _index(context, min_n=2).situation() == expected
    assert _situation_by_scan(context, 2, 4) == expected


def test_one_token_matches_have_their_own_situations():
    assert _index([3, 9, 4, 3], min_n=1).situation() == SEEN_ONCE + ONE_TOKEN_MATCH
    assert _index([3, 9, 4, 3], min_n=2).situation() == NO_MATCH


def test_incremental_index_equals_reference_on_random_sequences():
    for trial in range(500):
        rnd = random.Random(trial)
        context = [rnd.randrange(4) for _ in range(rnd.randrange(40))]
        index = NgramIndex(1, 3)
        for cut in range(len(context) + 1):  # grow token by token, asking at every length
            index.extend(context[len(index.tokens):cut])
            assert index.propose(3) == ngram_propose(context[:cut], 3, 1, 3)
            assert index.situation() == _situation_by_scan(context[:cut], 1, 3)


class _CountingDict(dict):
    """A dict that counts lookups and stores (and _CountingList reads): the index's work, without a clock."""

    operations = 0

    def get(self, key, default=None):
        _CountingDict.operations += 1
        return super().get(key, default)

    def __setitem__(self, key, value):
        _CountingDict.operations += 1
        super().__setitem__(key, value)


class _CountingList(list):
    """A list that counts item and slice reads: a rescan of the context would show here."""

    def __getitem__(self, item):
        _CountingDict.operations += 1
        return super().__getitem__(item)


def test_long_context_costs_constant_work_per_token():
    """Growing a context one token at a time with a lookup per step costs O(max_n) table operations per
    token, the same at 16k tokens as at 1k (a rescan per call would grow with the context)."""
    rnd = random.Random(0)
    tokens = [rnd.randrange(50) for _ in range(16_384)]  # a small alphabet: many recurring n-grams
    index = NgramIndex(1, 4)
    index._latest, index.tokens = _CountingDict(), _CountingList()
    per_token = []
    for position, token in enumerate(tokens):
        before = _CountingDict.operations
        index.extend([token])
        index.propose(8)
        index.situation()
        per_token.append(_CountingDict.operations - before)
        if position in (1_000, 16_000):
            assert index.propose(8) == ngram_propose(tokens[:position + 1], 8, 1, 4)
    # per n (4): extend reads a slice, looks up, reads the follower, stores; propose and situation
    # read a slice and look up; plus propose's copy: 4 * 8 + 1
    assert max(per_token) <= 33, max(per_token)
    assert sum(per_token[-1000:]) <= sum(per_token[1000:2000]) * 1.05
