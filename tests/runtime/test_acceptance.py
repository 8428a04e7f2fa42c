import numpy as np
import pytest

from specdec.runtime.acceptance import greedy_verify, rejection_sample, residual_distribution


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


def _first_token_distribution(p, q, draws, rng, residual=residual_distribution):
    """Empirical distribution of the first committed token when a draft x ~ q is verified against p."""
    counts = np.zeros(p.shape[0])
    for _ in range(draws):
        x = int(rng.choice(len(q), p=q))
        u = rng.random()
        if u * q[x] < p[x]:
            counts[x] += 1
        else:
            r = residual(p, q)
            counts[int(rng.choice(len(r), p=r))] += 1
    return counts / draws


def test_rejection_sampling_reproduces_target_distribution():
    """Leviathan et al. Thm 3.5, statistically: the committed token is distributed as p.

    Uses rejection_sample itself over 100k draws; the bound (TV < 0.01) would fail with the
    classic bug of computing the residual as max(0, p - p), checked below.
    """
    rng = np.random.default_rng(1234)
    vocab = 6
    p = rng.dirichlet(np.ones(vocab))
    q = rng.dirichlet(np.ones(vocab))
    target_probs = np.stack([p, p])
    draws = 100_000
    counts = np.zeros(vocab)
    drafts = rng.choice(vocab, size=draws, p=q)
    for x in drafts:
        verdict = rejection_sample([int(x)], target_probs, q[None, :], rng)
        counts[verdict.committed([int(x)])[0]] += 1
    empirical = counts / draws
    tv = 0.5 * np.abs(empirical - p).sum()
    assert tv < 0.01, (tv, empirical, p)
    # Chi-square goodness of fit, 5 dof: 20.5 is the 0.001 critical value.
    chi2 = float((((counts - draws * p) ** 2) / (draws * p)).sum())
    assert chi2 < 20.5, chi2

    # The same bound catches the target-minus-target bug (residual = norm(max(0, p - p)) = p):
    buggy = _first_token_distribution(p, q, 20_000, np.random.default_rng(5),
                                      residual=lambda p_, q_: residual_distribution(p_, p_))
    assert 0.5 * np.abs(buggy - p).sum() > 0.01


def test_rejection_sampling_later_positions_and_bonus():
    """K=2: the second committed token, given the first was an accepted draft, follows p_2."""
    rng = np.random.default_rng(99)
    vocab = 5
    p1, p2, p3 = (rng.dirichlet(np.ones(vocab)) for _ in range(3))
    q1, q2 = (rng.dirichlet(np.ones(vocab)) for _ in range(2))
    draws = 60_000
    counts = np.zeros(vocab)
    kept = 0
    for _ in range(draws):
        d1 = int(rng.choice(vocab, p=q1))
        d2 = int(rng.choice(vocab, p=q2))
        verdict = rejection_sample([d1, d2], np.stack([p1, p2, p3]), np.stack([q1, q2]), rng)
        committed = verdict.committed([d1, d2])
        if verdict.num_accepted >= 1:
            counts[committed[1]] += 1
            kept += 1
    empirical = counts / kept
    assert 0.5 * np.abs(empirical - p2).sum() < 0.02


def test_seeded_rejection_sampling_is_deterministic():
    p = np.random.default_rng(0).dirichlet(np.ones(10), size=4)
    q = np.random.default_rng(1).dirichlet(np.ones(10), size=3)
    a = rejection_sample([1, 2, 3], p, q, np.random.default_rng(42))
    b = rejection_sample([1, 2, 3], p, q, np.random.default_rng(42))
    assert a == b
