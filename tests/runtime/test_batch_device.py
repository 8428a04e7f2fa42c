"""The batch engine off the CPU: fp16 artifacts (what the CUDA provider runs) get a ragged-rows graph, and KV
slots bound by address in onnxruntime's own memory (as on a GPU, run here on the CPU provider). Greedy output
under load is still each prompt's target-only output."""

import pytest

from specdec.certify import device_check
from specdec.exporter.tiny_models import build_perturbed_draft
from specdec.models.manifest import load_manifest
from specdec.runtime import slots
from specdec.runtime.batch import BatchEngine
from specdec.runtime.engine import Engine, GenerationConfig

from tests.conftest import _export
from tests.runtime.test_batch import PROMPT_SET, _concurrently

KINDS = [dict(drafter="none"), dict(drafter="ngram", num_draft_tokens="auto", ngram_min=1),
         dict(drafter="model", num_draft_tokens=3), dict(drafter="ngram+model", num_draft_tokens="auto")]


@pytest.fixture(scope="module")
def fp16_artifact(tiny_sources, tmp_path_factory):
    target, _ = tiny_sources["llama"]
    root = tmp_path_factory.mktemp("fp16-batch")
    draft = build_perturbed_draft(target, root / "draft", noise=0.01, seed=1)
    return _export(target, draft, root / "art", dtype="fp16")


@pytest.fixture(scope="module")
def fp16_engine(fp16_artifact):
    return Engine.load(fp16_artifact, provider="cpu", threads=1)


def _greedy_under_load(engine, clients, max_batch, prefix_cache=False, prompts=None):
    prompts = prompts or (PROMPT_SET * 2)[:clients]
    reference = [engine.generate(p, GenerationConfig(max_new_tokens=20, drafter="none")).token_ids for p in prompts]
    configs = [GenerationConfig(max_new_tokens=20, **KINDS[i % len(KINDS)]) for i in range(len(prompts))]
    batch = BatchEngine(engine, max_batch=max_batch, kv_capacity=128, prefix_cache=prefix_cache)
    try:
        results = _concurrently(batch, prompts, configs)
    finally:
        batch.shutdown()
    return batch, [r.token_ids for r in results], reference


def test_an_fp16_export_has_a_ragged_graph_equal_to_batch_1_calls(fp16_engine):
    manifest = load_manifest(fp16_engine.artifact_dir)
    for spec in (manifest.target, manifest.draft):
        assert spec.kv_dtype == "float16" and spec.ragged_rows == 8 and spec.ragged_file
        assert manifest.validation[spec.role]["ragged_rows_max_diff"] == 0.0


@pytest.mark.parametrize("clients", [4, 16])
def test_fp16_greedy_under_load_equals_each_prompts_target_only_output(fp16_engine, clients):
    batch, texts, reference = _greedy_under_load(fp16_engine, clients, max_batch=8)
    assert texts == reference
    assert batch.ragged_calls > 0  # drafts were verified together
    assert clients < 16 or batch.draft_ragged_calls > 0  # and drafted together, with 8 drafting requests


def test_slots_in_onnxruntime_memory_bound_by_address_serve_greedy_exactly(fp16_engine, monkeypatch):
    """The path a CUDA session takes, on the CPU provider: the arena is onnxruntime's memory (no numpy view), each
    slot a KVView at its row's offset; no prefix is copied between slots, a slot's own kept prefix is reused."""
    monkeypatch.setattr(slots, "HOST_DEVICES", ())
    arena = slots.SlotArena(fp16_engine.target, 4, 64)
    assert arena.host_buffers is None and not arena.copies_prefixes
    row_bytes = arena.buffers[0].tensor_size_in_bytes() // 4
    cache = arena.take()
    arena.give(cache)
    third = [arena.take() for _ in range(3)][2]
    assert third.tensors[0].data_ptr() == arena.buffers[0].data_ptr() + 2 * row_bytes
    assert third.tensors[0].shape() == [1] + list(arena.buffers[0].shape())[1:]

    head = "the the the the " * 6  # a shared opening longer than MIN_PREFIX tokens
    prompts = [head + tail for tail in ("red green", "x = [1, 2,", "Paris is", "1 2 3 4", "zz", "q")]
    batch, texts, reference = _greedy_under_load(fp16_engine, 0, max_batch=2, prefix_cache=True, prompts=prompts)
    assert texts == reference
    assert batch.arena.prefix_copies == 0 and batch.prefix_tokens_reused > 0  # a freed slot's own prefix, reused


def test_the_device_check_runs_the_batch_engine_and_catches_slots_bound_to_one_row(fp16_artifact, monkeypatch):
    check = device_check.ArtifactCheck("fp16", "cpu")
    engine = Engine.load(fp16_artifact, provider="cpu", threads=1)
    targets = {p: engine.generate(p, GenerationConfig(max_new_tokens=12, drafter="none")).token_ids
               for p in device_check.PROMPTS}
    device_check.check_batch(check, engine, targets, ["ngram", "model"], 12)
    assert check.failures == [] and check.batch["mismatches"] == []
    assert check.batch["kv_device"] == "cpu" and check.batch["requests"] == 9 and check.batch["ragged_calls"] > 0
    assert {1, 2, 4, 8} <= set(check.batch["batched_call_ms"])  # timed at start, and any span the run observed

    # A device that ignored each slot's offset: every slot's view lands on row 0, so requests overwrite each other.
    views = slots.SlotArena.__init__

    def one_row(self, *args, **kwargs):
        views(self, *args, **kwargs)
        real = self._views
        self._views = lambda first, rows: real(0, rows)
        for cache in self._caches:
            cache.tensors = real(0, 1)

    monkeypatch.setattr(slots.SlotArena, "__init__", one_row)
    broken = device_check.ArtifactCheck("fp16", "cpu")
    device_check.check_batch(broken, engine, targets, ["ngram", "model"], 12)
    assert any(f.startswith("batched greedy") for f in broken.failures), broken.failures


def test_an_artifact_that_cannot_batch_is_reported_not_failed(tiny_target_only_artifact, monkeypatch):
    engine = Engine.load(tiny_target_only_artifact, provider="cpu", threads=1)
    monkeypatch.setattr(type(engine.target), "batches", property(lambda self: False))
    monkeypatch.setattr(engine.target, "ragged_session", lambda: None)
    check = device_check.ArtifactCheck("old", "cpu")
    device_check.check_batch(check, engine, {"hello": [1]}, [], 4)
    assert check.failures == [] and "re-export" in check.batch["skipped"]
