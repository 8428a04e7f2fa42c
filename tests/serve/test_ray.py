"""`specdec serve --ray` as a real process: a local Ray, two replicas, every listener on loopback,
driven by the openai client, stopped by SIGTERM with all of Ray's processes gone."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from specdec.runtime import GenerationConfig
from tests.serve.conftest import MODEL

pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")
pytestmark = pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads listeners from /proc")

START_TIMEOUT = 240.0  # a local Ray and two replicas: ~20-30 s on 2 busy cores
STOP_TIMEOUT = 90.0
PROMPTS = [f"Replica test {i}: the {w} fox counts {i} apples." for i, w in
           enumerate(["red", "quick", "lazy", "brown", "small", "happy", "old", "young"])]


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def _descendants(root: int) -> set[int]:
    tree, found, todo = _children(), {root}, [root]
    while todo:
        for child in tree.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _address(hex_address: str) -> str:
    """Decode /proc/net/tcp{,6}'s local address (little-endian 32-bit words) to text."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    if len(words) == 4:
        return ".".join(str(b) for b in words)
    if words[:12] == b"\0" * 10 + b"\xff\xff":  # ::ffff:a.b.c.d
        return "::ffff:" + ".".join(str(b) for b in words[12:])
    return ":".join(words[i:i + 2].hex() for i in range(0, 16, 2))


def _is_loopback(address: str) -> bool:
    return address.startswith(("127.", "::ffff:127.")) or address == "0000:0000:0000:0000:0000:0000:0000:0001"


def _listeners(pids: set[int]) -> list[tuple[int, str, int]]:
    """Return (pid, address, port) of every listening TCP socket the processes `pids` hold."""
    owner = {}
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("socket:["):
                    owner[target[8:-1]] = pid
        except OSError:
            continue
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):  # a kernel without IPv6
            continue
        with open(table) as f:
            for row in f.readlines()[1:]:
                fields = row.split()
                if fields[3] != "0A" or fields[9] not in owner:  # 0A: LISTEN
                    continue
                host, port = fields[1].rsplit(":", 1)
                found.append((owner[fields[9]], _address(host), int(port, 16)))
    return found


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_ray_serve_two_replicas_on_loopback_answer_the_openai_client_and_stop(serve_artifact, serve_engine):
    port = _free_port()
    command = [sys.executable, "-m", "specdec.cli.main", "serve", str(serve_artifact), "--ray", "--replicas", "2",
               "--replica-cpus", "0.5", "--host", "127.0.0.1", "--port", str(port), "--model-name", MODEL,
               "--provider", "cpu", "--max-concurrency", "1", "--log-level", "warning"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    output: list[str] = []
    listening = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            output.append(line)
            if "listening on" in line:
                listening.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    pids: set[int] = set()
    try:
        end = time.monotonic() + START_TIMEOUT
        while not listening.wait(0.5):
            assert proc.poll() is None, f"specdec serve --ray exited {proc.returncode}:\n{''.join(output)[-3000:]}"
            assert time.monotonic() < end, f"no listening line in {START_TIMEOUT:g} s:\n{''.join(output)[-3000:]}"
        url = f"http://127.0.0.1:{port}"
        assert re.search(rf"listening on {re.escape(url)}", "".join(output))
        session = re.search(r"Ray keeps its session files in (\S+)", "".join(output))
        assert session and os.path.isdir(session.group(1)), "".join(output)[-1000:]

        # every socket Ray and the replicas listen on is on the loopback address
        pids = _descendants(proc.pid)
        listeners = _listeners(pids)
        assert (proc.pid, "127.0.0.1", port) not in listeners  # the HTTP proxy is a Ray actor, not the CLI
        assert any(p == port for _, _, p in listeners), listeners
        assert len({pid for pid, _, _ in listeners}) >= 5, listeners  # GCS, raylet, proxy, 2 replicas at least
        exposed = [item for item in listeners if not _is_loopback(item[1])]
        assert not exposed, f"listening beyond loopback: {exposed}"

        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list()] == [MODEL]
        page = httpx.get(url + "/", timeout=30)  # the playground through Ray's proxy too
        assert page.status_code == 200 and "/static/app.js" in page.text
        expected = {p: serve_engine.generate(p, GenerationConfig(max_new_tokens=24)).text for p in PROMPTS}

        def complete(prompt: str):
            return client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                             extra_body={"drafter": "model", "num_draft_tokens": 3})

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            replies = list(pool.map(complete, PROMPTS, timeout=120))
        assert [r.choices[0].text for r in replies] == [expected[p] for p in PROMPTS]
        fingerprints = {r.system_fingerprint for r in replies}
        assert len(fingerprints) == 2, fingerprints  # both replicas answered

        chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}],
                                                     max_tokens=16, temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}],
                                               max_tokens=16, temperature=0)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=STOP_TIMEOUT) == 0, "".join(output)[-3000:]
        end = time.monotonic() + 30
        while any(_alive(pid) for pid in pids) and time.monotonic() < end:
            time.sleep(0.2)
        left = sorted(pid for pid in pids if _alive(pid))
        assert not left, f"Ray processes still running after shutdown: {left}"
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=2)
    finally:
        for pid in [proc.pid, *sorted(pids)]:  # only what this test started, if the test failed midway
            if _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        proc.wait(timeout=10)
