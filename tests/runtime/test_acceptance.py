import numpy as np
import pytest

from specdec.runtime.acceptance import greedy_verify, rejection_sample, residual_distribution
from tests.runtime.helpers import chi2_fits


def test_greedy_verify_accepts_matching_prefix_then_corrects():
    verdict = greedy_verify([4, 7, 9], np.array([4, 7, 1, 3]))
    assert (verdict.num_accepted, verdict.next_token, verdict.is_bonus) == (2, 1, False)
    assert verdict.committed([4, 7, 9]) == [4, 7, 1]


def test_greedy_verify_all_accepted_gives_bonus():
    verdict = greedy_verify([4, 7], np.array([4, 7, 5]))
    assert (verdict.num_accepted, verdict.next_token, verdict.is_bonus) == (2, 5, True)


def test_greedy_verify_no_drafts_is_plain_step():
    verdict = greedy_verify([], np.array([5]))
    assert (verdict.num_accepted, verdict.next_token, verdict.is_bonus) == (0, 5, False)


def test_residual_is_positive_part_of_p_minus_q():
    p = np.array([0.5, 0.3, 0.2])
    q = np.array([0.2, 0.6, 0.2])
    np.testing.assert_allclose(residual_distribution(p, q), [1.0, 0.0, 0.0])
    np.testing.assert_allclose(residual_distribution(p, p), p)  # degenerate: falls back to p


def test_certain_acceptance_and_certain_rejection():
    rng = np.random.default_rng(0)
    p = np.array([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    q = np.array([[0.0, 1.0, 0.0]])
    assert rejection_sample([1], p, q, rng).committed([1]) == [1, 2]  # p(x) = q(x) = 1: accept, bonus
    p = np.array([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    verdict = rejection_sample([1], p, q, rng)  # p(x) = 0: reject, residual is all on token 0
    assert (verdict.num_accepted, verdict.next_token, verdict.is_bonus) == (0, 0, False)


def test_one_hot_draft_residual_removes_the_drafted_token():
    rng = np.random.default_rng(1)
    p = np.array([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    outcomes = set()
    for _ in range(200):
        verdict = rejection_sample([0], p, None, rng)
        if verdict.num_accepted == 0:
            outcomes.add(verdict.next_token)
    assert outcomes == {1}


def test_shape_checks():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="K\\+1"):
        rejection_sample([1, 2], np.ones((2, 3)) / 3, None, rng)
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample([1], np.ones((2, 3)) / 3, np.ones((2, 3)) / 3, rng)


def test_rejection_sampling_reproduces_target_distribution():
    """Leviathan et al. Thm 3.5, statistically: the committed token is distributed as p."""
    rng = np.random.default_rng(1234)
    vocab = 6
    p = rng.dirichlet(np.ones(vocab))
    q = rng.dirichlet(np.ones(vocab))
    target_probs = np.stack([p, p])
    draws = 60_000
    counts = np.zeros(vocab)
    rejected = 0
    for x in rng.choice(vocab, size=draws, p=q):
        verdict = rejection_sample([int(x)], target_probs, q[None, :], rng)
        counts[verdict.committed([int(x)])[0]] += 1
        rejected += verdict.num_accepted == 0
    assert draws * 0.1 < rejected < draws * 0.9  # both paths taken
    chi2, critical = chi2_fits(counts, p)
    assert chi2 < critical, (chi2, counts / draws, p)


def test_rejection_sampling_later_positions_and_bonus():
    """K=2: given d1 accepted, the 2nd token follows p2; given both accepted, the bonus follows p3.

    q rows with zeros (as top-k leaves them) and p rows with zeros where q has mass.
    """
    rng = np.random.default_rng(99)
    vocab = 5
    p1, p2, p3 = (rng.dirichlet(np.ones(vocab)) for _ in range(3))
    q1, q2 = (rng.dirichlet(np.ones(vocab)) for _ in range(2))
    p2[4] = 0.0
    p2 /= p2.sum()
    q1[0] = 0.0
    q1 /= q1.sum()
    target, draft = np.stack([p1, p2, p3]), np.stack([q1, q2])
    first, second, bonus = np.zeros(vocab), np.zeros(vocab), np.zeros(vocab)
    for _ in range(60_000):
        drafts = [int(rng.choice(vocab, p=q1)), int(rng.choice(vocab, p=q2))]
        verdict = rejection_sample(drafts, target, draft, rng)
        committed = verdict.committed(drafts)
        first[committed[0]] += 1
        if verdict.num_accepted >= 1:
            second[committed[1]] += 1
        if verdict.num_accepted == 2:
            assert verdict.is_bonus and len(committed) == 3
            bonus[committed[2]] += 1
        else:
            assert not verdict.is_bonus and len(committed) == verdict.num_accepted + 1
    assert min(first.sum(), second.sum(), bonus.sum()) > 5_000, (first.sum(), second.sum(), bonus.sum())
    for counts, probs in ((first, p1), (second, p2), (bonus, p3)):
        chi2, critical = chi2_fits(counts, probs)
        assert chi2 < critical, (chi2, critical, counts / counts.sum(), probs)


def test_one_hot_draft_is_accepted_with_probability_p_of_x():
    """A deterministic drafter (q one-hot): accept x with probability exactly p(x), else sample p without x."""
    rng = np.random.default_rng(7)
    p = np.array([0.1, 0.45, 0.3, 0.15])
    target = np.stack([p, np.full(4, 0.25)])
    draws = 40_000
    for x in (1, 3):
        accepted, committed = 0, np.zeros(4)
        for _ in range(draws):
            verdict = rejection_sample([x], target, None, rng)
            accepted += verdict.num_accepted
            committed[verdict.committed([x])[0]] += 1
        sd = np.sqrt(p[x] * (1 - p[x]) / draws)
        assert abs(accepted / draws - p[x]) < 5 * sd, (x, accepted / draws, p[x])
        chi2, critical = chi2_fits(committed, p)  # overall the committed token is distributed as p
        assert chi2 < critical, (x, chi2, committed / draws)


def test_seeded_rejection_sampling_is_deterministic():
    """The same seed gives the same sequence of verdicts; another seed another sequence."""
    p = np.random.default_rng(0).dirichlet(np.ones(10), size=4)
    q = np.random.default_rng(1).dirichlet(np.ones(10), size=3)

    def verdicts(seed):
        rng = np.random.default_rng(seed)  # one generator for the whole sequence, as a request has
        return [rejection_sample([1, 2, 3], p, q, rng) for _ in range(60)]

    a = verdicts(42)
    assert a == verdicts(42)
    assert a != verdicts(43)
    assert len({(v.num_accepted, v.next_token) for v in a}) > 5  # the sequence is not one constant verdict
