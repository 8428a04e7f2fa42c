"""The load generator's own servers: `specdec serve` (one process, or Ray Serve) in a child process on
127.0.0.1, and the CPU seconds its process tree used."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Sequence

from specdec.models.errors import SpecdecError

START_TIMEOUT = 300.0  # seconds for a server (a local Ray and its replicas included) to answer /health


class ServerProcess:
    """`specdec serve` in a child process on 127.0.0.1; `stop()` sends SIGTERM and waits."""

    def __init__(self, kind: str, artifact: str, generations: int, cores: int, extra: Sequence[str] = ()):
        command = [sys.executable, "-m", "specdec.cli.main", "serve", artifact, "--host", "127.0.0.1",
                   "--max-queue", "64", "--log-level", "warning", *extra]
        if kind == "ray":
            from specdec.serve.ray_app import free_port

            command += ["--ray", "--replicas", str(generations), "--replica-cpus", f"{cores / generations:g}",
                        "--max-concurrency", "1", "--port", str(free_port("127.0.0.1"))]
        else:
            command += ["--max-concurrency", str(generations), "--port", "0"]
        self.kind, self.command = kind, command
        self.output: list[str] = []
        self.url: str | None = None
        self._listening = threading.Event()
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)  # Ray's processes stay in its session
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            match = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
            if match:
                self.url = match.group(1)
                self._listening.set()

    def wait_ready(self, timeout: float = START_TIMEOUT) -> str:
        """Return the server's URL once /health answers 200; raise SpecdecError if it does not in time."""
        import httpx

        end = time.monotonic() + timeout
        while not self._listening.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > end:
                raise SpecdecError(f"{self.kind} server did not start: {''.join(self.output)[-1500:]}")
        assert self.url is not None
        while time.monotonic() < end:
            try:
                if httpx.get(self.url + "/health", timeout=5, trust_env=False).status_code == 200:
                    return self.url
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise SpecdecError(f"{self.kind} server at {self.url} never became healthy")

    def cpu_seconds(self) -> float:
        """Return the user + system CPU seconds of the server's live process tree (Ray's processes included)."""
        return tree_cpu_seconds(self.proc.pid)

    def stop(self, timeout: float = 120.0) -> None:
        """SIGTERM the server and wait; kill its process group if it has not exited in `timeout` seconds."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


def tree_cpu_seconds(root: int) -> float:
    """Return the CPU seconds (user + system) of `root` and its live descendants, read from /proc (0 elsewhere)."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        times[int(entry)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    total, todo, seen = 0.0, [root], set()
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += times.get(pid, 0.0)
        todo += children.get(pid, [])
    return total
