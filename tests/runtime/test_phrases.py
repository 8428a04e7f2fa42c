"""The phrase table (specdec/runtime/phrases.py) and the n-gram drafter that falls back on it."""

import numpy as np
import pytest

from specdec.runtime.drafters import NgramDrafter
from specdec.runtime.ngram import PHRASE_TABLE, SEEN_ONCE
from specdec.runtime.phrases import STOP, PhraseTable, PhraseTableConfig

ANSWERS = [[7, 8, 9], [7, 8, 9], [7, 8, 4]]


def test_docstring_example():
    table = PhraseTable.count(ANSWERS, PhraseTableConfig(max_n=2))
    assert table.followers == {(7,): 8, (8,): 9, (7, 8): 9}
    assert table.propose([1, 7], 3) == [8, 9]
    assert table.propose([1, 7], 1) == [8]
    assert table.propose([1, 2], 3) == []  # nothing ever followed 2
    diluted = PhraseTable.count(ANSWERS + [[7, 8, 5], [7, 8, 6]], PhraseTableConfig(max_n=2))
    assert diluted.followers[(7, 8)] == STOP and diluted.followers[(8,)] == STOP
    assert diluted.propose([1, 7], 3) == [8]


def test_longest_known_context_decides_even_when_it_stops():
    # (3, 5) was followed by 6 and 7 once each (a stop mark); (5,) alone by 6 three times.
    answers = [[3, 5, 6], [3, 5, 7], [5, 6], [5, 6]]
    table = PhraseTable.count(answers, PhraseTableConfig(max_n=2))
    assert table.followers[(3, 5)] == STOP and table.followers[(5,)] == 6
    assert table.propose([3, 5], 2) == []  # not the less informed (5,) -> 6
    assert table.propose([4, 5], 2) == [6]  # (4, 5) unknown: (5,) decides


@pytest.mark.parametrize("min_count, min_share, expected", [(2, 0.5, 8), (4, 0.5, STOP), (1, 0.9, 8), (3, 1.0, 8)])
def test_confidence_thresholds(min_count, min_share, expected):
    table = PhraseTable.count(ANSWERS, PhraseTableConfig(max_n=1, min_count=min_count, min_share=min_share))
    assert table.followers[(7,)] == expected  # 7 -> 8 three times of three


def test_contexts_do_not_cross_answers():
    table = PhraseTable.count([[1, 2], [3, 4]], PhraseTableConfig(max_n=2, min_count=1))
    assert (2,) not in table.followers and (2, 3) not in table.followers
    assert table.followers == {(1,): 2, (3,): 4}


def test_save_and_load_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    answers = [list(rng.integers(0, 20, 40)) for _ in range(30)]
    table = PhraseTable.count(answers, PhraseTableConfig(max_n=3, min_count=1, min_share=0.3))
    table.save(tmp_path / "t.npz")
    loaded = PhraseTable.load(tmp_path / "t.npz", vocab_size=20)
    assert loaded.followers == table.followers and loaded.max_n == 3
    for start in range(0, 40, 7):
        assert loaded.propose(answers[0][:start + 1], 5) == table.propose(answers[0][:start + 1], 5)


def test_load_refuses_bad_files(tmp_path):
    table = PhraseTable.count([[1, 30, 2]], PhraseTableConfig(max_n=2, min_count=1))
    table.save(tmp_path / "t.npz")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        PhraseTable.load(tmp_path / "t.npz", vocab_size=16)
    (tmp_path / "junk.npz").write_bytes(b"not a zip file")
    with pytest.raises(ValueError, match="not a phrase table"):
        PhraseTable.load(tmp_path / "junk.npz", vocab_size=16)


def test_drafter_copies_from_the_context_first_and_falls_back_on_the_table():
    table = PhraseTable.count([[10, 11, 12, 13]] * 2, PhraseTableConfig(max_n=2))
    drafter = NgramDrafter(min_n=1, max_n=4, phrases=table)
    context = [5, 6, 7, 10]  # no earlier match in the context: the table proposes
    drafter.begin(context)
    assert drafter.situation(context) == PHRASE_TABLE
    assert drafter.propose(context, 3).tokens == [11, 12, 13]
    copy = [5, 6, 7, 10, 99, 5, 6]  # (5, 6) recurs: prompt lookup copies 7, 10, 99
    assert drafter.situation(copy) == SEEN_ONCE
    assert drafter.propose(copy, 3).tokens == [7, 10, 99]
    # Both have a proposal: the table would continue (10, 11) with 12, 13; the context's own copy wins.
    both = [10, 11, 99, 5, 10, 11]
    fresh = NgramDrafter(min_n=1, max_n=4, phrases=table)
    fresh.begin(both)
    assert table.propose(both, 2) == [12, 13]
    assert fresh.situation(both) == SEEN_ONCE and fresh.propose(both, 2).tokens == [99, 5]
    plain = NgramDrafter(min_n=1, max_n=4)
    plain.begin(context)
    assert plain.propose(context, 3).tokens == [] and plain.situation(context) != PHRASE_TABLE
