"""A soak: 1,000 short requests from 4 clients, one in five of them bad; memory flat, every good answer right."""

from __future__ import annotations

import json
import resource
import threading
import time

import httpx

from specdec.runtime.engine import GenerationConfig
from tests.serve.conftest import MODEL, live_server

REQUESTS, CLIENTS, WARMUP = 1000, 4, 100
PROMPTS = ["Hello world", "one two three", "The quick brown fox", "def add(a, b):"]
BAD = [  # (body bytes, content type, expected status)
    (b"{not json", "application/json", 400),
    (json.dumps({"prompt": "x", "max_tokens": 10 ** 9}).encode(), "application/json", 400),
    (json.dumps({"prompt": "x", "model": "gpt-4o"}).encode(), "application/json", 404),
    (b"[" * 100_000 + b"]" * 100_000, "application/json", 400),
    (json.dumps({"prompt": "x"}).encode(), "text/plain", 415),
    (json.dumps({"prompt": "x", "logit_bias": {"a": 1}}).encode(), "application/json", 400),
    (json.dumps({"prompt": "x", "stop": ["s" * 1000]}).encode(), "application/json", 400),
    (json.dumps({"prompt": [], "max_tokens": 4}).encode(), "application/json", 400),
]


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_a_thousand_mixed_requests_keep_memory_flat_and_answers_right(serve_engine, serve_artifact):
    expected = {prompt: serve_engine.generate(prompt, GenerationConfig(max_new_tokens=6, drafter="none")).text
                for prompt in PROMPTS}
    failures: list[str] = []
    rss: dict[str, float] = {}
    done = [0]
    lock = threading.Lock()

    def client(worker: int, server_url: str) -> None:
        with httpx.Client(base_url=server_url, timeout=60) as http:
            for index in range(worker, REQUESTS, CLIENTS):
                if index % 5 == 4:
                    body, content_type, status = BAD[(index // 5) % len(BAD)]
                    answer = http.post("/v1/completions", content=body, headers={"Content-Type": content_type})
                    if answer.status_code != status:
                        failures.append(f"bad request {index}: {answer.status_code} instead of {status}")
                else:
                    prompt = PROMPTS[index % len(PROMPTS)]
                    answer = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 6,
                                                                "temperature": 0, "drafter": "ngram",
                                                                "stream": index % 3 == 0})
                    text = (answer.json()["choices"][0]["text"] if index % 3 else "".join(
                        json.loads(line[6:])["choices"][0]["text"] for line in answer.text.splitlines()
                        if line.startswith("data: {")))
                    if answer.status_code != 200 or text != expected[prompt]:
                        failures.append(f"good request {index}: {answer.status_code} {text!r}")
                with lock:
                    done[0] += 1
                    if done[0] == WARMUP:
                        rss["start"] = _rss_mb()

    with live_server(serve_engine, serve_artifact, max_batch=4, max_queue=64) as server:
        start = time.perf_counter()
        threads = [threading.Thread(target=client, args=(w, server.url)) for w in range(CLIENTS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=600)
        seconds = time.perf_counter() - start
        rss["end"] = _rss_mb()
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        assert server.state.admission.running == 0 and server.state.batch.kv_usage == 0.0
    assert done[0] == REQUESTS and not failures, failures[:5]
    growth = rss["end"] / rss["start"] - 1
    print(f"soak: {REQUESTS} requests in {seconds:.1f} s, RSS {rss['start']:.0f} -> {rss['end']:.0f} MB "
          f"(peak {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB)")
    assert growth < 0.10, rss
