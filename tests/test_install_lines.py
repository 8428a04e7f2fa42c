"""Each README install line works alone: a fresh venv per extra set, specdec installed from this checkout by
pip's ordinary resolution, and no torch in it.

`make install` puts every extra (and ray[serve]) into one venv, so an extra that lacks something another
extra brings passes every other test: `specdec[serve,cpu]` once lacked httptools, which only ray[serve]
brought, and `specdec serve` stopped at start. Minutes on 2 cores (two venvs, onnxruntime in each).
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "optimum", "onnx")  # the export extra's stack: never imported by the runtime
PIP_SECONDS = 900  # one venv's install; pip's own per-request timeout is separate
START_SECONDS = 120  # server up and healthy
REQUEST_SECONDS = 120


def _env() -> dict[str, str]:
    """The test's environment without what would let a venv see this checkout's own venv."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _run(*args, timeout: float) -> subprocess.CompletedProcess:
    """Run `args` outside the checkout (`python -c` would import specdec from the working directory)."""
    completed = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout,
                               env=_env(), cwd="/")
    command = " ".join(map(str, args))
    assert completed.returncode == 0, f"{command}\n{completed.stdout[-3000:]}{completed.stderr[-3000:]}"
    return completed


@pytest.fixture(scope="session")
def specdec_wheel(tmp_path_factory) -> Path:
    """Return specdec's wheel built from this checkout's working tree (a copy, so no build/ lands in it)."""
    root = tmp_path_factory.mktemp("install-lines")
    source = root / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", *(p.name for p in ROOT.glob("LICEN[CS]E*"))):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(ROOT / "specdec", source / "specdec", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", root / "dist", source, timeout=PIP_SECONDS)
    (wheel,) = (root / "dist").glob("specdec-*.whl")
    return wheel


@pytest.fixture(scope="session")
def venv_with(specdec_wheel, tmp_path_factory):
    """Return venv_with(extras) -> the bin/ folder of a fresh venv holding specdec[extras]; one venv per extra set."""
    made: dict[str, Path] = {}

    def make(extras: str) -> Path:
        if extras not in made:
            venv = tmp_path_factory.mktemp("venv-" + extras.replace(",", "-"))
            _run(sys.executable, "-m", "venv", venv, timeout=PIP_SECONDS)
            _run(venv / "bin" / "python", "-m", "pip", "install", "-q", f"{specdec_wheel}[{extras}]",
                 timeout=PIP_SECONDS)
            missing = _run(venv / "bin" / "python", "-c",
                           f"import importlib.util; print([m for m in {HEAVY!r} if importlib.util.find_spec(m)])",
                           timeout=60)
            assert missing.stdout.strip() == "[]", f"specdec[{extras}] installed {missing.stdout.strip()}"
            made[extras] = venv / "bin"
        return made[extras]

    return make


# Runs `specdec generate` in-process, recording every import of the export stack that was even tried
# (a try/except ImportError fallback would hide one from a plain run).
IMPORT_CLOSURE = textwrap.dedent("""
    import importlib.abc, sys

    HEAVY = {heavy!r}
    tried = set()

    class Record(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in HEAVY:
                tried.add(name)
            return None

    sys.meta_path.insert(0, Record())
    import specdec
    from specdec.cli.main import main
    from specdec.data import HELDOUT_PROMPTS_FILE, PROMPTS_FILE

    assert "site-packages" in specdec.__file__, specdec.__file__  # the installed wheel, not the checkout
    assert PROMPTS_FILE.is_file() and HELDOUT_PROMPTS_FILE.is_file()  # package data shipped

    try:
        main(["generate", sys.argv[1], "The quick brown fox", "--max-new-tokens", "6", "--provider", "cpu"])
    except SystemExit as end:
        assert not end.code, end.code
    print("\\ntried:", sorted(tried))
""")


def test_cpu_line_generates_without_the_export_stack(venv_with, tiny_artifacts):
    bin_dir = venv_with("cpu")
    generated = _run(bin_dir / "specdec", "generate", tiny_artifacts["llama"], "The quick brown fox", "--json",
                     "--max-new-tokens", 8, "--provider", "cpu", timeout=300)
    result = json.loads(generated.stdout.strip().splitlines()[-1])
    assert len(result["token_ids"]) == 8 and result["finish_reason"] == "length"
    closure = _run(bin_dir / "python", "-c", IMPORT_CLOSURE.format(heavy=HEAVY), tiny_artifacts["llama"],
                   timeout=300)
    assert closure.stdout.strip().splitlines()[-1] == "tried: []"


def _lines(stream, into: queue.Queue) -> None:
    for line in stream:
        into.put(line)
    into.put(None)


def test_serve_line_answers_a_chat_completion(venv_with, tiny_artifacts):
    bin_dir = venv_with("serve,cpu")
    proc = subprocess.Popen([str(bin_dir / "specdec"), "serve", str(tiny_artifacts["llama"]), "--port", "0",
                             "--provider", "cpu", "--model-name", "tiny", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), cwd="/")
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stdout, lines), daemon=True).start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + START_SECONDS
        url = None
        while url is None:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no 'listening on' line in {START_SECONDS} s:\n" + "".join(seen))
            assert line is not None, "specdec serve exited:\n" + "".join(seen)
            seen.append(line)
            match = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
            url = match and match.group(1)
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "never healthy:\n" + "".join(seen)
            time.sleep(0.2)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "one two three"}], "max_tokens": 5,
                "temperature": 0}
        response = httpx.post(url + "/v1/chat/completions", json=body, timeout=REQUEST_SECONDS)
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["object"] == "chat.completion" and 0 < answer["usage"]["completion_tokens"] <= 5
        assert isinstance(answer["choices"][0]["message"]["content"], str)
    finally:
        proc.kill()
        proc.wait(timeout=30)
