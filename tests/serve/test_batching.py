"""`specdec serve` with the batch engine: concurrent streamed chats share target calls, each answer its own."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from specdec.runtime import GenerationConfig
from tests.serve.conftest import MODEL, live_server

PROMPTS = ["The quick brown fox", "one, two, three, one, two,", "Hello world!", "def add(a, b):",
           "a b c d a b c", "Paris is the", "red green blue red", "x = [1, 2, 3,"]


def _streamed_chat(url: str, prompt: str, out: dict) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 20, "temperature": 0,
            "stream": True}
    text = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[6:])["choices"]
                if choices:
                    text.append(choices[0]["delta"].get("content") or "")
    out[prompt] = "".join(text)


def test_eight_streamed_chats_share_calls_and_each_gets_its_own_greedy_answer(serve_engine, serve_artifact):
    expected = {p: serve_engine.generate(serve_engine.codec.chat_prompt([{"role": "user", "content": p}]),
                                         GenerationConfig(max_new_tokens=20, chat=False)).text for p in PROMPTS}
    with live_server(serve_engine, serve_artifact, max_batch=4, kv_capacity=256) as server:
        answers: dict[str, str] = {}
        threads = [threading.Thread(target=_streamed_chat, args=(server.url, p, answers)) for p in PROMPTS]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert answers == expected
        assert server.metric("specdec:batch_size_count") > 0
        assert server.metric("specdec:batch_size_sum") > server.metric("specdec:batch_size_count")  # rows shared calls
        assert "vllm:kv_cache_usage_perc" in httpx.get(server.url + "/metrics").text
        assert server.state.batch.arena.used == 0
        # where each first token's time went: every part of every request counted, adding up to the TTFT
        parts = ("server", "step_boundary", "slot_wait", "chunk_wait", "prefill", "stream")
        assert all(server.metric("specdec:ttft_part_seconds_count", part=p) == len(PROMPTS) for p in parts)
        split = sum(server.metric("specdec:ttft_part_seconds_sum", part=p) for p in parts)
        assert split == pytest.approx(server.metric("vllm:time_to_first_token_seconds_sum"), rel=1e-6)
        assert server.metric("specdec:ttft_part_seconds_sum", part="prefill") > 0


def test_the_prefix_cache_counts_prompt_tokens_looked_up_and_held_under_vllms_names(serve_engine, serve_artifact):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "one, two, three, one, two, three, four"}],
            "max_tokens": 4, "temperature": 0}
    with live_server(serve_engine, serve_artifact, max_batch=2, kv_capacity=256, prefix_cache=True) as server:
        assert server.metric("vllm:prefix_cache_queries_total", model_name=MODEL) == 0
        assert httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
        prompt = server.metric("vllm:prefix_cache_queries_total", model_name=MODEL)
        assert prompt > 16 and server.metric("vllm:prefix_cache_hits_total", model_name=MODEL) == 0
        assert httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
        assert server.metric("vllm:prefix_cache_queries_total", model_name=MODEL) == 2 * prompt
        # the same prompt again: all of it but the last two tokens, which the prefill feeds, was held
        assert server.metric("vllm:prefix_cache_hits_total", model_name=MODEL) == prompt - 2


def test_a_request_that_cannot_fit_a_kv_slot_gets_a_400_naming_the_capacity(serve_engine, serve_artifact):
    with live_server(serve_engine, serve_artifact, max_batch=2, kv_capacity=64) as server:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 200}
        reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 400
        assert "KV slot of 64 positions" in reply.json()["error"]["message"]
        assert reply.json()["error"]["code"] == "context_length_exceeded"


def test_health_fails_once_the_batch_scheduler_has_stopped(serve_engine, serve_artifact):
    """What Ray's check_health and a load balancer's probe see: ok, then 503 and an exception naming why."""
    import pytest

    with live_server(serve_engine, serve_artifact, max_batch=2, kv_capacity=128) as server:
        assert httpx.get(server.url + "/health").status_code == 200
        server.state.raise_if_unhealthy()
        server.state.batch.shutdown()
        assert httpx.get(server.url + "/health").status_code == 503
        with pytest.raises(RuntimeError, match="scheduler"):
            server.state.raise_if_unhealthy()


def test_on_a_gpu_whose_batch_engine_fails_the_server_starts_without_it(serve_engine, serve_artifact, monkeypatch,
                                                                        caplog):
    """The batch engine has not run on a GPU yet: where making or timing it fails there (here: CUDA memory asked of
    a CPU-only onnxruntime), serve's default --max-batch 8 runs each request alone (up to 8 at once), logging
    why, instead of failing to start."""
    from specdec.serve.app import ServerState
    from specdec.serve.config import ServeConfig

    monkeypatch.setattr(serve_engine.target, "device", "cuda")
    state = ServerState(ServeConfig(artifact=str(serve_artifact), max_batch=8), serve_engine)
    assert state.batch is None and state.generator is serve_engine and state.admission.max_running == 8
    assert "no batch engine on cuda (" in caplog.text


def test_n_choices_beyond_the_batch_slots_stream_and_finish_each_from_its_own_seed(serve_engine, serve_artifact):
    """n=5 on 2 KV slots: the later choices wait in the batch engine's queue and take the slots the earlier ones
    free (as their generations end, while the response still streams); each choice is the engine's answer at
    seed 11 + i, whole and streamed."""
    prompt = "one, two, three, one, two,"
    settings = {"max_tokens": 10, "temperature": 1.0, "seed": 11, "n": 5, "num_draft_tokens": 2}
    expected = [serve_engine.generate(prompt, GenerationConfig(max_new_tokens=10, temperature=1.0, seed=11 + i,
                                                               num_draft_tokens=2)).text for i in range(5)]
    with live_server(serve_engine, serve_artifact, max_batch=2, kv_capacity=128) as server:
        body = {"model": MODEL, "prompt": prompt, **settings}
        whole = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()
        assert [c["text"] for c in sorted(whole["choices"], key=lambda c: c["index"])] == expected
        texts = [""] * 5
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=120) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for choice in json.loads(line[6:])["choices"]:
                        texts[choice["index"]] += choice["text"]
        assert texts == expected
        assert server.state.batch.arena.used == 0
