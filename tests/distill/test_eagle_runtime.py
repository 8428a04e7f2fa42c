"""The eagle drafter at run time: its cache bookkeeping, exactness, and refusing a bad head."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
from click.testing import CliRunner

from specdec.runtime.eagle import EagleDrafter, EagleHead
from specdec.runtime.engine import Engine, GenerationConfig
from specdec.runtime.sampling import SamplingConfig


class FakeHead:
    """Records every call; proposes token (last input token + 1) % 10 from subset ids 0..9."""

    def __init__(self):
        self.spec = SimpleNamespace(num_kv_heads=1, head_dim=2)
        self.subset = np.arange(10)
        self.calls = []

    def own_feature(self, feature):
        return feature[None]

    run_feed = EagleHead.run_feed  # the real head's: one call through `run`

    def run(self, hidden, token_ids, start, past_key, past_value):
        self.calls.append((hidden[:, 0].tolist(), list(token_ids), start, past_key.shape[2]))
        n = len(token_ids)
        wanted = (np.asarray(token_ids) + 1) % 10
        logits = -((np.arange(10)[None, :] - wanted[:, None]) % 10).astype(np.float32)  # distinct, max at wanted
        new = np.full((1, 1, n, 2), start, np.float32) + np.arange(n)[None, None, :, None]
        return logits, hidden + 0.5, np.concatenate([past_key, new], 2), np.concatenate([past_value, new], 2)


def test_pairs_positions_and_rollback():
    """Pair j is (f_j, t_{j+1}) at position j; drafted pairs are dropped at accept, target rows fed next."""
    head = FakeHead()
    drafter = EagleDrafter(head, SamplingConfig(), np.random.default_rng(0))
    feats = lambda *positions: np.array([[float(p)] * 3 for p in positions])  # noqa: E731 - row j carries j
    prompt = [3, 4, 5]
    drafter.begin(prompt, feats(0, 1, 2))
    context = prompt + [6]  # the prefill's token
    proposal = drafter.propose(context, 3)
    assert proposal.tokens == [7, 8, 9] and proposal.probs is None
    # The catch-up call: f_0..f_2 with tokens 4, 5, 6 at positions 0..2; then 2 single drafted pairs.
    assert head.calls[0] == ([0.0, 1.0, 2.0], [4, 5, 6], 0, 0)
    assert head.calls[1] == ([2.5], [7], 3, 3) and head.calls[2] == ([3.0], [8], 4, 4)
    # The target accepted 7, rejected 8, and committed 1: its rows are for positions 3 (token 6) and 4 (token 7).
    context += [7, 1]
    drafter.accept(context, feats(3, 4))
    assert drafter.key.shape[2] == 3  # drafted pairs gone
    # A plain step (K = 0) commits one more token: its row queues behind the others.
    context += [2]
    drafter.accept(context, feats(5))
    drafter.propose(context, 1)
    assert head.calls[3] == ([3.0, 4.0, 5.0], [7, 1, 2], 3, 3)
    assert drafter.length == len(context) - 1


def test_greedy_drafts_are_the_subsets_token_ids():
    """The head scores its subset; a greedy draft is the full-vocabulary id of the subset's argmax."""
    head = FakeHead()
    head.subset = np.arange(0, 20, 2)  # subset row i is token 2i
    drafter = EagleDrafter(head, SamplingConfig(), np.random.default_rng(0))
    drafter.begin([1, 2], np.zeros((2, 3)))
    # row argmax (last input + 1) % 10: 3 -> row 4 = token 8, then 8 -> row 9 = token 18
    assert drafter.propose([1, 2, 3], 2).tokens == [8, 18]
    assert head.calls[1][1] == [8]  # the head is fed the token id, not its subset row


def test_sampled_q_is_zero_outside_the_subset_and_processed_like_p():
    head = FakeHead()
    head.subset = np.array([0, 2, 4, 6, 8, 10, 12, 14, 16, 18])
    head.full_logits = lambda rows: _full(rows, head.subset, 20)
    sampling = SamplingConfig(temperature=0.7, top_k=3)
    drafter = EagleDrafter(head, sampling, np.random.default_rng(0))
    drafter.begin([1, 2], np.zeros((2, 3)))
    proposal = drafter.propose([1, 2, 3], 2)
    assert proposal.probs.shape == (2, 20)
    assert np.all(proposal.probs[:, 1::2] == 0) and np.allclose(proposal.probs.sum(1), 1)
    assert all(np.count_nonzero(row) == 3 for row in proposal.probs)  # top-k applied to q as to p
    assert all(proposal.probs[i, t] > 0 for i, t in enumerate(proposal.tokens))


def _full(rows, subset, vocab):
    full = np.full((rows.shape[0], vocab), -np.inf, np.float32)
    full[:, subset] = rows
    return full


@pytest.fixture(scope="module")
def engine(distilled_artifact):
    return Engine.load(distilled_artifact, provider="cpu", threads=1)


@pytest.fixture(scope="module")
def layers_engine(distilled_layers_artifact):
    return Engine.load(distilled_layers_artifact, provider="cpu", threads=1)


def _prompts(engine):
    from specdec.exporter.distill.prompts import training_prompts

    # Training prompts: the tiny head fits its data, so drafts get accepted and every path runs.
    return [engine.prompt_ids(p, chat=True) for p in training_prompts(16, seed=0)[:3]] + [engine.prompt_ids("Hello")]


@pytest.mark.parametrize("drafter, k", [("eagle", 1), ("eagle", 3), ("eagle", "auto"), ("ngram+eagle", "auto")])
def test_greedy_with_the_eagle_drafter_equals_target_only(engine, drafter, k):
    accepted = drafted = 0
    for ids in _prompts(engine):
        reference = engine.generate(ids, GenerationConfig(max_new_tokens=32, drafter="none"))
        result = engine.generate(ids, GenerationConfig(max_new_tokens=32, drafter=drafter, num_draft_tokens=k))
        assert result.token_ids == reference.token_ids
        accepted += result.stats.accepted
        drafted += result.stats.drafted
    assert drafted > 0, drafted
    if k != "auto":  # under auto, K (and so what gets drafted where) follows this machine's timings
        assert accepted > 0, (accepted, drafted)


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_with_a_head_reading_lower_layers_equals_target_only(layers_engine, k):
    """The head fed [feature, layer 0 and 1 inputs] by the target and [own feature, 0] by itself stays exact."""
    test_greedy_with_the_eagle_drafter_equals_target_only(layers_engine, "eagle", k)


def test_sampled_with_the_eagle_drafter_has_the_target_distribution(engine):
    """Chi-square of the first four tokens' joint distribution (tests/runtime/test_exactness.py's test)."""
    from tests.runtime.test_exactness import _assert_fits, _sampled_joint, _target_joint

    settings = dict(temperature=1.0, top_k=4, top_p=0.9)
    prompt_ids = _prompts(engine)[0]
    exact = _target_joint(engine, prompt_ids, SamplingConfig(**settings), depth=4)
    runs = 2000
    counts, totals = _sampled_joint(engine, prompt_ids, runs, drafter="eagle", num_draft_tokens=2, **settings)
    assert totals["accepted"] >= runs // 20 and totals["rejections"] >= runs // 20, totals
    _assert_fits(counts, exact, totals)


def _generate(art, *args):
    from specdec.cli.main import main

    return CliRunner().invoke(main, ["generate", str(art), "Hello", "--max-new-tokens", "4", *args])


def test_corrupted_head_is_refused_in_one_line(distilled_artifact, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(distilled_artifact, art)
    manifest = json.loads((art / "specdec.json").read_text())
    graph = art / manifest["feature_draft"]["files"][0]
    graph.write_bytes(graph.read_bytes()[:-100])
    result = _generate(art)
    assert result.exit_code == 1 and "does not match its sha256" in result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output


def test_head_for_another_target_is_refused_in_one_line(distilled_artifact, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(distilled_artifact, art)
    path = art / "specdec.json"
    manifest = json.loads(path.read_text())
    manifest["feature_draft"]["target_graph_sha256"] = "0" * 64
    path.write_text(json.dumps(manifest))
    result = _generate(art)
    assert result.exit_code == 1 and "trained for another target graph" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_eagle_asked_of_an_artifact_without_a_head(tiny_target_only_artifact):
    result = _generate(tiny_target_only_artifact, "--drafter", "eagle")
    assert result.exit_code == 1 and "no trained draft head" in result.output
