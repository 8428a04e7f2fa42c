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
])
def test_incomplete_anchor_settings_and_a_missing_artifact_get_one_line(tmp_path, flags, says):
    run = subprocess.run([sys.executable, str(TOOL), "--artifact", str(tmp_path / "missing"), *flags,
                          "--output", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "Traceback" not in run.stderr and says in run.stderr.strip().splitlines()[-1], run.stderr
    assert not (tmp_path / "out").exists()
