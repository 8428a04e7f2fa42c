"""Guess rows (guess_rows.py): what a lone row verifies instead, and how many a step's costs allow."""

from specdec.runtime.drafters import Proposal
from specdec.runtime.guess_rows import guess, guesses_within


def test_a_guess_is_the_drafters_lookup_else_the_longest_match_else_the_last_token():
    assert guess([5, 6, 7, 5], lambda context, k: Proposal([9, 8], None)).tokens == [9]  # the drafter's own, 1 token
    assert guess([5, 6, 7, 5], lambda context, k: Proposal([], None)).tokens == [6]
    assert guess([5, 6, 7, 5]).tokens == [6]
    assert guess([5]).tokens == [5] and guess([5]).probs is None  # one-hot: the target's test decides


def test_guesses_fit_the_share_of_the_step_they_may_add():
    def per_guess(ms):
        return lambda g: 10.0 + ms * g

    assert guesses_within(3, per_guess(1.0), 0.1) == 1
    assert guesses_within(3, per_guess(0.2), 0.1) == 3
    assert guesses_within(3, per_guess(2.0), 0.1) == 0
    assert guesses_within(0, per_guess(0.0), 0.1) == 0
    assert guesses_within(4, lambda g: [10.0, 9.5, 12.0, 10.5, 13.0][g], 0.1) == 3  # measured costs need not rise
