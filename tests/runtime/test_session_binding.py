"""ModelSession.forward keeps one IOBinding per cache and may pad short calls (min_rows): neither may change a number."""

import dataclasses

import numpy as np

from specdec.models.manifest import load_manifest
from specdec.runtime.engine import Engine
from specdec.runtime.session import KEPT_OUTPUT_ROWS, ModelSession

from tests.runtime.helpers import greedy


def _session(artifact, **spec_changes):
    spec = dataclasses.replace(load_manifest(artifact).target, **spec_changes)
    return ModelSession(artifact, spec, provider="cpu")


def test_reused_binding_follows_growth_rollback_and_reuse(tiny_artifacts):
    """Steps through a cache that grows twice (new buffers, rebound) and rolls back equal one fresh call."""
    session = _session(tiny_artifacts["llama"])
    assert session.shared_kv
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 300, size=40).tolist()
    fresh_cache = session.new_cache(64)
    fresh = session.forward(fresh_cache, tokens)
    # a prefill's 40 rows of logits go to a per-call allocation, not a buffer the request keeps
    assert all(shape[1] <= KEPT_OUTPUT_ROWS for _, shape in fresh_cache.bindings[(False, False)]._outputs)

    cache = session.new_cache(capacity=4)
    first_buffers = cache.tensors
    rows = [session.forward(cache, tokens[:3])]
    for i in range(3, 40, 3):
        garbage = rng.integers(0, 300, size=2).tolist()
        session.forward(cache, garbage)  # rejected drafts, then rolled back
        cache.rollback(i)
        rows.append(session.forward(cache, tokens[i:i + 3]))
    assert cache.tensors is not first_buffers and cache.capacity >= 40  # reserve grew the buffers
    np.testing.assert_allclose(np.concatenate(rows), fresh, atol=1e-4)


def test_returned_logits_are_not_overwritten_by_the_next_call(tiny_artifacts):
    session = _session(tiny_artifacts["llama"])
    cache = session.new_cache()
    first = session.forward(cache, [5, 6, 7], logits_rows=1)
    kept = first.copy()
    session.forward(cache, [8], logits_rows=1)
    session.forward(cache, [9], logits_rows=1)
    np.testing.assert_array_equal(first, kept)


def test_min_rows_pads_one_token_calls_and_changes_no_logit(tiny_artifacts):
    artifact = tiny_artifacts["llama"]
    plain, padded = _session(artifact), _session(artifact, min_rows=2)
    fed = []

    tokens = [11, 12, 13, 14, 15, 16, 17]
    plain_cache, padded_cache = plain.new_cache(), padded.new_cache()
    expected = [plain.forward(plain_cache, [t], logits_rows=1) for t in tokens]
    padded_cache.inputs.bind = _recording(padded_cache.inputs.bind, fed)
    got = [padded.forward(padded_cache, [t], logits_rows=1) for t in tokens]

    ids_shapes = [shape for name, shape in fed if name == padded.spec.input_ids_name]
    assert ids_shapes == [(1, 2)] * len(tokens)  # every 1-token call went in as 2 positions
    assert padded_cache.length == len(tokens) and padded_cache.token_ids == tokens
    for a, b in zip(expected, got):
        assert a.shape == b.shape == (1, plain.vocab_limit)
        np.testing.assert_allclose(b, a, atol=1e-4)
    # a call of min_rows tokens or more is fed as it is, and still keeps min_rows rows through the
    # last layer (a prefill asking for its last row only gets 2 computed)
    fed.clear()
    np.testing.assert_allclose(padded.forward(padded_cache, [1, 2, 3], logits_rows=1),
                               plain.forward(plain_cache, [1, 2, 3], logits_rows=1), atol=1e-4)
    assert [s for n, s in fed if n == padded.spec.input_ids_name] == [(1, 3)]
    assert all(shape[1] >= 2 for _, shape in padded_cache.bindings[(False, False)]._outputs)


def _recording(bind, log):
    def record(binding, name, array):
        log.append((name, array.shape))
        bind(binding, name, array)
    return record


def test_min_rows_target_decodes_speculatively_to_its_own_greedy_output(tiny_close_artifacts):
    artifact = tiny_close_artifacts["llama"]
    engine = Engine.load(artifact, provider="cpu")
    engine.target.spec = dataclasses.replace(engine.target.spec, min_rows=2)
    accepted = {"model": 0, "ngram": 0}
    for prompt in ["The quick brown fox", "one, two, three, one, two, three, one, two,"]:
        ids = engine.prompt_ids(prompt)
        reference = greedy(engine, ids, drafter="none").token_ids
        ids = ids + reference * 2  # something for the n-gram drafter to copy
        reference = greedy(engine, ids, drafter="none").token_ids
        for drafter in accepted:
            result = greedy(engine, ids, drafter=drafter, num_draft_tokens=3, ngram_min=1)
            assert result.token_ids == reference, (prompt, drafter)
            accepted[drafter] += result.stats.accepted
    assert all(accepted.values()), accepted  # verify calls (never padded) did score accepted drafts
