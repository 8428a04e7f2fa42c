"""--greedy-head: greedy calls read an 8-bit LM head, bounded, and still pick the fp32 head's argmax."""

from dataclasses import replace

import numpy as np
import pytest
from onnx import numpy_helper

from specdec.exporter.pipeline import ExportConfig, run_export
from specdec.exporter.validate import greedy_head_check
from specdec.models.errors import ExportError
from specdec.models.manifest import load_manifest
from specdec.runtime.engine import Engine, GenerationConfig
from specdec.runtime.greedy_head import MAX_ROWS, activation_error, argmax_candidates, logit_bounds
from specdec.runtime.session import ModelSession, reads_greedy_head


def _int8_blocks(x, block=32):
    """Symmetric int8 quantization in blocks of `block` along the last axis, round to nearest."""
    rows, width = x.shape
    blocks = x.reshape(rows, width // block, block)
    scale = np.abs(blocks).max(axis=2, keepdims=True) / 127
    scale[scale == 0] = 1
    return (np.round(blocks / scale) * scale).reshape(rows, width)


@pytest.mark.parametrize("outliers", [False, True])
def test_bound_covers_int8_activations_and_weights_and_keeps_the_argmax(outliers):
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((64, 96))
    if outliers:  # one large element per block makes its block's step large
        hidden[:, ::32] *= 50
    weights = rng.standard_normal((500, 96)) * 0.05
    quantized_weights = _int8_blocks(weights)
    approx = _int8_blocks(hidden) @ quantized_weights.T
    exact = hidden @ weights.T
    assert (activation_error(hidden) >= np.linalg.norm(hidden - _int8_blocks(hidden), axis=1)).all()
    bounds = logit_bounds(hidden, np.linalg.norm(weights, axis=1), np.linalg.norm(weights - quantized_weights, axis=1))
    assert (np.abs(exact - approx) <= bounds).all()
    sizes = []
    for row in range(len(hidden)):
        candidates = argmax_candidates(approx[row], bounds[row])
        assert np.argmax(exact[row]) in candidates
        sizes.append(len(candidates))
    assert np.median(sizes) < 50  # the bound is useful, not just safe: most tokens are ruled out


def test_near_top_candidates_are_argmax_candidates():
    from specdec.runtime.greedy_head import bound_factors, near_top_candidates

    rng = np.random.default_rng(1)
    hidden = rng.standard_normal((40, 64)).astype(np.float32)
    norms, errors = rng.random(3000).astype(np.float32) * 2, rng.random(3000).astype(np.float32) * 0.02
    approx = rng.standard_normal((40, 3000)).astype(np.float32) * 3
    bounds = logit_bounds(hidden, norms, errors)
    per_norm, per_error = bound_factors(hidden)
    for row in range(40):
        widest = per_norm[row] * norms.max() + per_error[row] * errors.max() + 1e-4
        fast = near_top_candidates(approx[row], per_norm[row], per_error[row], norms, errors, widest)
        np.testing.assert_array_equal(fast, argmax_candidates(approx[row], bounds[row]))


@pytest.fixture(scope="module")
def greedy_artifact(export_tiny_llama):
    """The tiny llama pair exported with --greedy-head."""
    return export_tiny_llama("greedy-head", greedy_head=True)


def test_export_records_and_checks_the_head(greedy_artifact):
    manifest = load_manifest(greedy_artifact)  # checks every sha256, the head's files included
    record = manifest.target.greedy_head
    assert record["norms"] in manifest.target.sha256 and record["weights"] in manifest.target.sha256
    check = manifest.validation["target"]["greedy_head"]
    assert check["argmax_equal"] and check["bound_holds"] and 0 < check["max_error_over_bound"] <= 1
    assert check["positions"] > 0 and check["candidates_max"] < manifest.target.vocab_size
    assert manifest.draft.greedy_head is None
    from click.testing import CliRunner

    from specdec.cli.main import main

    shown = CliRunner().invoke(main, ["inspect", str(greedy_artifact)])
    assert shown.exit_code == 0 and "an 8-bit LM head" in shown.output, shown.output


@pytest.mark.parametrize("drafter", ["none", "model", "ngram"])
def test_greedy_output_equals_the_fp32_heads(greedy_artifact, drafter):
    engine = Engine.load(greedy_artifact, provider="cpu")
    head = engine.target.greedy_head
    assert head is not None
    prompt = "one, two, three, one, two, three, one,"
    with_head = engine.generate(prompt, GenerationConfig(max_new_tokens=40, drafter=drafter, num_draft_tokens=3))
    assert head.candidates_seen > 0  # the greedy calls did go through it
    engine.target.greedy_head = None  # the graph's own fp32 head
    without = engine.generate(prompt, GenerationConfig(max_new_tokens=40, drafter=drafter, num_draft_tokens=3))
    assert with_head.token_ids == without.token_ids
    engine.target.greedy_head = head
    plain = engine.generate(prompt, GenerationConfig(max_new_tokens=40, drafter="none"))
    assert with_head.token_ids == plain.token_ids


def test_greedy_steps_write_the_heads_rows_into_kept_buffers(greedy_artifact):
    """Steps and verify calls through the 8-bit head allocate nothing per call, and a returned row
    is not overwritten by the next call (fetching per-call outputs cost ~0.4 ms each on SmolLM2)."""
    session = Engine.load(greedy_artifact, provider="cpu").target
    cache = session.new_cache()
    session.forward(cache, [5, 6, 7, 8], logits_rows=1, greedy=True)
    call = cache.bindings[(False, True)]
    allocated = []
    call.output_allocated = lambda name, device: allocated.append(name) or 0
    first = session.forward(cache, [9], logits_rows=1, greedy=True)
    kept = first.copy()
    verify = session.forward(cache, [10, 11, 12], greedy=True)
    head = session.spec.greedy_head
    assert allocated == [session.spec.logits_name] * 2  # only the fp32 head's empty output
    assert {name for name, _ in call._outputs} == {head["input_name"], head["approx_name"]}
    np.testing.assert_array_equal(first, kept)
    assert verify.shape == (3, session.vocab_limit) and np.isfinite(verify.max(axis=1)).all()


def test_long_verify_calls_read_the_fp32_head(greedy_artifact):
    session = Engine.load(greedy_artifact, provider="cpu").target
    head = session.greedy_head
    cache = session.new_cache()
    session.forward(cache, list(range(5, 25)), logits_rows=1, greedy=True)
    seen = head.candidates_seen
    assert seen > 0
    long = session.forward(cache, list(range(30, 31 + MAX_ROWS)), greedy=True)
    assert head.candidates_seen == seen and np.isfinite(long).all()  # the fp32 head: every logit real
    cache.rollback(20)
    short = session.forward(cache, list(range(30, 30 + MAX_ROWS)), greedy=True)
    assert head.candidates_seen > seen
    np.testing.assert_array_equal(short.argmax(axis=1), long[:MAX_ROWS].argmax(axis=1))
    # a graph that scores tokens alike in calls of every length keeps the 8-bit head for all of them
    assert not reads_greedy_head(session.spec, MAX_ROWS + 1)
    assert reads_greedy_head(replace(session.spec, attention_pad_rows=1), MAX_ROWS + 1)
    assert reads_greedy_head(replace(session.spec, min_rows=2), MAX_ROWS + 1)


def test_sampling_keeps_the_fp32_head(greedy_artifact):
    engine = Engine.load(greedy_artifact, provider="cpu")
    head = engine.target.greedy_head
    seen = head.candidates_seen
    config = GenerationConfig(max_new_tokens=24, drafter="ngram", temperature=0.8, seed=3)
    sampled = engine.generate("The quick brown fox", config)
    assert head.candidates_seen == seen  # never asked: sampling needs every logit
    engine.target.greedy_head = None
    assert engine.generate("The quick brown fox", config).token_ids == sampled.token_ids


def test_a_head_that_does_not_bound_the_fp32_one_fails_the_check(greedy_artifact, tmp_path):
    """Every scale of the 8-bit head doubled (a quantizer dividing by the wrong range): refused."""
    import shutil

    import onnx

    broken = tmp_path / "art"
    shutil.copytree(greedy_artifact, broken)
    spec = load_manifest(broken).target
    graph_path = broken / spec.graph_file
    graph = onnx.load(str(graph_path))
    scales = [init for init in graph.graph.initializer if init.name.startswith("specdec_greedy_head_") and
              init.name.endswith("scales")]
    assert scales
    for init in scales:
        init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * np.float32(2), init.name))
    onnx.save(graph, str(graph_path))
    prompts = [list(range(5, 60)), [7, 8, 9] * 10]
    check = greedy_head_check(ModelSession(broken, spec, provider="cpu"), prompts)
    assert not check["bound_holds"] and check["max_error_over_bound"] > 1


def test_greedy_head_is_for_fp32_targets(tiny_sources, tmp_path):
    target, _ = tiny_sources["llama"]
    with pytest.raises(ExportError, match="--greedy-head"):
        run_export(ExportConfig(target=str(target), draft=None, output=tmp_path / "x", greedy_head=True,
                                weights="int4"), progress=lambda m: None)
    assert not (tmp_path / "x").exists()


def test_manifest_refuses_an_incomplete_head_record(greedy_artifact):
    from specdec.models.errors import ManifestError
    from specdec.models.manifest import manifest_from_dict

    data = load_manifest(greedy_artifact).to_dict()
    del data["target"]["greedy_head"]["norms"]
    with pytest.raises(ManifestError, match="greedy_head"):
        manifest_from_dict(data)


@pytest.mark.parametrize("greedy", [True, False])
def test_a_hidden_prefill_runs_the_lm_head_on_the_kept_rows_only(greedy_artifact, tmp_path, greedy):
    # An eagle prefill needs every row's feature but one row's logits: the head reads from the last row on.
    import dataclasses
    import shutil

    from specdec.exporter.distill.hidden_tap import HIDDEN_OUTPUT, add_hidden_output

    folder = tmp_path / "art"
    shutil.copytree(greedy_artifact, folder)
    spec = load_manifest(folder).target
    add_hidden_output(folder / spec.graph_file, folder / "target" / "tapped.onnx", spec.logits_name)
    spec = dataclasses.replace(spec, files=["target/tapped.onnx"] + spec.files[1:], hidden_name=HIDDEN_OUTPUT)
    session = ModelSession(folder, spec, "cpu", threads=1)
    ids = list(range(5, 5 + MAX_ROWS))  # longer greedy calls read the fp32 head
    every, every_hidden = session.forward(session.new_cache(), ids, hidden=True, greedy=greedy)
    cache = session.new_cache()
    last, hidden = session.forward(cache, ids, logits_rows=1, hidden=True, greedy=greedy)
    np.testing.assert_array_equal(last, every[-1:])
    np.testing.assert_array_equal(hidden, every_hidden)
    assert hidden.shape[0] == len(ids)
    call = cache.bindings[(True, greedy)]
    head_output = spec.greedy_head["approx_name"] if greedy else spec.logits_name
    assert call.io.get_outputs()[call._order(head_output)].shape()[1] == 1  # one row computed, not all


def test_sixteen_concurrent_greedy_head_requests_each_get_their_sequential_text(greedy_artifact, monkeypatch):
    """The 8-bit head's rows live in the request's cache, not on the shared session: 16 threads at once, a
    thread switch forced inside every head call, every text as when run alone. With the batch engine too
    (its batched rows read the same head)."""
    import threading
    import time

    from specdec.runtime.batch import BatchEngine
    from specdec.runtime.greedy_head import GreedyHead

    engine = Engine.load(greedy_artifact, provider="cpu", threads=1)
    prompts = [f"{word} {n}" for n in range(4) for word in ("Hello", "one two", "abc", "The")]
    config = GenerationConfig(max_new_tokens=12, drafter="ngram", num_draft_tokens=2)
    alone = [engine.generate(p, config).token_ids for p in prompts]
    logits = GreedyHead.logits
    monkeypatch.setattr(GreedyHead, "logits", lambda self, h, a: time.sleep(0.001) or logits(self, h, a))
    batch = BatchEngine(engine, max_batch=8, kv_capacity=64)
    for run in (lambda p: engine.generate(p, config), lambda p: batch.generate(p, config)):
        results = [None] * len(prompts)
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, run(prompts[i]).token_ids))
                   for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == alone
    batch.shutdown()
