"""Clients that stop reading, leave while queued, or send their headers too slowly cost a bounded time."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from tests.serve.conftest import MODEL, live_server

WRITE_TIMEOUT = 1.5


def _open_stream_and_never_read(url: str, max_tokens: int) -> socket.socket:
    """Send a streamed chat request on a socket with a tiny receive buffer, and read nothing back."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # before connect: the window stays small
    sock.connect((host, int(port)))
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "go on"}], "stream": True,
                       "max_tokens": max_tokens, "temperature": 0, "specdec_tokens": True}).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return sock


def _eventually(condition, within: float) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("batching", [{"max_batch": 4}, {"max_concurrency": 4}], ids=["batch-engine", "threads"])
def test_clients_that_never_read_lose_their_slots_after_the_write_timeout(serve_engine, serve_artifact, batching):
    with live_server(serve_engine, serve_artifact, write_timeout=WRITE_TIMEOUT, max_queue=4, send_buffer_bytes=4096,
                     **batching) as server:
        stalled = [_open_stream_and_never_read(server.url, max_tokens=440) for _ in range(4)]
        try:
            time.sleep(0.5)  # the four hold every slot
            start = time.perf_counter()
            answer = httpx.post(server.url + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": "hello", "max_tokens": 8, "temperature": 0})
            waited = time.perf_counter() - start
            assert answer.status_code == 200, answer.text
            assert waited < WRITE_TIMEOUT + 3.0, f"the fifth request took {waited:.1f} s"
            assert _eventually(lambda: server.metric("specdec:requests_cancelled_total", reason="slow_client") == 4,
                               within=WRITE_TIMEOUT + 5.0)  # each blocks once its buffers fill, then times out
            assert _eventually(lambda: server.metric("vllm:num_requests_running") == 0, within=5.0)
            if server.state.batch is not None:
                assert server.state.batch.kv_usage == 0.0
        finally:
            for sock in stalled:
                sock.close()


@pytest.fixture
def slow_steps(monkeypatch):
    """Make every step take >= 50 ms (the batch engine's steps, or each thread's iterations): a 440-token
    generation then holds its slot for the whole test."""
    from specdec.runtime.batch import BatchEngine
    from specdec.serve.generation import Generation

    for owner, name in ((BatchEngine, "_step"), (Generation, "_iteration")):
        original = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *args, original=original: time.sleep(0.05) or original(*args))


@pytest.mark.parametrize("batching", [{"max_batch": 2}, {"max_concurrency": 1}], ids=["batch-engine", "threads"])
def test_a_request_abandoned_in_the_queue_is_dropped_before_its_prefill(serve_engine, serve_artifact, batching,
                                                                        slow_steps):
    """With the batch engine the queue is the engine's own (so that it picks whom a freed slot serves best):
    the server still answers 499 and counts the request as dropped while queued, and never prefills it."""
    with live_server(serve_engine, serve_artifact, max_queue=4, send_buffer_bytes=4096, **batching) as server:
        slots = batching.get("max_batch") or batching["max_concurrency"]
        holders = [_open_stream_and_never_read(server.url, max_tokens=440) for _ in range(slots)]  # write timeout 30 s
        try:
            assert _eventually(lambda: server.metric("vllm:num_requests_running") == slots, within=5.0)
            prompts_before = server.metric("vllm:prompt_tokens_total")
            with pytest.raises(httpx.ReadTimeout):  # the client gives up while its request waits for the slot
                httpx.post(server.url + "/v1/completions", timeout=0.5,
                           json={"model": MODEL, "prompt": "never mind", "max_tokens": 8})
            assert _eventually(lambda: server.metric("specdec:requests_cancelled_total",
                                                     reason="disconnect_queued") == 1, within=3.0)
            assert _eventually(lambda: server.metric("vllm:num_requests_waiting") == 0, within=3.0)
        finally:
            for holder in holders:
                holder.close()
        assert _eventually(lambda: server.metric("vllm:num_requests_running") == 0, within=5.0)
        assert server.metric("vllm:prompt_tokens_total") == prompts_before  # the abandoned prompt never prefilled
        assert _eventually(lambda: server.state.admission.running == 0, within=3.0)
        if server.state.batch is not None:
            assert server.state.batch.num_waiting == 0 and server.state.batch.arena.used == 0


@pytest.mark.parametrize("batching", [{"max_batch": 2}, {"max_concurrency": 1}], ids=["batch-engine", "threads"])
def test_the_queue_shows_in_the_waiting_gauge_and_its_deadline_gives_504(serve_engine, serve_artifact, batching,
                                                                         slow_steps):
    with live_server(serve_engine, serve_artifact, max_queue=4, send_buffer_bytes=4096, **batching) as server:
        slots = batching.get("max_batch") or batching["max_concurrency"]
        holders = [_open_stream_and_never_read(server.url, max_tokens=440) for _ in range(slots)]
        try:
            assert _eventually(lambda: server.metric("vllm:num_requests_running") == slots, within=5.0)
            object.__setattr__(server.state.config, "request_timeout", 1.0)  # the next request only: the holders keep 30 s
            replies = []
            waiter = threading.Thread(target=lambda: replies.append(httpx.post(
                server.url + "/v1/completions", timeout=30, json={"model": MODEL, "prompt": "wait", "max_tokens": 8})))
            waiter.start()
            assert _eventually(lambda: server.metric("vllm:num_requests_waiting") == 1, within=0.9)
            waiter.join()
            assert replies[0].status_code == 504 and "passed while queued" in replies[0].json()["error"]["message"]
            assert server.metric("specdec:requests_cancelled_total", reason="deadline") == 1
            assert _eventually(lambda: server.metric("vllm:num_requests_waiting") == 0, within=3.0)
        finally:
            for holder in holders:
                holder.close()


def test_a_client_that_sends_headers_too_slowly_is_disconnected(serve_engine, serve_artifact):
    with live_server(serve_engine, serve_artifact, header_timeout=0.5) as server:
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the blank line
            start = time.monotonic()
            assert sock.recv(1024) == b""  # closed by the server
            assert time.monotonic() - start < 3.0
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200


def test_a_finished_generation_gives_its_place_back_while_its_client_still_reads(serve_engine, serve_artifact):
    """One generation at a time: a client that reads nothing blocks the stream's writes (write timeout 20 s), but
    its generation ends within seconds, and the next request takes the place then, not after the timeout."""
    with live_server(serve_engine, serve_artifact, max_concurrency=1, write_timeout=20.0, max_queue=4,
                     send_buffer_bytes=4096) as server:
        stalled = _open_stream_and_never_read(server.url, max_tokens=440)
        try:
            assert _eventually(lambda: server.state.admission.running == 1, within=5.0)
            start = time.perf_counter()
            answer = httpx.post(server.url + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": "hello", "max_tokens": 8, "temperature": 0})
            waited = time.perf_counter() - start
            assert answer.status_code == 200, answer.text
            assert waited < 10.0, f"the second request took {waited:.1f} s"
            assert server.metric("specdec:requests_cancelled_total", reason="slow_client") == 0  # still writing
        finally:
            stalled.close()
