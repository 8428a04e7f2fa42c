"""A live server on 127.0.0.1 (ephemeral port) in a thread of the test process, over a tiny artifact."""

from __future__ import annotations

import json
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import httpx  # noqa: E402
import uvicorn  # noqa: E402

from specdec.runtime import Engine  # noqa: E402
from specdec.serve import ServeConfig, create_app  # noqa: E402
from specdec.serve.http import uvicorn_config  # noqa: E402

MODEL = "tiny"
START_TIMEOUT = 30.0


class LiveServer:
    """uvicorn serving `app` on a socket bound to 127.0.0.1:0, in a daemon thread."""

    def __init__(self, app, send_buffer_bytes: int | None = None):
        self.app = app
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn_config(app, app.state.specdec.config, log_level="warning")
        if send_buffer_bytes is not None:  # loopback's buffers grow to MBs: a slow reader shows only past them
            config.http = _small_send_buffer(config.http, send_buffer_bytes)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def state(self):
        return self.app.state.specdec

    def start(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "server did not stop"

    def metric(self, name: str, **labels: str) -> float:
        """Return the value of one sample of /metrics (0 if absent)."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith("#") or not line.startswith(name):
                continue
            head, value = line.rsplit(" ", 1)
            metric, _, label_text = head.partition("{")
            if metric != name:
                continue
            if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
                return float(value)
        return 0.0


def _small_send_buffer(protocol: type, size: int) -> type:
    class SmallSendBuffer(protocol):
        def connection_made(self, transport) -> None:
            transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
            transport.set_write_buffer_limits(high=size)
            super().connection_made(transport)

    return SmallSendBuffer


def assembled_chat_stream(lines) -> tuple[str, list[tuple[str, str]], str | None, list[tuple[str, float]]]:
    """Return (text, calls as (name, arguments text) in index order, finish reason, (token, logprob) pairs) of a
    streamed chat reply's `lines`, as the openai client's stream assembler reads choice 0; an error event fails."""
    text, calls, finish, entries = "", {}, None, []
    for line in lines:
        if not line.startswith("data: {"):
            continue
        chunk = json.loads(line[6:])
        assert "error" not in chunk, chunk
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta", {})
            text += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                name, arguments = calls.get(call["index"], ("", ""))
                function = call.get("function", {})
                calls[call["index"]] = (name + (function.get("name") or ""),
                                        arguments + (function.get("arguments") or ""))
            entries += [(e["token"], e["logprob"]) for e in ((choice.get("logprobs") or {}).get("content") or [])]
            finish = choice.get("finish_reason") or finish
    return text, [calls[index] for index in sorted(calls)], finish, entries


@contextmanager
def live_server(engine: Engine | None, artifact: Path, **settings):
    """Start a server over `engine` (already loaded) with ServeConfig `settings`; stop it afterwards."""
    grace = settings.pop("shutdown_grace", 5.0)
    send_buffer_bytes = settings.pop("send_buffer_bytes", None)
    config = ServeConfig(artifact=str(artifact), model_name=MODEL, shutdown_grace=grace, **settings)
    server = LiveServer(create_app(config, engine), send_buffer_bytes).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def serve_artifact(tiny_artifacts) -> Path:
    """The tiny llama draft+target artifact the server tests use."""
    return tiny_artifacts["llama"]


@pytest.fixture(scope="session")
def serve_engine(serve_artifact, tiny_close_artifacts) -> Engine:
    """One loaded engine shared by the server tests (1 intra-op thread: two generations fit 2 cores).

    The page's artifacts are exported first: once a batching server made onnxruntime's process-wide
    thread pool, the exporter's own sessions are refused (`pytest tests/serve` alone would fail there).
    """
    return Engine.load(serve_artifact, provider="cpu", threads=1)


@pytest.fixture(scope="module")
def server(serve_engine, serve_artifact):
    """A server with 2 concurrent generations and a queue of 32."""
    with live_server(serve_engine, serve_artifact, max_concurrency=2, max_queue=32) as live:
        yield live
