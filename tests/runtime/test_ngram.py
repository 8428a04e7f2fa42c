import random
import time

import pytest

from specdec.runtime.ngram import NgramIndex, ngram_propose


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
    # match at the very end: the continuation runs into the suffix itself (periodic text)
    ([4, 5, 4, 5, 4, 5], 3, [4, 5]),
    # continuation shorter than k: stops at the end of the context
    ([7, 8, 7], 5, [8, 7]),
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


def test_incremental_index_equals_reference_on_random_sequences():
    for trial in range(500):
        rnd = random.Random(trial)
        context = [rnd.randrange(4) for _ in range(rnd.randrange(40))]
        index = NgramIndex(1, 3)
        for cut in range(len(context) + 1):  # grow token by token, asking at every length
            index.extend(context[len(index.tokens):cut])
            assert index.propose(3) == ngram_propose(context[:cut], 3, 1, 3)


def test_long_context_is_linear_time():
    """16k-token context grown one token at a time with a lookup per step: well under a second."""
    rnd = random.Random(0)
    tokens = [rnd.randrange(1000) for _ in range(16_384)]
    index = NgramIndex(1, 4)
    start = time.perf_counter()
    for token in tokens:
        index.extend([token])
        index.propose(8)
    elapsed = time.perf_counter() - start
    assert elapsed < 2.0, elapsed
    # And the answer is still the right one at the end.
    assert index.propose(8) == ngram_propose(tokens, 8, 1, 4)
