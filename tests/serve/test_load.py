"""Under load and faults: concurrent streams, overload, disconnects, deadlines, a 1,000-request soak."""

from __future__ import annotations

import gc
import json
import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from specdec.runtime.engine import GenerationConfig
from tests.runtime.helpers import flat_call_costs
from tests.serve.conftest import MODEL, live_server

openai = pytest.importorskip("openai")

PROMPTS = [f"Item {i}: the {w} fox counts {i} apples and {i + 1} pears." for i, w in
           enumerate(["red", "quick", "lazy", "brown", "small", "happy", "old", "young"] * 2)]


def _stream_text(url: str, prompt: str, max_tokens: int, **extra) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    chunks = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, temperature=0, stream=True, extra_body=extra)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_16_concurrent_streams_complete_and_equal_their_sequential_outputs(server):
    sequential = [_stream_text(server.url, p, 24) for p in PROMPTS]
    with ThreadPoolExecutor(16) as pool:
        concurrent = list(pool.map(lambda p: _stream_text(server.url, p, 24), PROMPTS, timeout=120))
    assert concurrent == sequential
    assert server.metric("vllm:num_requests_running", model_name=MODEL) == 0


def test_overload_gets_429_with_retry_after_and_nothing_hangs(serve_engine, serve_artifact):
    with live_server(serve_engine, serve_artifact, max_concurrency=1, max_queue=2) as live:
        def post(i):
            return httpx.post(live.url + "/v1/completions", timeout=60,
                              json={"model": MODEL, "prompt": PROMPTS[i], "max_tokens": 200, "temperature": 0})

        with ThreadPoolExecutor(10) as pool:
            responses = list(pool.map(post, range(10), timeout=120))
        statuses = sorted(r.status_code for r in responses)
        assert set(statuses) == {200, 429}, statuses
        assert statuses.count(200) >= 3  # the one running and the two queued
        for r in responses:
            if r.status_code == 429:
                assert int(r.headers["retry-after"]) >= 1
                assert r.json()["error"]["type"] == "rate_limit_exceeded"
        assert live.metric("specdec:requests_rejected_total", reason="overloaded") == statuses.count(429)
        assert live.metric("vllm:num_requests_waiting", model_name=MODEL) == 0


def _slow_down_iterations(monkeypatch, seconds: float) -> None:
    from specdec.serve.generation import Generation

    original = Generation._iteration

    def slow(self, iteration):
        time.sleep(seconds)
        original(self, iteration)

    monkeypatch.setattr(Generation, "_iteration", slow)


@pytest.fixture
def slow_iterations(monkeypatch):
    """Make every decode iteration take >= 20 ms, so a long generation is still running a few tokens in."""
    _slow_down_iterations(monkeypatch, 0.02)


@pytest.fixture
def stalled_iterations(monkeypatch):
    """Make every decode iteration take 0.8 s: longer than any client timeout or deadline these tests set,
    so the cut comes before the end even when a sampled generation would stop at an early end-of-text."""
    _slow_down_iterations(monkeypatch, 0.8)


def _track_caches(engine, monkeypatch) -> list:
    refs = []
    original = engine.target.new_cache

    def new_cache(*args, **kwargs):
        cache = original(*args, **kwargs)
        refs.append(weakref.ref(cache))
        return cache

    monkeypatch.setattr(engine.target, "new_cache", new_cache)
    return refs


def _wait_for(predicate, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_disconnect_mid_stream_cancels_the_generation_and_frees_its_cache(server, serve_engine, monkeypatch,
                                                                          slow_iterations):
    refs = _track_caches(serve_engine, monkeypatch)
    cancelled_before = server.metric("specdec:requests_cancelled_total", reason="disconnect")
    tokens_before = server.metric("vllm:generation_tokens_total", model_name=MODEL)
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0.8, "seed": 1, "stream": True,
            "drafter": "none"}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        received = 0
        for line in lines:
            if line.startswith("data: {"):
                received += 1
                if received == 3:
                    break
    # the client is gone: the server counts it, stops the generation, frees the slot and the cache
    assert _wait_for(lambda: server.metric("specdec:requests_cancelled_total", reason="disconnect")
                     == cancelled_before + 1)
    assert _wait_for(lambda: server.metric("vllm:num_requests_running", model_name=MODEL) == 0)
    assert _wait_for(lambda: not server.state.active)
    time.sleep(0.3)
    generated = server.metric("vllm:generation_tokens_total", model_name=MODEL) - tokens_before
    assert generated < 100, generated  # stopped long before max_tokens (400)
    gc.collect()
    assert refs and all(ref() is None for ref in refs)


def test_a_disconnected_non_streamed_request_is_cancelled(server, stalled_iterations):
    cancelled_before = server.metric("specdec:requests_cancelled_total", reason="disconnect")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", timeout=0.5,
                   json={"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 450, "temperature": 0.8,
                         "drafter": "none"})
    assert _wait_for(lambda: server.metric("specdec:requests_cancelled_total", reason="disconnect")
                     == cancelled_before + 1)
    assert _wait_for(lambda: not server.state.active)


def test_deadline_cuts_a_request_with_504(serve_engine, serve_artifact, stalled_iterations):
    with live_server(serve_engine, serve_artifact, max_concurrency=1, request_timeout=0.3) as live:
        response = httpx.post(live.url + "/v1/completions", timeout=30,
                              json={"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 450, "temperature": 0.8,
                                    "drafter": "none"})
        assert response.status_code == 504 and response.json()["error"]["code"] == "deadline_exceeded"
        streamed = httpx.post(live.url + "/v1/completions", timeout=30,
                              json={"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 450, "temperature": 0.8,
                                    "drafter": "none", "stream": True})
        events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "deadline_exceeded"
        assert live.metric("specdec:requests_cancelled_total", reason="deadline") == 2


def _rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads RSS from /proc")
def test_soak_1000_requests_with_flat_resident_memory(server):
    """1,000 non-streamed requests (4 client threads, 4 tokens each); RSS after the first 200 vs the end."""
    total, warmup, threads = 1000, 200, 4
    errors: list[str] = []
    samples: list[tuple[int, int]] = []
    done = 0
    lock = threading.Lock()

    def worker(index: int) -> None:
        nonlocal done
        with httpx.Client(base_url=server.url, timeout=30) as client:
            for i in range(index, total, threads):
                r = client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPTS[i % len(PROMPTS)],
                                                         "max_tokens": 4, "temperature": 0.7, "seed": i})
                if r.status_code != 200:
                    errors.append(f"{r.status_code} {r.text[:200]}")
                with lock:
                    done += 1
                    if done in (warmup, total):
                        gc.collect()
                        samples.append((done, _rss_bytes()))

    start = time.monotonic()
    pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in pool), "soak did not finish in 300 s"
    assert not errors, errors[:3]
    (_, after_warmup), (_, at_end) = samples
    growth_mb = (at_end - after_warmup) / 2**20
    print(f"soak: {total} requests in {time.monotonic() - start:.1f}s, RSS {after_warmup / 2**20:.0f} MB "
          f"after {warmup} -> {at_end / 2**20:.0f} MB at {total} ({growth_mb:+.1f} MB)")
    assert growth_mb < 25, f"RSS grew {growth_mb:.1f} MB over {total - warmup} requests"
    assert server.metric("vllm:request_success_total", model_name=MODEL, finished_reason="length") >= total


def test_a_seeded_answer_under_auto_k_is_the_same_alone_and_beside_seven_others(serve_engine, serve_artifact,
                                                                                  monkeypatch):
    """OpenAI's `seed` on the server's `-k auto` and the batch engine: the same text as the request alone and as
    the library's reproducible request (K follows its own tokens, not the load: GenerationConfig.reproducible),
    though the live call times say long verify calls are as cheap as short ones."""
    serve_engine.time_call_costs()
    monkeypatch.setattr(serve_engine, "target_call_costs", flat_call_costs(serve_engine))
    seeded = {"model": MODEL, "prompt": "the the the the red red red", "max_tokens": 24, "temperature": 1.1,
              "top_k": 8, "seed": 5, "drafter": "ngram"}
    with live_server(serve_engine, serve_artifact, max_batch=8, num_draft_tokens="auto", max_queue=16) as live:
        with httpx.Client(base_url=live.url, timeout=60) as client:
            alone = client.post("/v1/completions", json=seeded).json()["choices"][0]["text"]
            with ThreadPoolExecutor(8) as pool:
                others = [pool.submit(client.post, "/v1/completions",
                                      json={"model": MODEL, "prompt": p, "max_tokens": 24, "temperature": 0,
                                            "drafter": "ngram"}) for p in PROMPTS[:7]]
                loaded = pool.submit(client.post, "/v1/completions", json=seeded)
                assert all(o.result().status_code == 200 for o in others)
                beside = loaded.result().json()["choices"][0]["text"]
    library = serve_engine.generate("the the the the red red red", GenerationConfig(
        max_new_tokens=24, temperature=1.1, top_k=8, seed=5, drafter="ngram", num_draft_tokens="auto",
        reproducible=True)).text
    assert alone == beside == library
