"""`kill -9` of a `specdec export` process at several points: no artifact, no debris that blocks a rerun.

SIGKILL runs no cleanup, so the staging folder (`.<name>.partial-*` beside the output) and the
scratch folder (under TMPDIR) stay; what matters is that the output path never holds a half
artifact, an artifact already there survives a killed `--force` re-export intact, and a rerun
succeeds without --force and removes the killed runs' staging folders (only those).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from specdec.models.manifest import load_manifest

# progress lines the export prints (specdec/exporter/pipeline.py), each a point to kill it at
KILL_POINTS = ["target: exporting to ONNX", "target: optimizing the graph", "target: validating ONNX against PyTorch"]


def _export(source: Path, output: Path, tmp: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "TMPDIR": str(tmp)}  # the export's scratch folder lands where the test can see it
    command = [sys.executable, "-m", "specdec.cli.main", "export", "--target", str(source), "--draft", "none",
               "--output", str(output), *extra]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)


def _kill_at(process: subprocess.Popen, marker: str) -> list[str]:
    """SIGKILL `process` as soon as it prints `marker`; return the lines it printed."""
    watchdog = threading.Timer(600, process.kill)  # a hung export fails the test instead of hanging it
    watchdog.start()
    lines = []
    try:
        for line in process.stderr:
            lines.append(line.rstrip())
            if marker in line:
                os.kill(process.pid, signal.SIGKILL)
                break
        process.wait()
    finally:
        watchdog.cancel()
    assert process.returncode == -signal.SIGKILL, (process.returncode, lines)
    return lines


def _debris(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}.partial-"))


def test_kill_9_at_each_point_leaves_no_artifact_and_the_rerun_succeeds(tiny_sources, tmp_path, capsys):
    source, _ = tiny_sources["llama"]
    parent, scratch = tmp_path / "out", tmp_path / "tmp"
    scratch.mkdir()
    output = parent / "art"
    for point in KILL_POINTS:
        _kill_at(_export(source, output, scratch), point)
        assert not output.exists(), f"killed at '{point}': a (partial) artifact is at the output path"
        assert sorted(p.name for p in parent.iterdir() if not p.name.startswith(".art.partial-")) == []
        # each run removes the staging folders of the runs killed before it: one is left, hidden beside the output
        assert len(_debris(parent, "art")) == 1
    left = _debris(parent, "art")
    foreign = parent / ".art.partial-not-ours"  # a folder of the same shape that specdec did not make
    foreign.mkdir()
    rerun = _export(source, output, scratch)
    _, err = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, err
    assert _debris(parent, "art") == [foreign.name]  # the killed runs' folders went; the foreign one stays
    manifest = load_manifest(output)  # every file present and matching its sha256
    assert manifest.target.role == "target" and manifest.draft is None
    with capsys.disabled():
        print(f"\nkill -9 at {len(KILL_POINTS)} points: no artifact each time; {len(left)} hidden staging folders "
              f"left, removed by the rerun")


def test_kill_9_of_a_forced_re_export_keeps_the_old_artifact(tiny_sources, tiny_target_only_artifact, tmp_path):
    """--force replaces an artifact only once the new one is whole: killed before that, the old one stays."""
    import shutil

    source, _ = tiny_sources["llama"]
    output = tmp_path / "art"
    shutil.copytree(tiny_target_only_artifact, output)
    before = {p.relative_to(output): p.read_bytes() for p in output.rglob("*") if p.is_file()}
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    _kill_at(_export(source, output, scratch, "--force"), KILL_POINTS[-1])
    assert {p.relative_to(output): p.read_bytes() for p in output.rglob("*") if p.is_file()} == before
    load_manifest(output)


def test_sigterm_mid_export_exits_143_in_one_line_and_leaves_nothing_behind(tiny_sources, tmp_path):
    """SIGTERM (what `timeout` and process managers send) unwinds like Ctrl-C: the staging folder, the scratch
    folder and the output's parent the export made are all removed, unlike after `kill -9`."""
    source, _ = tiny_sources["llama"]
    parent, scratch = tmp_path / "out", tmp_path / "tmp"
    scratch.mkdir()
    process = _export(source, parent / "art", scratch)
    watchdog = threading.Timer(600, process.kill)
    watchdog.start()
    try:
        for line in process.stderr:
            if KILL_POINTS[0] in line:
                process.send_signal(signal.SIGTERM)
                break
        rest = process.stderr.read()
        process.wait()
    finally:
        watchdog.cancel()
    assert process.returncode == 128 + signal.SIGTERM, rest
    assert rest.strip().splitlines()[-1] == "terminated"
    assert not parent.exists()
    assert [p.name for p in scratch.iterdir() if p.name.startswith("specdec-export-")] == []
