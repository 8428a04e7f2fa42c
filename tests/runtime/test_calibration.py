import json

from specdec.runtime.calibration import (
    CACHE_DIR_ENV,
    NO_CACHE_ENV,
    cache_dir,
    cache_key,
    load_call_costs,
    save_call_costs,
)
from specdec.runtime.engine import Engine, GenerationConfig

PROMPT = "one, two, three, one, two, three, one,"
AUTO = GenerationConfig(max_new_tokens=8, drafter="ngram", num_draft_tokens="auto", max_draft_tokens_auto=4)


def test_round_trip_and_what_counts_as_no_table():
    key = cache_key("abc", "cpu", 2, "1.0")
    assert load_call_costs(key, 3) is None
    path = save_call_costs(key, {1: 1.0, 2: 1.1, 3: 1.2})
    assert path is not None and path.parent == cache_dir()
    assert load_call_costs(key, 3) == {1: 1.0, 2: 1.1, 3: 1.2}
    assert load_call_costs(key, 4) is None  # too short for a higher cap
    path.write_text("{not json")
    assert load_call_costs(key, 3) is None
    path.write_text(json.dumps({"format": 2, "call_costs": [1.0, -2.0]}))
    assert load_call_costs(key, 2) is None
    path.write_text(json.dumps({"format": 1, "call_costs": [1.0, 1.1, 1.2]}))  # timed by an older, noisier rule
    assert load_call_costs(key, 3) is None
    assert save_call_costs(key, {1: 1.0, 3: 1.2}) is None  # a gap: not worth keeping
    assert list(cache_dir().glob("*.tmp")) == []


def test_key_separates_graph_device_threads_and_runtime():
    keys = {cache_key("abc", "cpu", 2, "1.0"), cache_key("abd", "cpu", 2, "1.0"), cache_key("abc", "cuda", 2, "1.0"),
            cache_key("abc", "cpu", 1, "1.0"), cache_key("abc", "cpu", 2, "1.1")}
    assert len(keys) == 5 and cache_key("abc", "cpu", 2, "1.0") == cache_key("abc", "cpu", 2, "1.0")


def test_a_second_engine_reads_the_table_the_first_one_timed(tiny_target_only_artifact):
    first = Engine.load(tiny_target_only_artifact, provider="cpu", threads=1)
    first.generate(PROMPT, AUTO)
    assert first.call_costs_source == "timed" and first.calibration_seconds > 0
    assert first.call_costs_cache_file is not None and first.call_costs_cache_file.parent == cache_dir()
    second = Engine.load(tiny_target_only_artifact, provider="cpu", threads=1)
    reply = second.generate(PROMPT, AUTO)
    assert second.call_costs_source == "cache" and second.calibration_seconds == 0.0
    assert second.target_call_costs.prior == first.target_call_costs.prior
    assert reply.token_ids == first.generate(PROMPT, AUTO).token_ids
    other_threads = Engine.load(tiny_target_only_artifact, provider="cpu", threads=2)
    other_threads.generate(PROMPT, AUTO)
    assert other_threads.call_costs_source == "timed"  # another thread count is another machine


def test_cache_off_or_unwritable_only_costs_the_timing(tiny_target_only_artifact, tmp_path, monkeypatch):
    monkeypatch.setenv(NO_CACHE_ENV, "1")
    assert cache_dir() is None
    for _ in range(2):
        engine = Engine.load(tiny_target_only_artifact, provider="cpu")
        engine.generate(PROMPT, AUTO)
        assert engine.call_costs_source == "timed"
    monkeypatch.delenv(NO_CACHE_ENV)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(CACHE_DIR_ENV, str(blocker / "cache"))  # mkdir under a file fails
    engine = Engine.load(tiny_target_only_artifact, provider="cpu")
    assert engine.generate(PROMPT, AUTO).token_ids
    assert engine.call_costs_source == "timed" and engine.call_costs_cache_file is None


def test_a_tuned_artifact_never_reads_the_cache(tiny_target_only_artifact, tmp_path):
    import shutil

    from specdec.models.manifest import update_runtime_defaults

    artifact = tmp_path / "art"
    shutil.copytree(tiny_target_only_artifact, artifact)
    update_runtime_defaults(artifact, {"target_call_costs": [1.0, 1.1, 1.15, 1.2, 1.3]})
    engine = Engine.load(artifact, provider="cpu")
    assert engine.call_costs_source == "tune"
    engine.generate(PROMPT, AUTO)
    assert engine.call_costs_source == "tune" and not list(cache_dir().glob("*.json"))
