"""specdec distill on a tiny target: the tap, the data's prompts, training, the artifact it writes."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from specdec.exporter.distill.prompts import HELDOUT_TOPICS, TOPICS, heldout_prompts, training_prompts

ROOT = Path(__file__).resolve().parents[2]


def _shingles(text: str, n: int = 5) -> set[tuple[str, ...]]:
    words = re.findall(r"[a-z0-9']+", text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def _bench_and_test_prompts(open_only: bool = False) -> list[str]:
    prompts = []
    for path in sorted((ROOT / "specdec" / "data").glob("prompts*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        prompts += [row["prompt"] for row in rows if not open_only or row.get("group") == "open"]
    from tests.runtime.test_exactness import PROMPTS

    if open_only:
        return prompts + PROMPTS
    return prompts + PROMPTS + [ROOT.joinpath("Makefile").read_text().split("PROMPT ?= ")[1].splitlines()[0]]


def test_training_prompts_are_disjoint_from_bench_and_test_prompts():
    others = _bench_and_test_prompts()
    assert len(others) >= 18
    ours = training_prompts(100_000, seed=0) + heldout_prompts(1000, seed=0)
    assert len(ours) == len(set(ours)) > 4000
    other_shingles = set().union(*(_shingles(p) for p in others))
    overlapping = [p for p in ours if _shingles(p) & other_shingles or p in others]
    assert not overlapping, overlapping[:5]
    # Held-out topics are unseen in training, and no open bench or test prompt is about a topic (words of a
    # topic do occur inside the grounded prompts' passages: "sharks", "sleep"; their phrases do not, above).
    assert not set(TOPICS) & set(HELDOUT_TOPICS)
    for topic in TOPICS + HELDOUT_TOPICS:
        assert not any(re.search(rf"\b{re.escape(topic.lower())}\b", p.lower())
                       for p in _bench_and_test_prompts(open_only=True)), topic


def test_bench_prompts_ship_with_the_package():
    from specdec.exporter.distill.prompts import bench_prompts

    rows = bench_prompts()
    assert len(rows) >= 18 and {group for group, _ in rows} == {"open", "grounded"}
    assert {prompt for _, prompt in rows} <= set(_bench_and_test_prompts())


def test_self_written_user_turns_are_filtered():
    from specdec.exporter.distill.prompts import keep_user_turns

    avoid = [("open", "Explain why the sky is blue to a ten year old."),
             ("grounded", "Rewrite the following passage in simpler English, keeping every fact: ...")]
    seen = {"what is a good name for a cat"}
    turns = ["How do I fix a flat tire on my bike?",
             "  How do I fix a flat tire on my BIKE  ",  # a repeat, up to case and spacing
             "What is a good name for a cat?",  # kept by an earlier chunk
             "Hi!", "x" * 401, "ok ok",  # too short, too long, too few words
             "Why is the sky blue during the day?",  # a bench prompt's topic (sky, blue)
             "Please rewrite the following passage in simpler words.",  # a bench prompt's 4-word phrase
             "Tell me something about the rainbows in Hawaii.",  # a held-out topic
             "Can you suggest a recipe for lentil soup?"]
    kept = keep_user_turns(turns, avoid, ("rainbows",), seen)
    assert kept == ["How do I fix a flat tire on my bike?", "Can you suggest a recipe for lentil soup?"]
    assert "can you suggest a recipe for lentil soup" in seen
    assert keep_user_turns(kept, avoid, (), seen) == []  # now seen


def test_the_target_writes_user_turns_deterministically(tiny_sources, tmp_path):
    from specdec.exporter.distill.data import user_turn_prefix, write_user_turns
    from specdec.exporter.sources import load_source

    loaded = load_source(str(tiny_sources["llama"][0]), tmp_path)
    prefix = loaded.tokenizer.decode(user_turn_prefix(loaded.tokenizer))
    opened = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], tokenize=False)
    assert opened.startswith(prefix) and opened[len(prefix):].startswith("Hello")
    eos = [loaded.tokenizer.eos_token_id]
    first = write_user_turns(loaded.model, loaded.tokenizer, 6, eos, seed=3, max_new_tokens=12)
    assert len(first) == 6 and first == write_user_turns(loaded.model, loaded.tokenizer, 6, eos, seed=3,
                                                         max_new_tokens=12)


def test_data_alternates_templated_and_self_written_chunks(tiny_sources, tiny_target_only_artifact, tmp_path):
    """Chunks 0-1 templated, 2-3 user turns the target writes (share 0.5); templates fill what the filter drops."""
    import time

    from specdec.exporter.distill.data import load_examples
    from specdec.exporter.distill.pipeline import DistillConfig, _make_data
    from specdec.exporter.sources import load_source
    from specdec.models.manifest import load_manifest

    loaded = load_source(str(tiny_sources["llama"][0]), tmp_path / "src")
    config = DistillConfig(artifact=tiny_target_only_artifact, prompts=16, generate_batch=4, heldout=2,
                           max_new_tokens=8)
    meta = _make_data(config, load_manifest(tiny_target_only_artifact), loaded.model, loaded.tokenizer,
                      time.monotonic() + 600, tmp_path, progress=lambda message: None)
    assert meta["prompts"] == 16 and len(load_examples(tmp_path / "train.npz")) == 16
    assert meta["self_written_turns_drafted"] == 8 and 0 <= meta["self_written_prompts"] <= 8
    assert meta["greedy_answers"] == meta["sampled_answers"] == 8


def test_prompts_are_deterministic_for_a_seed():
    assert training_prompts(50, seed=3) == training_prompts(50, seed=3) != training_prompts(50, seed=4)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_hidden_tap_is_the_lm_head_input(tiny_sources, tiny_artifacts, tmp_path, family):
    """The tapped output equals PyTorch's last hidden state (after the final norm), and logits = hidden @ W."""
    import torch
    from dataclasses import replace
    from transformers import AutoModelForCausalLM

    from specdec.exporter.distill.hidden_tap import HIDDEN_OUTPUT, add_hidden_output
    from specdec.models.manifest import load_manifest
    from specdec.runtime.session import ModelSession

    art = tmp_path / "art"
    shutil.copytree(tiny_artifacts[family], art)
    manifest = load_manifest(art)
    _, row_start = add_hidden_output(art / manifest.target.graph_file, art / "target" / "tapped.onnx")
    spec = replace(manifest.target, files=["target/tapped.onnx"] + manifest.target.files[1:], hidden_name=HIDDEN_OUTPUT,
                   head_row_start_name=row_start)
    session = ModelSession(art, spec, "cpu", threads=1)
    model = AutoModelForCausalLM.from_pretrained(tiny_sources[family][0]).eval()
    ids = [5, 17, 42, 9, 100, 7]
    cache = session.new_cache(16)
    logits, hidden = session.forward(cache, ids[:4], hidden=True)
    step_logits, step_hidden = session.forward(cache, ids[4:], hidden=True)  # on a cache: the verify path
    with torch.no_grad():
        reference = getattr(model, model.base_model_prefix)(input_ids=torch.tensor([ids])).last_hidden_state[0].numpy()
    weight = model.get_output_embeddings().weight.detach().numpy()
    assert hidden.shape == (4, reference.shape[1]) and step_hidden.shape == (2, reference.shape[1])
    assert np.abs(np.concatenate([hidden, step_hidden]) - reference).max() < 1e-4
    assert np.abs(logits - hidden @ weight.T[:, : logits.shape[1]]).max() < 1e-3
    if session.shared_kv:  # the verify call wrote its hidden rows into a kept buffer, its width learnt from the first
        assert (HIDDEN_OUTPUT, (1, 2, reference.shape[1])) in cache.bindings[(True, False)]._outputs


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_hidden_call_computes_only_the_logits_rows_asked_for(tiny_artifacts, tmp_path, family):
    """The tapped graph's LM head reads from its row-start input on: a prefill keeping one row of
    logits still returns every position's feature, and the same logits as a call keeping all."""
    from dataclasses import replace

    from specdec.exporter.distill.hidden_tap import HEAD_ROW_START, HIDDEN_OUTPUT, add_hidden_output
    from specdec.models.manifest import load_manifest
    from specdec.runtime.session import ModelSession

    art = tmp_path / "art"
    shutil.copytree(tiny_artifacts[family], art)
    manifest = load_manifest(art)
    assert add_hidden_output(art / manifest.target.graph_file, art / "target" / "tapped.onnx")[1] == HEAD_ROW_START
    spec = replace(manifest.target, files=["target/tapped.onnx"] + manifest.target.files[1:], hidden_name=HIDDEN_OUTPUT,
                   head_row_start_name=HEAD_ROW_START)
    session = ModelSession(art, spec, "cpu", threads=1)
    ids = list(range(5, 29))
    every, every_hidden = session.forward(session.new_cache(32), ids, hidden=True)
    for rows in (1, 3):
        cache = session.new_cache(32)
        kept, hidden = session.forward(cache, ids, logits_rows=rows, hidden=True)
        np.testing.assert_allclose(kept, every[-rows:], rtol=0, atol=1e-5)
        np.testing.assert_array_equal(hidden, every_hidden)
        if session.shared_kv:  # the head's output has the kept rows only (a concat graph allocates it per call)
            call = cache.bindings[(True, False)]
            assert call.io.get_outputs()[call._order(spec.logits_name)].shape()[1] == rows


def test_hidden_tap_with_layers_holds_their_normed_inputs(tiny_sources, tiny_artifacts, tmp_path):
    """With layers, the output is [last feature, normed input of each layer] (PyTorch's, layer by layer);
    tapping the tapped graph again replaces the tap."""
    import onnx
    import torch
    from dataclasses import replace
    from transformers import AutoModelForCausalLM

    from specdec.exporter.distill.data import layer_inputs
    from specdec.exporter.distill.hidden_tap import HIDDEN_OUTPUT, add_hidden_output
    from specdec.models.manifest import load_manifest
    from specdec.runtime.session import ModelSession

    art = tmp_path / "art"
    shutil.copytree(tiny_artifacts["llama"], art)
    manifest = load_manifest(art)
    model = AutoModelForCausalLM.from_pretrained(tiny_sources["llama"][0]).eval()
    ids = [5, 17, 42, 9, 100, 7]
    with torch.no_grad():
        out = model.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        last = out.last_hidden_state[0].numpy()
        lower = layer_inputs(model, out.hidden_states, (1, 0))[0].numpy()
    _, row_start = add_hidden_output(art / manifest.target.graph_file, art / "target" / "tapped.onnx", layers=(1, 0))
    assert add_hidden_output(art / "target" / "tapped.onnx", art / "target" / "again.onnx")[1] is None  # has it
    expected = {"tapped.onnx": np.concatenate([last, lower], axis=1), "again.onnx": last}
    for name, reference in expected.items():
        graph = onnx.load(str(art / "target" / name), load_external_data=False)
        assert [o.name for o in graph.graph.output].count(HIDDEN_OUTPUT) == 1
        spec = replace(manifest.target, files=[f"target/{name}"] + manifest.target.files[1:], hidden_name=HIDDEN_OUTPUT,
                       head_row_start_name=row_start)
        session = ModelSession(art, spec, "cpu", threads=1)
        cache = session.new_cache(16)
        _, hidden = session.forward(cache, ids[:4], hidden=True)
        _, step_hidden = session.forward(cache, ids[4:], hidden=True)
        assert np.abs(np.concatenate([hidden, step_hidden]) - reference).max() < 1e-4, name
    # Layer 1's input norm differs from layer 0's: the taps are not one tensor twice.
    assert np.abs(lower[:, :64] - lower[:, 64:]).max() > 1e-2


def test_distill_writes_a_head_the_manifest_describes(distilled_artifact):
    from specdec.models.manifest import load_manifest

    manifest = load_manifest(distilled_artifact)  # every sha256 checked, the head's files included
    head = manifest.feature_draft
    assert head.kind == "eagle"
    runtime = head.training["runtime_heldout"]
    # The head is the default drafter exactly when Theorem 3.8 expects it to pay.
    assert (manifest.runtime_defaults.drafter == "eagle") == (runtime["expected_speedup"] > 1.05), runtime
    if manifest.runtime_defaults.drafter == "eagle":  # ... at the K it found best
        assert manifest.runtime_defaults.num_draft_tokens == runtime["best_k"], manifest.runtime_defaults
    assert 0 <= runtime["best_k"] <= 16 and runtime["cost_ratio"] > 0
    assert manifest.target.hidden_name and head.target_graph_sha256 == manifest.target.sha256[manifest.target.graph_file]
    record = head.training
    assert record["seed"] == 0 and record["steps"] == 60 and record["data"]["prompts"] == 16
    assert record["settings"]["compute_dtype"] in ("bfloat16", "float32")  # "auto" resolved, as it ran
    # The head ships with int8 MatMul weights (the default), every constant-weight MatMul included.
    assert record["head_weights"]["weights"] == "int8" and record["head_weights"]["constant_matmuls_left_fp32"] == 0
    import onnx

    for graph in (head.graph_file, head.ragged_file):  # the batch engine's ragged-rows head as well
        assert "MatMulNBits" in {node.op_type for node in onnx.load(str(distilled_artifact / graph)).graph.node}
    assert record["data"]["answer_tokens"] > 0 and record["heldout_acceptance"]["positions"] > 0
    assert record["data"]["self_written_turns_drafted"] == 0  # one chunk of 16 prompts: templates only
    assert manifest.validation["target_hidden"]["max_hidden_diff"] < 1e-3
    # Only the files the manifest names are left: the untapped graph is gone.
    listed = set(manifest.tokenizer.files) | set(head.files) | {head.ragged_file} | {
        f for g in manifest.graphs() for f in g.files} | {g.ragged_file for g in manifest.graphs() if g.ragged_file}
    on_disk = {str(p.relative_to(distilled_artifact)) for p in distilled_artifact.rglob("*") if p.is_file()}
    assert on_disk - listed == {"specdec.json"}


def test_distill_with_feature_layers_taps_them_and_records_them(distilled_layers_artifact, distilled_artifact,
                                                                tmp_path):
    """--feature-layers: the tapped graph holds them (validated against PyTorch), the head reads that width,
    the manifest says which; resuming with other layers re-reads the features over the same conversations."""
    import onnx
    from dataclasses import replace as copy_with

    from specdec.exporter.distill.pipeline import DistillConfig, run_distill, work_dir
    from specdec.models.manifest import load_manifest
    from tests.distill.conftest import TINY_DISTILL

    manifest = load_manifest(distilled_layers_artifact)
    target, head = manifest.target, manifest.feature_draft
    assert target.hidden_layers == [0, 1] and target.graph_file.endswith("model.hidden-0-1.onnx")
    assert manifest.validation["target_hidden"]["max_hidden_diff"] < 1e-3
    width = {i.name: i.type.tensor_type.shape.dim[-1].dim_value
             for i in onnx.load(str(distilled_layers_artifact / head.graph_file)).graph.input}["hidden"]
    assert width == 3 * head.hidden_size
    record = head.training
    assert record["data"]["feature_layers"] == [0, 1] and record["draft_config"]["extra_layers"] == [0, 1]
    assert "--feature-layers 0,1" in record["reproduce"]
    assert record["train_fit"]["first"] > record["untrained_train_fit"]["first"] + 0.1, record
    art = tmp_path / "art"
    shutil.copytree(distilled_artifact, art)
    shutil.copytree(work_dir(distilled_artifact), work_dir(art))
    config = copy_with(DistillConfig(artifact=art, **TINY_DISTILL), resume=True, feature_layers=(1,), steps=3,
                       eval_prompts=0)
    resumed = run_distill(config, progress=lambda message: None)
    record = resumed.feature_draft.training
    # Same conversations, new features, a fresh head (the old checkpoint's input was narrower).
    assert record["data"]["feature_layers"] == [1] and record["data"]["prompts"] == 16 and record["steps"] == 3
    assert resumed.target.hidden_layers == [1] and resumed.target.graph_file.endswith("model.hidden-1.onnx")
    on_disk = {p.name for p in (art / "target").glob("*.onnx")}
    assert on_disk == {"model.hidden-1.onnx", "ragged.hidden-1.onnx"}, on_disk  # the earlier tapped graphs are gone


def test_trained_head_beats_the_untrained_one(distilled_artifact):
    """On the tiny random target the head fits its data far better after training; held-out is not
    required to improve here (a random target has little structure to generalise), only on SmolLM2."""
    from specdec.models.manifest import load_manifest

    record = load_manifest(distilled_artifact).feature_draft.training
    assert record["train_fit"]["first"] > record["untrained_train_fit"]["first"] + 0.1, record


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_training_is_deterministic_for_a_seed(compute_dtype):
    """Same seed, data and step count: identical weights (the batch order comes from the seed and step),
    in fp32 and under bf16 autocast."""
    import torch

    from specdec.exporter.distill.data import Example
    from specdec.exporter.distill.draft_model import DraftConfig, DraftHead
    from specdec.exporter.distill.train import TrainSettings, TrainState, train_head

    rng = np.random.default_rng(0)
    examples = [Example(rng.integers(0, 50, 20), rng.standard_normal((20, 16)).astype(np.float16),
                        rng.integers(0, 50, 20), 5, False) for _ in range(6)]
    config = DraftConfig(16, 2, 1, 8, 32, 10000.0, 1e-6, 50, 40)

    def run(seed):
        torch.manual_seed(seed)
        head = DraftHead(config, torch.arange(40))
        train_head(head, examples, examples[:2], TrainSettings(batch_size=3, compute_dtype=compute_dtype),
                   TrainState(), seed, None, 8)
        return torch.cat([p.detach().flatten() for p in head.parameters()])

    assert torch.equal(run(1), run(1))
    assert not torch.equal(run(1), run(2))


def test_learning_rate_warms_up_then_falls_along_a_cosine_to_its_floor():
    from specdec.exporter.distill.train import TrainSettings, learning_rate

    from specdec.exporter.distill.train import PLAN_AFTER_STEPS as PLAN

    cosine = TrainSettings(lr=1e-3, warmup_steps=10, schedule="cosine", final_lr_share=0.1)
    assert learning_rate(cosine, 0, 0, PLAN + 100) == pytest.approx(1e-4)  # warmup: (step + 1) / 10
    assert learning_rate(cosine, PLAN, 0, PLAN + 100) == pytest.approx(1e-3)  # the cosine starts once planned
    assert learning_rate(cosine, PLAN + 50, 0, PLAN + 100) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))  # halfway
    assert learning_rate(cosine, PLAN + 100, 0, PLAN + 100) == pytest.approx(1e-4)
    assert learning_rate(cosine, PLAN + 300, 0, PLAN + 100) == pytest.approx(1e-4)  # past the plan: the floor
    assert learning_rate(cosine, PLAN + 50, 0, None) == pytest.approx(1e-3)  # no plan: constant
    # A resumed run (from step 200) does not warm up again and decays over its own plan.
    assert learning_rate(cosine, 200, 200, 300 + PLAN) == pytest.approx(1e-3)
    assert learning_rate(cosine, 250 + PLAN, 200, 300 + PLAN) == pytest.approx(1e-3 * 0.55)
    constant = TrainSettings(lr=1e-3, warmup_steps=10, schedule="constant")
    assert learning_rate(constant, PLAN + 50, 0, PLAN + 100) == pytest.approx(1e-3)


def test_a_deadline_run_plans_its_last_step_and_max_steps_repeats_it(monkeypatch):
    """Under a deadline alone the run times its first steps and stops at the step it planned from them;
    the same seed with that many steps gives the same weights."""
    import types

    import torch

    from specdec.exporter.distill import train

    clock = iter(np.arange(0, 1e6, 0.01))  # every reading 10 ms later: the plan does not depend on the machine
    monkeypatch.setattr(train, "time", types.SimpleNamespace(monotonic=lambda: float(next(clock))))

    from specdec.exporter.distill.data import Example
    from specdec.exporter.distill.draft_model import DraftConfig, DraftHead
    from specdec.exporter.distill.train import PLAN_AFTER_STEPS, TrainSettings, TrainState, planned_steps, train_head

    assert planned_steps(30, 30, 3.0, 10.0) == 30 + int(0.95 * 100)
    rng = np.random.default_rng(0)
    examples = [Example(rng.integers(0, 50, 20), rng.standard_normal((20, 16)).astype(np.float16),
                        rng.integers(0, 50, 20), 5, False) for _ in range(6)]
    config = DraftConfig(16, 2, 1, 8, 32, 10000.0, 1e-6, 50, 40)
    settings = TrainSettings(batch_size=3, compute_dtype="float32", schedule="cosine", warmup_steps=5)

    def run(deadline, steps):
        torch.manual_seed(0)
        head = DraftHead(config, torch.arange(40))
        state, _ = train_head(head, examples, examples[:2], settings, TrainState(), 0, deadline, steps)
        return state, torch.cat([p.detach().flatten() for p in head.parameters()])

    planned, weights = run(train.time.monotonic() + 10.0, None)
    assert planned.planned_steps > PLAN_AFTER_STEPS and planned.step == planned.planned_steps
    assert len(planned.plan_history) == 1  # a steady rate: planned once
    repeated, again = run(None, planned.step)
    assert repeated.planned_steps == planned.step and torch.equal(weights, again)


def test_a_deadline_run_replans_as_the_machine_speeds_up_or_slows_down(monkeypatch):
    """A run whose steps get faster early moves its last step out (and so uses its time); one that slows late in
    its cosine pulls it in (and so still ends its cosine by the deadline); the plans are recorded."""
    import types

    import torch

    from specdec.exporter.distill import train
    from specdec.exporter.distill.data import Example
    from specdec.exporter.distill.draft_model import DraftConfig, DraftHead
    from specdec.exporter.distill.train import PLAN_AFTER_STEPS, TrainSettings, TrainState, train_head

    def run(seconds_per_reading):
        clock = {"n": 0, "now": 0.0}

        def monotonic():
            clock["now"] += seconds_per_reading(clock["n"])
            clock["n"] += 1
            return clock["now"]

        monkeypatch.setattr(train, "time", types.SimpleNamespace(monotonic=monotonic))
        rng = np.random.default_rng(0)
        examples = [Example(rng.integers(0, 50, 20), rng.standard_normal((20, 16)).astype(np.float16),
                            rng.integers(0, 50, 20), 5, False) for _ in range(6)]
        config = DraftConfig(16, 2, 1, 8, 32, 10000.0, 1e-6, 50, 40)
        settings = TrainSettings(batch_size=3, compute_dtype="float32", schedule="cosine", warmup_steps=5,
                                 eval_every_seconds=0.5)
        torch.manual_seed(0)
        state, _ = train_head(DraftHead(config, torch.arange(40)), examples, examples[:2], settings, TrainState(),
                              0, 10.0, None)
        return state, train.time.monotonic()

    # 10 ms per clock reading for the first 300 readings, then 4 ms: the box speeds up early.
    state, _ = run(lambda n: 0.01 if n < 300 else 0.004)
    first_plan = state.plan_history[0]
    assert first_plan[0] == PLAN_AFTER_STEPS and len(state.plan_history) >= 2
    assert state.planned_steps > 1.5 * first_plan[1]  # the later, faster steps fit more of them
    assert state.step == state.planned_steps  # ...and the run still ends on its plan, before the deadline
    assert all(later[1] > earlier[1] for earlier, later in zip(state.plan_history, state.plan_history[1:]))
    # 4 ms, then 10 ms from reading 1,500 on: it slows late in its cosine and pulls its last step in.
    state, ended = run(lambda n: 0.004 if n < 1500 else 0.01)
    assert state.plan_history[-1][1] < state.plan_history[0][1] and state.plan_history[-1][0] > 0.5 * state.step
    assert state.step == state.planned_steps and ended < 10.0  # the cosine ends by the deadline


def test_resume_trains_on_from_the_checkpoint(distilled_artifact, tmp_path):
    """--resume reuses the data and checkpoint beside the artifact: the step count goes on from 60."""
    from dataclasses import replace as copy_with

    from specdec.exporter.distill.pipeline import DistillConfig, run_distill, work_dir
    from tests.distill.conftest import TINY_DISTILL

    art = tmp_path / "art"
    shutil.copytree(distilled_artifact, art)
    shutil.copytree(work_dir(distilled_artifact), work_dir(art))
    config = copy_with(DistillConfig(artifact=art, **TINY_DISTILL), resume=True, steps=64, eval_prompts=0)
    record = run_distill(config, progress=lambda message: None).feature_draft.training
    assert record["steps"] == 64 and record["data"]["prompts"] == 16


def test_resume_after_the_data_phase_trains_from_the_start(distilled_artifact, tmp_path):
    """A run stopped after its data was written (no checkpoint yet) resumes on that data from step 0."""
    from dataclasses import replace as copy_with

    from specdec.exporter.distill.pipeline import DistillConfig, run_distill, work_dir
    from tests.distill.conftest import TINY_DISTILL

    art = tmp_path / "art"
    shutil.copytree(distilled_artifact, art)
    shutil.copytree(work_dir(distilled_artifact), work_dir(art))
    (work_dir(art) / "checkpoint.pt").unlink()
    config = copy_with(DistillConfig(artifact=art, **TINY_DISTILL), resume=True, steps=3, eval_prompts=0)
    record = run_distill(config, progress=lambda message: None).feature_draft.training
    assert record["steps"] == 3 and record["data"]["prompts"] == 16


@pytest.mark.parametrize("args, message", [
    (["--minutes", "0"], "--minutes must be > 0"),
    (["--resume"], "nothing to resume"),
    (["--feature-layers", "0,2"], "--feature-layers must name distinct layers 0..1"),
    (["--feature-layers", "1,1"], "--feature-layers must name distinct layers 0..1"),
])
def test_bad_distill_runs_are_refused_in_one_line(tiny_target_only_artifact, tmp_path, args, message):
    from click.testing import CliRunner

    from specdec.cli.main import main

    art = tmp_path / "art"
    shutil.copytree(tiny_target_only_artifact, art)
    result = CliRunner().invoke(main, ["distill", str(art), *args])
    assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert sorted(p.name for p in art.iterdir()) == sorted(p.name for p in tiny_target_only_artifact.iterdir())


def test_grouped_decode_attention_matches_transformers_sdpa():
    """The data generator's decode-step attention (query groups as rows) gives transformers' sdpa logits, padding included."""
    import copy

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec.exporter.distill.data import use_grouped_attention

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64)
    reference = LlamaForCausalLM(config).eval()
    reference.config._attn_implementation = "sdpa"
    grouped = copy.deepcopy(reference)
    use_grouped_attention(grouped)
    ids = torch.randint(3, 128, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, :4] = 0  # left padding, as batched generation pads
    with torch.no_grad():
        outs = [m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                           output_logits=True, return_dict_in_generate=True) for m in (reference, grouped)]
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    for a, b in zip(outs[0].logits, outs[1].logits):  # every decode step, not only the prefill
        assert torch.allclose(a, b, atol=1e-4)


def test_loaded_examples_share_one_copy_of_the_data(tmp_path):
    """load_examples returns views of one array per field (a copy per example ran SmolLM2's 1,088 examples out of memory)."""
    from specdec.exporter.distill.data import Example, load_examples, save_examples

    rng = np.random.default_rng(0)
    examples = [Example(ids=rng.integers(0, 50, n), features=rng.standard_normal((n, 4)).astype(np.float16),
                        greedy_next=rng.integers(0, 50, n), answer_start=2, sampled=bool(n % 2)) for n in (5, 7, 3)]
    save_examples(tmp_path / "x.npz", examples)
    loaded = load_examples(tmp_path / "x.npz")
    for a, b in zip(examples, loaded):
        assert np.array_equal(a.ids, b.ids) and np.array_equal(a.features, b.features)
        assert np.array_equal(a.greedy_next, b.greedy_next) and (a.answer_start, a.sampled) == (b.answer_start, b.sampled)
    assert loaded[0].features.base is loaded[2].features.base is not None


def test_curve_plot_overlays_runs_and_refuses_an_artifact_without_a_head(distilled_artifact,
                                                                          tiny_target_only_artifact, tmp_path):
    from click.testing import CliRunner

    from specdec.benchmarks.distill_bench import main

    png = tmp_path / "curve.png"
    result = CliRunner().invoke(main, [str(distilled_artifact), "--curve", str(png), "--compare", str(distilled_artifact)])
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    result = CliRunner().invoke(main, [str(distilled_artifact), "--curve", str(png), "--compare",
                                       str(tiny_target_only_artifact)])
    assert result.exit_code != 0 and "has no trained draft head" in result.output


def test_exported_head_gives_the_last_pairs_logits_and_every_pairs_features(tmp_path):
    """A draft call catching up on n committed pairs reads one row of logits: the graph computes that row only,
    equal to PyTorch's, while its features and present cache cover all n pairs."""
    import onnxruntime as ort
    import torch

    from specdec.exporter.distill.draft_model import DraftConfig, DraftHead, export_draft_onnx

    torch.manual_seed(0)
    head = DraftHead(DraftConfig(16, 2, 1, 8, 32, 10000.0, 1e-6, 50, 40), torch.arange(40)).eval()
    export_draft_onnx(head, tmp_path / "draft.onnx")
    rng = np.random.default_rng(0)
    hidden, ids = rng.standard_normal((1, 6, 16)).astype(np.float32), rng.integers(0, 50, (1, 6))
    positions, past = np.arange(3, 9)[None], rng.standard_normal((1, 1, 3, 8)).astype(np.float32)
    session = ort.InferenceSession(str(tmp_path / "draft.onnx"), providers=["CPUExecutionProvider"])
    logits, features, key, _ = session.run(None, {"hidden": hidden, "input_ids": ids, "position_ids": positions,
                                                  "past_key": past, "past_value": past})
    with torch.no_grad():
        every, torch_features, _, _ = head(*(torch.from_numpy(a) for a in (hidden, ids, positions, past, past)))
    assert logits.shape == (1, 1, 40) and features.shape == (1, 6, 16) and key.shape == (1, 1, 9, 8)
    np.testing.assert_allclose(logits[0, 0], every[0, -1].numpy(), atol=1e-5)
    np.testing.assert_allclose(features, torch_features.numpy(), atol=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_features_kept_from_decoding_equal_a_teacher_forced_pass(temperature):
    """decode_examples keeps the features, lower-layer inputs and greedy choices that generate's own forward passes
    computed (left-padded prefill, then one position per step); a teacher-forced pass over the same conversations
    (features_of, right-padded) reads the same, so training data needs no second pass."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec.exporter.distill.data import decode_examples, features_of

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=96)
    model = LlamaForCausalLM(config).eval()
    model.config._attn_implementation = "sdpa"

    class Words:  # a tokenizer without a chat template: a prompt is its words' ids
        chat_template = None
        pad_token_id = 0

        def __call__(self, text):
            return {"input_ids": [int(w) for w in text.split()]}

    prompts = ["5 9 17", "40 41 42 43 44 45 46", "99", "7 7 8 8"]
    eos = [3]
    examples = decode_examples(model, Words(), prompts, eos, max_new_tokens=12, temperature=temperature, seed=1,
                               layers=(0, 2))
    longest = max(len(e.ids) - e.answer_start for e in examples)
    assert longest == 11  # some answer ran to max_new_tokens and lost its never-fed last token
    conversations = [(list(e.ids[: e.answer_start]), list(e.ids[e.answer_start:])) for e in examples]
    reference = features_of(model, conversations, sampled=temperature > 0, layers=(0, 2))
    for got, want, prompt in zip(examples, reference, prompts):
        assert got.ids[: got.answer_start].tolist() == [int(w) for w in prompt.split()]
        assert np.array_equal(got.ids, want.ids) and got.sampled == want.sampled
        assert np.abs(got.features.astype(np.float32) - want.features.astype(np.float32)).max() < 2e-3
        assert np.abs(got.layer_features.astype(np.float32) - want.layer_features.astype(np.float32)).max() < 2e-3
        assert np.array_equal(got.greedy_next, want.greedy_next)
        if temperature == 0:  # a greedy answer is its own greedy choices
            assert got.ids[got.answer_start:].tolist() == got.greedy_next[got.answer_start - 1:-1].tolist()


def test_the_data_sampler_draws_from_the_tempered_distribution():
    """InverseCdfSampler (the training answers' sampler) draws each row from softmax(logits / T): a chi-square test
    per row over 20,000 draws, ids of probability 0 never drawn, the same draws for the same seed."""
    import torch

    from specdec.exporter.distill.data import InverseCdfSampler
    from tests.runtime.helpers import chi2_fits

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, float("-inf"), 0.5], [0.0, 0.0, 3.0, float("-inf"), -2.0, 1.0]])
    draws = 20_000
    sampler = InverseCdfSampler(0.7, seed=3, device="cpu")
    counts = np.zeros(logits.shape, np.int64)
    for _ in range(draws // 100):
        batch = logits.repeat_interleave(100, dim=0)
        out = sampler(None, batch)
        assert torch.isinf(out).sum(-1).eq(logits.shape[1] - 1).all()  # one id left standing per row
        chosen = out.argmax(-1).view(2, 100).numpy()
        for row in range(2):
            np.add.at(counts[row], chosen[row], 1)
    probs = torch.softmax(logits / 0.7, dim=-1).numpy()
    for row in range(2):
        chi2, critical = chi2_fits(counts[row], probs[row])  # also fails on a draw of probability 0
        assert chi2 < critical
    again = InverseCdfSampler(0.7, seed=3, device="cpu")
    first = InverseCdfSampler(0.7, seed=3, device="cpu")
    assert torch.equal(again(None, logits.repeat(50, 1)), first(None, logits.repeat(50, 1)))
