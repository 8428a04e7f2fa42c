"""The CUDA machine's check script, run here on the CPU provider: its checks pass, and can fail."""

import json

import numpy as np

import pytest

from specdec.certify import device_check
from specdec.runtime.engine import Engine


def test_checks_pass_on_the_cpu_for_every_drafter(tiny_artifacts):
    check = device_check.check_artifact(tiny_artifacts["llama"], "cpu", max_new_tokens=12)
    assert check.failures == []
    assert check.target_provider == check.draft_provider == "CPUExecutionProvider"
    assert check.kv_device.lower() == "cpu"
    # per prompt: target-only, then n-gram and model drafter at K=4 and auto
    assert len(check.runs) == len(device_check.PROMPTS) * 5
    assert all(run["greedy_equals_target_only"] for run in check.runs if run["drafter"] != "none")
    # the proofs ran: every graph profiled and logged, the same provider's logits 0 steps apart
    assert sorted(check.placement) == ["draft/model", "draft/ragged", "target/model", "target/ragged"]
    assert all(p["log_placements"] == {"CPUExecutionProvider": p["log_placements"]["CPUExecutionProvider"]}
               and p["tolerated"] == [] for p in check.placement.values())
    assert check.logits["target"] == {"max_steps": 0.0, "bound_steps": 0.25} and check.kv_addresses_stable
    assert set(check.throughput) == {"none K=0", "ngram K=4", "ngram K=auto", "model K=4", "model K=auto"}
    # the batch engine ran every prompt with every drafter at once, each text its target-only one
    assert check.batch["requests"] == 3 * len(device_check.PROMPTS) and check.batch["mismatches"] == []


def test_work_off_the_expected_provider_fails_from_the_profile(tiny_artifacts, monkeypatch):
    """The real profile of a CPU run, read as if CUDA had been asked: every float node is named."""
    monkeypatch.setitem(device_check.EXPECTED_PROVIDER, "cpu", "CUDAExecutionProvider")
    check = device_check.ArtifactCheck("gpt2", "cpu")
    device_check.check_proofs(check, tiny_artifacts["gpt2"], "cpu", tiny_artifacts["gpt2"].parent)
    roles = {failure.split(":")[0] for failure in check.failures}
    assert roles == {"target/model", "target/kv_slice", "draft/model", "draft/kv_slice"}  # rollback graphs too
    assert any("MatMul" in f and "ran on CPUExecutionProvider (float" in f for f in check.failures)
    shared = device_check.ArtifactCheck("llama", "cpu")  # shared KV buffers: the batch engine's graphs too
    device_check.check_proofs(shared, tiny_artifacts["llama"], "cpu", tiny_artifacts["llama"].parent)
    roles = {failure.split(":")[0] for failure in shared.failures}
    assert roles == {"target/model", "target/ragged", "draft/model", "draft/ragged"}
    assert any(f.startswith("target/ragged") and "GroupQueryAttention" in f for f in shared.failures)


def test_kv_buffers_that_move_between_steps_fail(tiny_artifacts, monkeypatch):
    from specdec.runtime.session import ModelSession

    real_new_cache = ModelSession.new_cache
    monkeypatch.setattr(ModelSession, "new_cache", lambda self, capacity=None: real_new_cache(self, 2))  # grows
    check = device_check.ArtifactCheck("llama", "cpu")
    device_check.check_proofs(check, tiny_artifacts["llama"], "cpu", tiny_artifacts["llama"].parent)
    assert check.kv_addresses_stable is False
    moved = [f for f in check.failures if "moved on the device between steps" in f]
    assert len(moved) == 2 and moved[0].startswith("target KV buffers [0, 1,") and moved[1].startswith("draft")


def test_logits_beyond_the_bound_fail(tiny_artifacts, monkeypatch):
    real_exercise = device_check._exercise
    calls = []

    def device_off_by_a_step(model, ids):  # each role runs the device model, then the CPU reference
        logits, addresses, device = real_exercise(model, ids)
        calls.append(1)
        if len(calls) % 2:
            logits = logits.copy()
            logits[2, 7] += 0.3 * device_check.proofs.fp16_step(float(np.abs(logits[2]).max()))  # bound: 0.25
        return logits, addresses, device

    monkeypatch.setattr(device_check, "_exercise", device_off_by_a_step)
    check = device_check.ArtifactCheck("llama", "cpu")
    device_check.check_proofs(check, tiny_artifacts["llama"], "cpu", tiny_artifacts["llama"].parent)
    assert len(check.failures) == 2 and all("fp16 steps) at row 2" in f for f in check.failures)
    assert 0.25 < check.logits["target"]["max_steps"] < 0.35


def test_tf32_is_turned_off_for_fp32_artifacts_only(tiny_artifacts, tmp_path):
    from specdec.models.manifest import load_manifest

    assert load_manifest(tiny_artifacts["llama"]).target.kv_dtype == "float32"
    assert device_check._tf32_off(tiny_artifacts["llama"]).cuda_options == {"use_tf32": "0"}


def test_a_cache_off_the_device_fails(tiny_artifacts, monkeypatch):
    monkeypatch.setitem(device_check.KV_DEVICE, "cpu", "cuda")  # pretend the cache should be on a GPU
    check = device_check.check_artifact(tiny_artifacts["llama"], "cpu", max_new_tokens=4)
    assert check.failures == ["KV cache is on cpu, not cuda", "batch engine KV slots are on cpu, not cuda"]


def test_cuda_without_cuda_fails_with_the_reason(tiny_artifacts, tmp_path, capsys):
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("a CUDA build: this machine runs the real check")
    code = device_check.main([str(tiny_artifacts["llama"]), "--provider", "cuda", "--output", str(tmp_path / "r.json")])
    report = json.loads((tmp_path / "r.json").read_text())
    assert code == 1 and not report["passed"]
    assert "CUDA was requested" in report["checks"][0]["failures"][0]
    assert json.loads(capsys.readouterr().out) == report


def test_a_speculative_output_that_parts_away_from_a_near_tie_fails(tiny_artifacts, monkeypatch):
    real_generate = device_check.Engine.generate

    def off_by_one(self, prompt, config, on_iteration=None):
        result = real_generate(self, prompt, config, on_iteration)
        if config.drafter != "none":  # a broken loop: the 3rd token is not the target's argmax
            result.token_ids[2] = (result.token_ids[2] + 1) % 50
        return result

    monkeypatch.setattr(device_check.Engine, "generate", off_by_one)
    check = device_check.check_artifact(tiny_artifacts["llama"], "cpu", max_new_tokens=6, prompts=("one two",))
    assert len(check.failures) == 4  # n-gram and model drafter, K=4 and auto
    assert all("at token 2, not a near-tie" in failure for failure in check.failures)


def test_the_fallback_disabled_session_is_tried_on_cuda_alone_and_its_refusal_reported(monkeypatch):
    asked = []

    def refusing_session(path, sess_options=None, providers=None):
        asked.append(providers)
        raise RuntimeError("[ONNXRuntimeError] : 1 : FAIL : This session contains graph nodes that are assigned to "
                           "the default CPU EP, but fallback to CPU EP has been explicitly disabled by the user.\nmore")

    monkeypatch.setattr(device_check.ort, "InferenceSession", refusing_session)
    outcome = device_check.strict_session_outcome("model.onnx", "cuda")
    assert asked == [["CUDAExecutionProvider"]]  # the CPU provider listed too is a conflict onnxruntime refuses
    assert outcome.endswith("fallback to CPU EP has been explicitly disabled by the user.")
    assert device_check.strict_session_outcome("model.onnx", "cpu").startswith("not tried")
