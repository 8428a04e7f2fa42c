"""Draft heads in the batch engine: the target's ragged-rows graph returns every row's hidden states (tapped by
`specdec distill`), each request's head drafts from its own rows, and every text is still its own."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest

from specdec.exporter.distill.hidden_tap import _remove_tap
from specdec.models.errors import GenerationError
from specdec.models.manifest import MANIFEST_FILENAME, load_manifest
from specdec.runtime.batch import BatchEngine
from specdec.runtime.engine import Engine, GenerationConfig

from tests.distill.test_eagle_runtime import _prompts
from tests.runtime.test_batch import _burst, _concurrently, _results_in_batch, _taken_slots


@pytest.fixture(scope="module")
def engine(distilled_artifact):
    engine = Engine.load(distilled_artifact, provider="cpu", threads=1)
    engine.eagle.ragged_from = 2  # every round of 2+ head calls shares one call (timed on the tiny head: any)
    return engine


def test_distill_taps_the_ragged_rows_graph_whose_rows_equal_batch_1_calls(distilled_artifact):
    manifest = load_manifest(distilled_artifact)
    assert manifest.target.ragged_file.endswith(".hidden.onnx") and manifest.target.ragged_file in manifest.target.sha256
    assert manifest.validation["target_hidden"]["ragged_rows_max_diff"] == 0.0


def _head_feeds(head, counts, seed=0):
    """Return HeadFeeds of `counts` pairs each over random pasts of different lengths."""
    from specdec.runtime.eagle import HeadFeed

    rng = np.random.default_rng(seed)
    spec = head.spec
    return [HeadFeed(rng.standard_normal((n, head.feature_width)).astype(np.float32),
                     [int(t) for t in rng.choice(head.subset, n)], past,
                     rng.standard_normal((1, spec.num_kv_heads, past, spec.head_dim)).astype(np.float32),
                     rng.standard_normal((1, spec.num_kv_heads, past, spec.head_dim)).astype(np.float32))
            for n, past in zip(counts, [0, 5, 2, 9, 1, 7, 3, 4, 6, 8, 11])]


def test_distill_writes_a_ragged_head_whose_rows_equal_each_requests_own_call(engine, distilled_artifact):
    """The head's ragged-rows graph gives every request what its own call gives, to the bit: logits, features and
    presents, with idle rows (fewer requests than rows) and more requests than rows (two calls)."""
    spec = load_manifest(distilled_artifact).feature_draft
    head = engine.eagle
    assert spec.ragged_file in spec.sha256 and spec.ragged_rows == engine.target.spec.ragged_rows
    assert head.ragged_session is not None
    for counts in ([1, 1], [4, 1, 2], [1] * spec.ragged_rows, [3, 1, 1, 2, 1, 1, 1, 2, 1, 5]):
        feeds = _head_feeds(head, counts)
        calls = head.ragged_calls
        shared = head.run_rows(feeds)
        assert head.ragged_calls - calls == -(-len(counts) // spec.ragged_rows)
        for got, feed in zip(shared, feeds):
            alone = head.run_feed(feed)
            for a, b in ((got.logits, alone.logits), (got.features, alone.features), (got.key, alone.key),
                         (got.value, alone.value)):
                assert a.shape == b.shape and np.array_equal(a, b)


def test_head_calls_share_a_call_only_from_the_count_where_it_was_timed_faster(distilled_artifact):
    head = Engine.load(distilled_artifact, provider="cpu", threads=1).eagle
    assert head.ragged_from is None
    head.run_rows(_head_feeds(head, [1, 1]))
    assert 2 <= head.ragged_from <= head.ragged_rows + 1  # timed at the first call of several
    for count in range(2, head.ragged_rows + 1):
        calls = head.ragged_calls
        head.run_rows(_head_feeds(head, [1] * count))
        assert head.ragged_calls - calls == (count >= head.ragged_from), count


def test_a_head_distilled_before_its_ragged_graph_drafts_one_call_each_under_load(distilled_artifact, tmp_path):
    folder = tmp_path / "art"
    shutil.copytree(distilled_artifact, folder)
    manifest = json.loads((folder / MANIFEST_FILENAME).read_text())
    ragged = manifest["feature_draft"].pop("ragged_file")
    manifest["feature_draft"].pop("ragged_rows")
    del manifest["feature_draft"]["sha256"][ragged]
    (folder / MANIFEST_FILENAME).write_text(json.dumps(manifest))
    old = Engine.load(folder, provider="cpu", threads=1)
    assert old.eagle.ragged_session is None
    prompts = (_prompts(old) * 2)[:4]
    reference = [old.generate(p, GenerationConfig(max_new_tokens=16, drafter="none")).token_ids for p in prompts]
    batch = BatchEngine(old, max_batch=8, kv_capacity=256)
    try:
        results = _concurrently(batch, prompts, [GenerationConfig(max_new_tokens=16, drafter="eagle",
                                                                  num_draft_tokens=2)] * 4)
    finally:
        batch.shutdown()
    assert [r.token_ids for r in results] == reference
    assert batch.head_ragged_calls == 0 and sum(r.stats.drafted for r in results) > 0


@pytest.mark.parametrize("clients", [4, 8])
def test_head_requests_under_load_give_each_prompts_target_only_greedy_text(engine, clients):
    prompts = (_prompts(engine) * 4)[:clients]
    reference = [engine.generate(p, GenerationConfig(max_new_tokens=24, drafter="none")).token_ids for p in prompts]
    kinds = [dict(drafter="eagle", num_draft_tokens=3), dict(drafter="none"), dict(drafter="eagle", num_draft_tokens=1),
             dict(drafter="ngram+eagle", num_draft_tokens="auto")]
    configs = [GenerationConfig(max_new_tokens=24, **kinds[i % len(kinds)]) for i in range(clients)]
    results, batch = _results_in_batch(engine, prompts, configs, max_batch=8, kv_capacity=256)
    assert [r.token_ids for r in results] == reference
    assert batch.ragged_calls > 0 and batch.head_ragged_calls > 0  # target rows and head calls both shared
    heads = [r for r, c in zip(results, configs) if c.drafter == "eagle"]
    assert sum(r.stats.drafted for r in heads) > 0 and sum(r.stats.accepted for r in heads) > 0


def test_a_seeded_sampled_head_request_gives_its_own_tokens_under_load(engine):
    prompts = _prompts(engine)
    config = GenerationConfig(max_new_tokens=24, drafter="eagle", num_draft_tokens=2, temperature=0.8, seed=11)
    alone = engine.generate(prompts[0], config).token_ids
    others = [GenerationConfig(max_new_tokens=24, drafter=d, num_draft_tokens=2, temperature=0.8, seed=s)
              for d, s in (("none", 1), ("eagle", 2), ("ngram", 3))]
    batch = BatchEngine(engine, max_batch=8, kv_capacity=256)
    try:
        results = _burst(batch, prompts, [config] + others)
    finally:
        batch.shutdown()
    assert results[0].token_ids == alone


def test_an_artifact_whose_ragged_graph_has_no_hidden_rows_is_refused_naming_distill(distilled_artifact, tmp_path):
    folder = tmp_path / "art"
    shutil.copytree(distilled_artifact, folder)
    manifest = json.loads((folder / MANIFEST_FILENAME).read_text())
    graph = onnx.load(str(folder / manifest["target"]["ragged_file"]), load_external_data=False)
    _remove_tap(graph)  # the ragged graph as distill left it before heads were batched
    onnx.save(graph, str(folder / "target" / "ragged.onnx"))
    manifest["target"]["ragged_file"] = "target/ragged.onnx"
    (folder / MANIFEST_FILENAME).write_text(json.dumps(manifest))
    old = Engine.load(folder, provider="cpu", threads=1, check_files=False)
    batch = BatchEngine(old, max_batch=8, kv_capacity=256)
    try:
        with pytest.raises(GenerationError, match="run `specdec distill` again"):
            batch.stream("Hello", GenerationConfig(drafter="eagle"))
        assert batch.generate("Hello", GenerationConfig(max_new_tokens=4, drafter="none")).token_ids  # others run
    finally:
        batch.shutdown()
    small = BatchEngine(Engine.load(distilled_artifact, provider="cpu", threads=1), max_batch=4, kv_capacity=256)
    try:
        with pytest.raises(GenerationError, match="--max-batch 8"):
            small.stream("Hello", GenerationConfig(drafter="eagle"))
    finally:
        small.shutdown()


def test_sampled_head_requests_under_batching_keep_the_targets_distribution(engine):
    """Chi-square of the first four tokens' joint distribution, head and plain requests mixed 8 at a time."""
    from collections import Counter

    from specdec.runtime.sampling import SamplingConfig
    from tests.runtime.test_exactness import _chi_square, _target_joint

    settings = dict(temperature=1.3, top_k=3)
    prompt_ids = _prompts(engine)[0]
    exact = _target_joint(engine, prompt_ids, SamplingConfig(**settings), depth=4)
    runs, observed, drafted, accepted = 1500, Counter(), 0, 0
    batch = BatchEngine(engine, max_batch=8, kv_capacity=256)
    try:
        for start in range(0, 2 * runs, 64):
            streams = [(s % 2 == 0, batch.stream(prompt_ids, GenerationConfig(
                max_new_tokens=4, seed=s, drafter="eagle" if s % 2 == 0 else "none", num_draft_tokens=2, **settings)))
                for s in range(start, start + 64)]
            for head, stream in streams:
                for _ in stream:
                    pass
                if head:
                    observed[tuple(stream.result.token_ids[:4])] += 1
                    drafted += stream.result.stats.drafted
                    accepted += stream.result.stats.accepted
    finally:
        batch.shutdown()
    assert batch.ragged_calls > 0 and 0 < accepted < drafted  # drafts verified, some rejected (resampled)
    assert batch.head_ragged_calls > 0  # heads drafted in shared calls
    assert set(observed) <= set(exact), "sampled a sequence the target gives zero probability"
    chi2, critical = _chi_square(observed, exact, sum(observed.values()))
    assert chi2 < critical, (chi2, critical)


def test_with_more_slots_than_ragged_rows_head_requests_keep_the_load_in_the_ragged_rows(engine):
    """A head's request needs the ragged-rows graph every step: while one runs or waits, requests take only the
    slots that graph spans (12 clients on 16 slots: 8 run, 4 wait), and every text is still its own."""
    rows = engine.target.spec.ragged_rows
    prompts = (_prompts(engine) * 6)[:12]
    reference = [engine.generate(p, GenerationConfig(max_new_tokens=16, drafter="none")).token_ids for p in prompts]
    configs = [GenerationConfig(max_new_tokens=16, drafter="eagle" if i % 3 == 0 else "none", num_draft_tokens=2)
               for i in range(12)]
    batch = BatchEngine(engine, max_batch=2 * rows, kv_capacity=256)
    slots = _taken_slots(batch)
    try:
        results = _burst(batch, prompts, configs)
    finally:
        batch.shutdown()
    assert [r.token_ids for r in results] == reference
    assert len(slots) == 12 and max(slots) < rows and batch.ragged_calls > 0
