"""`specdec serve` as a real process: SIGTERM stops accepting, lets running streams finish (or cuts them
after the grace period), and the process exits by itself."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest

SCRIPT = textwrap.dedent("""
    import sys, time
    from specdec.serve.generation import Generation

    original = Generation._iteration

    def slow(self, iteration):  # 30 ms per iteration: a generation is surely running when SIGTERM comes
        time.sleep(0.03)
        original(self, iteration)

    Generation._iteration = slow
    from specdec.cli.main import main
    main(["serve", sys.argv[1], "--port", "0", "--model-name", "tiny", "--provider", "cpu",
          "--shutdown-grace", sys.argv[2], "--log-level", "warning"])
""")


def _start(artifact, grace: float) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(artifact), str(grace)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    line = proc.stdout.readline()
    match = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
    if not match:
        proc.kill()
        pytest.fail(f"no listening line: {line!r}{proc.stdout.read()[-2000:]}")
    url = match.group(1)
    end = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        assert time.monotonic() < end and proc.poll() is None, "server never became healthy"
        time.sleep(0.1)


def _stream_then_sigterm(proc, url) -> tuple[list[str], bool]:
    """Start a 150-token stream, SIGTERM after its first piece; return its events and whether a new
    connection was refused while it was draining."""
    events: list[str] = []
    first = threading.Event()

    def read():
        body = {"model": "tiny", "prompt": "one two three", "max_tokens": 150, "temperature": 0.8, "seed": 3,
                "drafter": "none", "stream": True}
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first.set()
        except httpx.TransportError:
            pass
        first.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert first.wait(30)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    try:
        httpx.get(url + "/health", timeout=2)
        refused = False
    except httpx.TransportError:
        refused = True
    reader.join(timeout=60)
    return events, refused


def test_sigterm_lets_running_streams_finish_then_exits(tiny_artifacts):
    proc, url = _start(tiny_artifacts["llama"], grace=30)
    try:
        events, refused = _stream_then_sigterm(proc, url)
        assert refused, "new connections must be refused once shutdown starts"
        assert events[-1] == "[DONE]"
        finish = json.loads(events[-2])["choices"][0]["finish_reason"]
        assert finish in ("length", "stop")
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once drained
    finally:
        proc.kill()


def test_sigterm_cuts_streams_after_the_grace_period(tiny_artifacts):
    proc, url = _start(tiny_artifacts["llama"], grace=0.5)
    try:
        events, _ = _stream_then_sigterm(proc, url)
        assert "[DONE]" not in events or any("error" in e for e in events)
        # the cut shows in the stream above; wait's timeout only keeps a hung server from hanging the suite
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once drained
    finally:
        proc.kill()
