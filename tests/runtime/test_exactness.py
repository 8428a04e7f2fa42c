"""Speculative output must be the target's own: token for token under greedy, in distribution when sampling.

Every test here runs with drafts that do get accepted (a draft that is the target plus small
weight noise, or the target itself) and asserts that accepted drafts, rejections and bonus
tokens occurred, so none of them can pass on the reject-everything path alone.
"""

import dataclasses
from collections import Counter

import numpy as np
import pytest

from specdec.runtime.call_costs import TargetCallCosts
from specdec.runtime.engine import Engine, GenerationConfig
from specdec.runtime.phrases import PhraseTable, PhraseTableConfig
from specdec.runtime.sampling import SamplingConfig, process_logits

from tests.runtime.helpers import greedy, near_tie_mismatches

PROMPTS = ["The quick brown fox", "def add(a, b):\n    return", "one, two, three, one, two, three, one, two,"]


@pytest.fixture(scope="module")
def engines(tiny_close_artifacts):
    return {family: Engine.load(path, provider="cpu") for family, path in tiny_close_artifacts.items()}


def _prompts_for(engine, drafter):
    """Token-id prompts; for the n-gram drafter also the target's own output repeated, which it copies from."""
    prompts = [engine.prompt_ids(p) for p in PROMPTS + ["Hello world!"]]
    if drafter == "ngram":
        for ids in list(prompts):
            prompts.append((ids + greedy(engine, ids, drafter="none", max_new_tokens=32).token_ids) * 3)
    return prompts


def _account(reference, iterations, eos_ids):
    """Return (accepted, rejections, bonus) recounted from the drafts and the target-only output.

    Independent of the loop's own counters: under greedy a draft is accepted iff it equals the
    target-only token at its position; an EOS among accepted drafts ends the count there.
    """
    accepted = rejections = bonus = 0
    position = 1  # the prefill committed reference[0]
    for iteration in iterations:
        if iteration.prefill:
            continue
        drafts, kept, cut = iteration.drafted, 0, False
        while kept < len(drafts) and position + kept < len(reference) and drafts[kept] == reference[position + kept]:
            kept += 1
            if drafts[kept - 1] in eos_ids:
                cut = True
                break
        accepted += kept
        if drafts and not cut:
            if kept == len(drafts):
                bonus += 1
            else:
                rejections += 1
        position += kept + (0 if cut else 1)
    return accepted, rejections, bonus


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_greedy_speculative_equals_target_only(engines, family, drafter):
    """Greedy output equals target-only for K 1, 2, 4, 7 and auto, and the stats count exactly what happened."""
    engine = engines[family]
    totals = Counter()
    for prompt_ids in _prompts_for(engine, drafter):
        reference = greedy(engine, prompt_ids, drafter="none")
        assert len(reference.token_ids) == 48 or reference.finish_reason == "eos"
        for k in (1, 2, 4, 7, "auto"):
            iterations = []
            result = greedy(engine, prompt_ids, drafter=drafter, num_draft_tokens=k, ngram_min=1,
                            on_iteration=iterations.append)
            assert len(result.token_ids) <= 48
            mismatches = near_tie_mismatches(engine, reference.prompt_ids, reference.token_ids, result.token_ids)
            if mismatches:  # a rounding flip at a near-tie: the recount below needs the same output
                totals["near-tie runs"] += 1
                continue
            assert result.token_ids == reference.token_ids
            s = result.stats
            assert (s.accepted, s.acceptance_tests - s.accepted, s.bonus_tokens) == _account(
                reference.token_ids, iterations, engine.eos_token_ids)
            assert s.drafted == sum(len(it.drafted) for it in iterations)
            assert s.acceptance_rate == (s.accepted / s.drafted if s.drafted else 0.0)
            totals.update(accepted=s.accepted, rejections=s.acceptance_tests - s.accepted, bonus=s.bonus_tokens)
    assert totals["near-tie runs"] <= 2, totals
    # the test must have seen every path of the verify step, not only rejections
    assert totals["accepted"] >= 20 and totals["rejections"] >= 10 and totals["bonus"] >= 3, totals


def test_model_drafts_are_the_draft_models_own_greedy_continuation(engines):
    """Each iteration's drafts equal what the draft model alone proposes after the committed context.

    Checks the draft cache's rollback: a draft cache holding one position too many or too few
    after a rejection proposes other tokens, which greedy equality alone would not show.
    """
    engine = engines["llama"]
    checked = 0
    for prompt in PROMPTS:
        iterations = []
        result = greedy(engine, prompt, drafter="model", num_draft_tokens=3, on_iteration=iterations.append)
        context = list(result.prompt_ids)
        for iteration in iterations:
            if iteration.drafted:
                cache = engine.draft.new_cache()
                logits = engine.draft.forward(cache, context)[-1]
                expected = []
                for _ in iteration.drafted:
                    expected.append(int(np.argmax(logits)))
                    logits = engine.draft.forward(cache, expected[-1:])[-1]
                assert iteration.drafted == expected, (len(context), iteration)
                checked += 1
            context.extend(iteration.committed)
        assert result.stats.acceptance_tests > result.stats.accepted  # rejections happened: rollbacks ran
    assert checked >= 30


def test_draft_cache_catches_up_on_exactly_what_it_has_not_seen(engines, monkeypatch):
    """The draft's rollback keeps every still-valid position: each proposal's first call feeds one token
    after a rejection (the recovered one) and two after a full accept (the last draft and the bonus); the
    first proposal's, the prompt and the first token (the draft has no prefill of its own).

    A rollback that drops one valid position too many still drafts the right tokens, so only the
    call lengths show it.
    """
    engine = engines["llama"]
    calls = []
    forward = engine.draft.forward
    monkeypatch.setattr(engine.draft, "forward", lambda cache, ids, **options: calls.append(len(ids)) or forward(cache, ids, **options))
    seen = Counter()
    for prompt in PROMPTS:
        calls.clear()
        iterations = []
        result = greedy(engine, prompt, drafter="model", num_draft_tokens=3, on_iteration=iterations.append)
        # no prefill of its own: the first proposal reads the prompt and the first token
        expected, after_bonus, first = [], False, True
        for iteration in iterations:
            if iteration.drafted:
                expected += [len(result.prompt_ids) + 1 if first else 1 + after_bonus] + [1] * (len(iteration.drafted) - 1)
                first = False
                after_bonus = iteration.is_bonus
                seen.update(bonus=iteration.is_bonus, rejection=iteration.rejected)
        assert calls == expected, (prompt, calls, expected)
    assert seen["bonus"] >= 3 and seen["rejection"] >= 3, seen


def test_draft_equal_to_target_accepts_everything(tiny_self_draft_artifact):
    """draft == target: every draft passes, so the counts are known exactly, bonus tokens apart from accepted."""
    engine = Engine.load(tiny_self_draft_artifact, provider="cpu")
    result = greedy(engine, PROMPTS[0], num_draft_tokens=4, max_new_tokens=41)
    s = result.stats
    # 40 tokens after the prefill, 5 per target call: 4 accepted drafts and 1 bonus
    assert (s.iterations, s.drafted, s.accepted, s.bonus_tokens) == (8, 32, 32, 8), s.as_dict()
    assert s.acceptance_rate == 1.0 and s.alpha == 1.0 and s.tokens_per_target_call == 5.0
    sampled = engine.generate(PROMPTS[0], GenerationConfig(max_new_tokens=41, temperature=1.0, seed=3))
    s = sampled.stats
    assert s.acceptance_rate == 1.0 and s.accepted == s.drafted  # p == q: every draft passes u < p/q


@pytest.mark.parametrize("k", [1, 3, 8])
def test_max_new_tokens_is_exact(tiny_self_draft_artifact, k):
    """With every draft accepted, each call would commit K+1 tokens: the loop must still stop at the limit."""
    engine = Engine.load(tiny_self_draft_artifact, provider="cpu")
    bonus = 0
    for max_new in (1, 2, 3, 4, 5, 6, 9, 10):
        result = greedy(engine, PROMPTS[0], num_draft_tokens=k, max_new_tokens=max_new)
        reference = greedy(engine, PROMPTS[0], drafter="none", max_new_tokens=max_new)
        assert len(result.token_ids) == max_new
        assert result.token_ids == reference.token_ids
        assert result.finish_reason == "length"
        assert result.stats.drafted == result.stats.accepted  # never drafts past what can be kept
        bonus += result.stats.bonus_tokens
    assert bonus > 0


def test_eos_inside_an_accepted_block_ends_the_counts_there(tiny_self_draft_artifact):
    """An EOS that is the 2nd of 4 accepted drafts: output, accepted and bonus counts stop at it."""
    engine = Engine.load(tiny_self_draft_artifact, provider="cpu")
    free = greedy(engine, PROMPTS[0], num_draft_tokens=4, max_new_tokens=30)
    # Token 7 is the 2nd draft of the 2nd verify call (token 0: prefill; 1-5: call 1; 6-10: call 2).
    eos = free.token_ids[7]
    if eos in free.token_ids[:7]:
        pytest.fail("pick another position: the token occurs earlier")
    engine.eos_token_ids = {eos}
    ended = greedy(engine, PROMPTS[0], num_draft_tokens=4, max_new_tokens=30)
    s = ended.stats
    assert ended.finish_reason == "eos" and ended.token_ids == free.token_ids[:8]
    assert (s.iterations, s.drafted, s.accepted, s.bonus_tokens, s.acceptance_tests) == (2, 8, 6, 1, 6), s.as_dict()
    assert s.new_tokens == 8


def _target_joint(engine, prompt_ids, sampling, depth, mask_of=None):
    """Exact joint distribution of the first `depth` generated tokens under target-only sampling; with
    `mask_of`, each token drawn under the [1, vocab] mask `mask_of(tokens before it)` returns (a grammar's)."""
    joint = {}

    def walk(prefix, mass):
        probs = process_logits(engine.target.forward(engine.target.new_cache(), prompt_ids + prefix)[-1:],
                               sampling, [prompt_ids + prefix], mask_of(prefix) if mask_of else None)[0]
        for token in np.flatnonzero(probs):
            cell = prefix + [int(token)]
            if len(cell) == depth:
                joint[tuple(cell)] = mass * probs[token]
            else:
                walk(cell, mass * probs[token])

    walk([], 1.0)
    return joint


def _chi_square(counts, exact, runs):
    """Return (chi2, 0.001 critical value) of observed counts against exact cell probabilities."""
    observed, expected, pooled_o, pooled_e = [], [], 0.0, 0.0
    for cell in sorted(exact, key=lambda c: -exact[c]):
        e = exact[cell] * runs
        if e >= 5:
            observed.append(counts[cell])
            expected.append(e)
        else:  # pool rare cells so the chi-square approximation holds
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
    return chi2, dof * (1 - 2 / (9 * dof) + z * np.sqrt(2 / (9 * dof))) ** 3


def _sampled_joint(engine, prompt_ids, runs, check=lambda result: None, **config):
    """Return (Counter of the first four tokens, Counter of accepted drafts, rejections, bonus tokens and drafts)
    over `runs` generations of four tokens with GenerationConfig `config`, seeds 0 to runs - 1, each result passed
    to `check` first."""
    counts, totals = Counter(), Counter()
    for seed in range(runs):
        result = engine.generate(prompt_ids, GenerationConfig(max_new_tokens=4, seed=seed, **config))
        check(result)
        s = result.stats
        totals.update(accepted=s.accepted, rejections=s.acceptance_tests - s.accepted, bonus=s.bonus_tokens,
                      drafted=s.drafted)
        counts[tuple(result.token_ids[:4])] += 1
    return counts, totals


def _assert_fits(counts, exact, totals):
    """Assert that no sampled sequence has probability 0 in the `exact` joint and that the counts fit it."""
    assert set(counts) <= set(exact), "sampled a sequence the target gives zero probability"
    chi2, critical = _chi_square(counts, exact, sum(counts.values()))
    assert chi2 < critical, (chi2, critical, totals)


class _FixedCallCosts(TargetCallCosts):
    """A call-cost table that ignores live timings."""

    def observe(self, tokens: int, seconds: float) -> None:
        """Ignore the call."""


@pytest.fixture(scope="module")
def near_engine(tiny_near_draft_artifact):
    return Engine.load(tiny_near_draft_artifact, provider="cpu", threads=1)  # 2.5x faster than 2 busy threads here


@pytest.mark.parametrize("drafter, settings, k", [
    ("model", dict(temperature=1.3, top_k=3), 2),
    ("model", dict(temperature=0.8, top_k=4, top_p=0.7), 3),
    ("ngram", dict(temperature=1.5, top_k=3, top_p=0.95), 2),
    # a repetition penalty (each row sees its own drafts), min-p and a logit bias, on p and q alike
    ("model", dict(temperature=1.2, top_k=4, min_p=0.1, repetition_penalty=1.6, logit_bias=((5, 1.5),)), 3),
    # auto picks K from the n-gram match's situation before drafting: still only from the past
    ("ngram", dict(temperature=1.5, top_k=3, top_p=0.95), "auto"),
    # the phrase table proposes where the context holds nothing to copy (one-hot q, like prompt lookup)
    ("phrases", dict(temperature=1.5, top_k=3, top_p=0.95), 2),
    # OpenAI's presence and frequency penalties count the output only, each row its own drafts, on p and q alike
    ("model", dict(temperature=1.2, top_k=4, presence_penalty=0.9, frequency_penalty=0.7), 3),
    # a predicted output that is partly right: its drafts (one-hot q) are tested like any others
    ("prediction", dict(temperature=1.5, top_k=3, top_p=0.95), 3),
])
def test_sampled_speculative_matches_target_distribution(near_engine, drafter, settings, k, monkeypatch):
    """Chi-square test of the first four tokens' joint distribution against the exact target one.

    The prefill gives token 1; tokens 2-4 come from verify calls with K >= 2: accepted drafts,
    residual samples at later positions, and bonus tokens from the (K+1)-th row all land in
    the checked joint, with temperature, top-k and top-p applied to p and q. The draft is
    the target plus weight noise (p and q overlap by about half), and every run's stats
    must satisfy the exact identities: each target call after the prefill is one bonus,
    one rejection, or one plain step (nothing drafted), and commits its accepted drafts plus one.
    """
    engine = near_engine
    if k == "auto":
        # auto's K follows measured call costs; a fixed table keeps the test's drafting (and so its
        # floors on accepted and bonus tokens) independent of how loaded the machine is.
        monkeypatch.setattr(engine, "target_call_costs", _FixedCallCosts(prior={n: 1 + 0.05 * (n - 1) for n in range(1, 34)}))
    prompt_ids = engine.prompt_ids("one, two, three, one, two, three, one, two,")
    if drafter == "ngram":  # the target's greedy output repeats itself: the n-gram drafter copies from it
        prompt_ids = engine.prompt_ids("Hello world!")
        prompt_ids += greedy(engine, prompt_ids, drafter="none", max_new_tokens=40).token_ids
    if drafter == "phrases":  # a table of the target's own greedy answer; the prompt has nothing to copy
        prompt_ids = engine.prompt_ids("Hello world!")
        answer = greedy(engine, prompt_ids, drafter="none", max_new_tokens=40).token_ids
        monkeypatch.setattr(engine, "phrases", PhraseTable.count([answer], PhraseTableConfig(min_count=1)))
        drafter = "ngram"
    prediction = None
    if drafter == "prediction":  # the target's greedy answer with its fourth token changed
        answer = greedy(engine, prompt_ids, drafter="none", max_new_tokens=8).token_ids
        prediction = engine.codec.decode(answer[:3] + [answer[3] + 1] + answer[4:])
        drafter = "ngram"
    sampling = dataclasses.replace(SamplingConfig(**settings), output_start=len(prompt_ids))
    exact = _target_joint(engine, prompt_ids, sampling, depth=4)
    runs = 3000

    def identities(result):
        s = result.stats
        rejections = s.acceptance_tests - s.accepted
        cut = int(result.finish_reason == "eos" and s.new_tokens == s.accepted + s.iterations)
        assert s.new_tokens == 1 + s.accepted + s.iterations - cut, s.as_dict()
        assert s.iterations == rejections + s.bonus_tokens + s.draft_lengths.get(0, 0) + cut, s.as_dict()
        assert 0 <= s.accepted <= s.drafted

    # ngram_min=1: the 1st token must be enough of a suffix for the n-gram drafter to propose.
    counts, totals = _sampled_joint(engine, prompt_ids, runs, identities, drafter=drafter, num_draft_tokens=k,
                                    ngram_min=1, prediction=prediction, **settings)
    assert totals["accepted"] >= runs // 5 and totals["rejections"] >= runs // 10 and totals["bonus"] >= runs // 20, totals
    _assert_fits(counts, exact, totals)


def test_same_seed_same_output(engines):
    config = GenerationConfig(max_new_tokens=20, temperature=1.0, top_p=0.9, seed=11, num_draft_tokens=3)
    engine = engines["llama"]
    a = engine.generate(PROMPTS[0], config)
    b = engine.generate(PROMPTS[0], config)
    c = engine.generate(PROMPTS[0], dataclasses.replace(config, seed=12))
    assert a.stats.accepted > 0 and a.stats.acceptance_tests > a.stats.accepted  # both paths consumed randomness
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids
