"""The CUDA machine's check script, run here on the CPU provider: its checks pass, and can fail."""

import json

import pytest

from specdec.benchmarks import device_check
from specdec.runtime.engine import Engine


def test_checks_pass_on_the_cpu_for_every_drafter(tiny_artifacts):
    check = device_check.check_artifact(tiny_artifacts["llama"], "cpu", max_new_tokens=12)
    assert check.failures == []
    assert check.target_provider == check.draft_provider == "CPUExecutionProvider"
    assert check.kv_device.lower() == "cpu"
    # per prompt: target-only, then n-gram and model drafter at K=4 and auto
    assert len(check.runs) == len(device_check.PROMPTS) * 5
    assert all(run["greedy_equals_target_only"] for run in check.runs if run["drafter"] != "none")


def test_a_cache_off_the_device_fails(tiny_artifacts, monkeypatch):
    monkeypatch.setitem(device_check.KV_DEVICE, "cpu", "cuda")  # pretend the cache should be on a GPU
    check = device_check.check_artifact(tiny_artifacts["llama"], "cpu", max_new_tokens=4)
    assert check.failures == ["KV cache is on cpu, not cuda"]


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
