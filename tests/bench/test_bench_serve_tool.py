"""tools/bench_serve.py refuses incomplete anchor settings in one line before it starts any server."""

import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_serve.py"


@pytest.mark.parametrize("flags, says", [
    (["--llama-server", "/bin/true"], "--llama-server needs --gguf"),
    (["--vllm-python", "/bin/true"], "--vllm-python needs --hf-folder"),
    (["--llama-server", "none", "--vllm-python", "none"], "missing"),  # "none" runs no anchor: on to the artifact
    (["--turns", "2", "--burst", "8"], "each is a run of its own"),
])
def test_incomplete_anchor_settings_and_a_missing_artifact_get_one_line(tmp_path, flags, says):
    run = subprocess.run([sys.executable, str(TOOL), "--artifact", str(tmp_path / "missing"), *flags,
                          "--output", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "Traceback" not in run.stderr and says in run.stderr.strip().splitlines()[-1], run.stderr
    assert not (tmp_path / "out").exists()


def test_each_workload_passes_its_own_flags_to_serve_load():
    import argparse
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_serve", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    base = dict(artifact="art", concurrency="1,4", min_waves=2, output="out", rate=None, turns=None, think_time=0.0,
                burst=None, burst_running=2, prefill_lengths=None)
    assert tool.workload(argparse.Namespace(**base)) == ["--concurrency", "1,4", "--min-waves", "2", "--plot",
                                                         str(Path("out") / "serve.png")]
    assert tool.workload(argparse.Namespace(**{**base, "rate": "1,2"}))[:2] == ["--rate", "1,2"]
    assert tool.workload(argparse.Namespace(**{**base, "turns": 2, "think_time": 1.0})) == [
        "--turns", "2", "--think-time", "1.0", "--concurrency", "1,4"]
    assert tool.workload(argparse.Namespace(**{**base, "burst": 8})) == ["--burst", "8", "--burst-running", "2"]
    # the prefill scenario cuts its prompts with the artifact's tokenizer; no plot (it draws the loops only)
    assert tool.workload(argparse.Namespace(**{**base, "prefill_lengths": "45,360"})) == [
        "art", "--prefill-lengths", "45,360"]
