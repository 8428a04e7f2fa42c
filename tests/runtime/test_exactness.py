"""Speculative output must be the target's own: token for token under greedy, in distribution when sampling."""

import dataclasses
from collections import Counter

import numpy as np
import pytest

from specdec.runtime.engine import Engine, GenerationConfig
from specdec.runtime.sampling import SamplingConfig, process_logits

from tests.runtime.helpers import greedy, near_tie_mismatches

PROMPTS = ["The quick brown fox", "def add(a, b):\n    return", "one, two, three, one, two, three, one, two,"]


@pytest.fixture(scope="module")
def engines(tiny_artifacts):
    return {family: Engine.load(path, provider="cpu") for family, path in tiny_artifacts.items()}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_greedy_speculative_equals_target_only(engines, family, drafter):
    engine = engines[family]
    for prompt in PROMPTS:
        reference = greedy(engine, prompt, drafter="none")
        assert len(reference.token_ids) == 48 or reference.finish_reason == "eos"
        for k in (1, 2, 4, 7, "auto"):
            result = greedy(engine, prompt, drafter=drafter, num_draft_tokens=k)
            mismatches = near_tie_mismatches(engine, reference.prompt_ids, reference.token_ids, result.token_ids)
            if not mismatches:
                assert result.token_ids == reference.token_ids
            assert len(result.token_ids) <= 48


def test_draft_equal_to_target_accepts_nearly_everything(tiny_self_draft_artifact):
    engine = Engine.load(tiny_self_draft_artifact, provider="cpu")
    result = greedy(engine, PROMPTS[0], num_draft_tokens=4, max_new_tokens=41)
    stats = result.stats
    assert stats.acceptance_rate > 0.95, stats.as_dict()
    assert stats.bonus_tokens >= 7
    # 40 tokens after the prefill, 5 per target call when all 4 drafts pass
    assert stats.iterations == 8 and stats.tokens_per_target_call == 5.0
    sampled = engine.generate(PROMPTS[0], GenerationConfig(max_new_tokens=41, temperature=1.0, seed=3))
    assert sampled.stats.acceptance_rate > 0.95  # p == q: every draft passes u < p/q


@pytest.mark.parametrize("k", [1, 3])
def test_max_new_tokens_is_exact(engines, k):
    engine = engines["llama"]
    for max_new in (1, 2, 3, 5, 9):
        result = greedy(engine, PROMPTS[0], num_draft_tokens=k, max_new_tokens=max_new)
        reference = greedy(engine, PROMPTS[0], drafter="none", max_new_tokens=max_new)
        assert len(result.token_ids) == max_new
        assert result.token_ids == reference.token_ids
        assert result.finish_reason == "length"


def test_max_new_tokens_smaller_than_k(tiny_self_draft_artifact):
    engine = Engine.load(tiny_self_draft_artifact, provider="cpu")
    result = greedy(engine, PROMPTS[0], num_draft_tokens=8, max_new_tokens=3)
    assert len(result.token_ids) == 3
    assert result.stats.drafted <= 2  # never drafts past what can be kept


def test_stats_do_not_count_bonus_tokens_as_accepted(engines):
    result = greedy(engines["gpt2"], PROMPTS[2], num_draft_tokens=3)
    s = result.stats
    assert s.accepted <= s.drafted
    assert s.new_tokens == 1 + s.accepted + s.iterations  # prefill token + accepted + one per target call
    assert s.target_calls == s.iterations + 1


def _target_joint(engine, prompt_ids, sampling):
    """Exact joint distribution of the first two generated tokens under target-only sampling."""
    first = process_logits(engine.target.forward(engine.target.new_cache(), prompt_ids)[-1:], sampling)[0]
    joint = {}
    for t1 in np.flatnonzero(first):
        second = process_logits(engine.target.forward(engine.target.new_cache(), prompt_ids + [int(t1)])[-1:],
                                sampling)[0]
        for t2 in np.flatnonzero(second):
            joint[(int(t1), int(t2))] = first[t1] * second[t2]
    return joint


@pytest.mark.parametrize("drafter, settings, k", [
    ("model", dict(temperature=1.3, top_k=6), 3),
    ("model", dict(temperature=0.9, top_p=0.8), 3),
    ("ngram", dict(temperature=1.5, top_k=5, top_p=0.95), 3),
    # auto picks K from the n-gram match's situation before drafting: still only from the past
    ("ngram", dict(temperature=1.5, top_k=5, top_p=0.95), "auto"),
])
def test_sampled_speculative_matches_target_distribution(tiny_near_draft_artifact, drafter, settings, k):
    """Chi-square test of the first two tokens' joint distribution against the exact target one.

    The second token is always produced by a verify step (drafts accepted, or the residual
    sample, or the bonus), so the whole rejection path is under test with temperature,
    top-k and top-p applied to both p and q. The draft is the target plus weight noise, so
    p and q overlap by about half: a wrong residual or an unprocessed q shifts the output
    distribution far past the test's bound.
    """
    engine = Engine.load(tiny_near_draft_artifact, provider="cpu")
    prompt = "one, two, three, one, two, three, one, two,"
    prompt_ids = engine.prompt_ids(prompt)
    sampling = SamplingConfig(**settings)
    exact = _target_joint(engine, prompt_ids, sampling)
    runs = 4000
    counts = Counter()
    drafted = 0
    for seed in range(runs):
        # 4 new tokens: the prefill gives the 1st, then one verify call with K = 2 drafts.
        # ngram_min=1: the 1st token must be enough of a suffix for the n-gram drafter to propose.
        config = GenerationConfig(max_new_tokens=4, seed=seed, drafter=drafter, num_draft_tokens=k, ngram_min=1,
                                  **settings)
        result = engine.generate(prompt_ids, config)
        drafted += result.stats.drafted
        counts[tuple(result.token_ids[:2])] += 1
    # The model drafter always drafts; the n-gram one only when the 1st token recurs in the prompt.
    assert drafted >= runs // 5, "too few second tokens came through verification to test it"
    assert set(counts) <= set(exact), "sampled a pair the target gives zero probability"
    # Pool rare cells (expected < 5) so the chi-square approximation holds.
    cells = sorted(exact, key=lambda c: -exact[c])
    observed, expected, pooled_o, pooled_e = [], [], 0.0, 0.0
    for cell in cells:
        e = exact[cell] * runs
        if e >= 5:
            observed.append(counts[cell])
            expected.append(e)
        else:
            pooled_o += counts[cell]
            pooled_e += e
    if pooled_e > 0:
        observed.append(pooled_o)
        expected.append(pooled_e)
    observed, expected = np.array(observed), np.array(expected)
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    dof = len(observed) - 1
    # Wilson-Hilferty approximation of the 0.001 upper quantile of chi-square(dof).
    z = 3.09
    critical = dof * (1 - 2 / (9 * dof) + z * np.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < critical, (chi2, critical, dof)


def test_same_seed_same_output(engines):
    config = GenerationConfig(max_new_tokens=20, temperature=1.0, top_p=0.9, seed=11, num_draft_tokens=3)
    a = engines["llama"].generate(PROMPTS[0], config)
    b = engines["llama"].generate(PROMPTS[0], config)
    c = engines["llama"].generate(PROMPTS[0], dataclasses.replace(config, seed=12))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids
