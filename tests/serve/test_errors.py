"""Bad requests get 4xx in OpenAI's error shape, never a 500 or a traceback; /health says 503 until loaded."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from specdec.serve import ServeConfig, create_app
from tests.serve.conftest import MODEL, LiveServer

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]

CASES = [
    ("malformed JSON", CHAT, b'{"messages": [', 400, None),
    ("body not an object", CHAT, b"[1, 2]", 400, None),
    ("messages missing", CHAT, {"model": MODEL}, 400, "messages"),
    ("messages wrong type", CHAT, {"messages": "hi"}, 400, "messages"),
    ("max_tokens wrong type", CHAT, {"messages": USER, "max_tokens": "ten"}, 400, "max_tokens"),
    ("max_tokens zero", CHAT, {"messages": USER, "max_tokens": 0}, 400, "max_tokens"),
    ("temperature wrong type", CHAT, {"messages": USER, "temperature": "hot"}, 400, "temperature"),
    ("top_p out of range", CHAT, {"messages": USER, "top_p": 0}, 400, "top_p"),
    ("stream wrong type", CHAT, {"messages": USER, "stream": "yes"}, 400, "stream"),
    ("unknown model", CHAT, {"model": "gpt-4o", "messages": USER}, 404, "model"),
    ("empty messages", CHAT, {"messages": []}, 400, "messages"),
    ("unknown role", CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("a tool result answering no call", CHAT, {"messages": [{"role": "tool", "content": "x", "tool_call_id": "c"}]},
     400, "messages[0].role"),
    ("a tool result after a plain reply", CHAT, {"messages": USER + [{"role": "assistant", "content": "hi"},
                                                                     {"role": "tool", "content": "x"}]},
     400, "messages[2].role"),
    ("image part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages[0].content"),
    ("n over 16", CHAT, {"messages": USER, "n": 17}, 400, "n"),
    ("n of 0", COMPLETIONS, {"prompt": "a", "n": 0}, 400, "n"),
    ("best_of > 1", COMPLETIONS, {"prompt": "a", "best_of": 2}, 400, "best_of"),
    ("K over 32", CHAT, {"messages": USER, "num_draft_tokens": 33}, 400, "num_draft_tokens"),
    ("top_logprobs without logprobs", CHAT, {"messages": USER, "top_logprobs": 3}, 400, "top_logprobs"),
    ("top_logprobs over 20", CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("completions' logprobs over 5", COMPLETIONS, {"prompt": "a", "logprobs": 6}, 400, "logprobs"),
    ("presence_penalty out of range", CHAT, {"messages": USER, "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("prediction of another type", CHAT, {"messages": USER, "prediction": {"type": "file", "content": "x"}}, 400,
     "prediction.type"),
    ("tool without a name", CHAT, {"messages": USER, "tools": [{"type": "function", "function": {}}]}, 400,
     "tools[0].function.name"),
    ("tool_choice naming no tool", CHAT, {"messages": USER, "tool_choice": {"type": "function", "function": {
        "name": "g"}}, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice"),
    ("unknown format", CHAT, {"messages": USER, "response_format": {"type": "yaml"}}, 400, "response_format.type"),
    ("malformed schema", CHAT, {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "no-such-type"}}}}, 400, "response_format"),
    ("two formats", CHAT, {"messages": USER, "response_format": {"type": "json_object"}, "guided_regex": "a+"}, 400,
     "guided_regex"),
    ("17 stop strings", CHAT, {"messages": USER, "stop": [chr(97 + i) for i in range(17)]}, 400, "stop"),
    ("bad K", CHAT, {"messages": USER, "num_draft_tokens": 0}, 400, None),
    ("bad drafter", CHAT, {"messages": USER, "drafter": "oracle"}, 400, "drafter"),
    ("empty cache_salt", CHAT, {"messages": USER, "cache_salt": ""}, 400, "cache_salt"),
    ("cache_salt not a string", CHAT, {"messages": USER, "cache_salt": 7}, 400, "cache_salt"),
    ("over-long prompt ids", COMPLETIONS, {"prompt": [5] * 600}, 400, "prompt"),
    ("over-long prompt text", COMPLETIONS, {"prompt": "word " * 2000}, 400, "prompt"),
    ("token id out of vocabulary", COMPLETIONS, {"prompt": [10**6]}, 400, "prompt"),
    ("empty prompt", COMPLETIONS, {"prompt": ""}, 400, "prompt"),
    ("33 prompts", COMPLETIONS, {"prompt": ["a"] * 33}, 400, "prompt"),
    ("an empty prompt among several", COMPLETIONS, {"prompt": [[5, 6], []]}, 400, "prompt"),
    ("echo on chat", CHAT, {"messages": USER, "echo": True}, 400, "echo"),
]


@pytest.mark.parametrize("name,path,body,status,param", CASES, ids=[c[0] for c in CASES])
def test_bad_request_gets_openai_error(server, name, path, body, status, param):
    if isinstance(body, bytes):
        response = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"})
    else:
        response = httpx.post(server.url + path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert "Traceback" not in response.text
    if param is not None:
        assert error["param"] == param, error


@pytest.mark.parametrize("method,path,status", [("GET", "/nowhere", 404), ("GET", CHAT, 405), ("DELETE", "/v1/models", 405)])
def test_wrong_routes_get_openai_errors(server, method, path, status):
    response = httpx.request(method, server.url + path)
    assert response.status_code == status
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_health_is_503_until_the_engine_is_loaded(serve_artifact, monkeypatch):
    from specdec.serve.app import ServerState

    release = threading.Event()
    original = ServerState.load_engine

    def slow_load(self):
        assert release.wait(30)
        original(self)

    monkeypatch.setattr(ServerState, "load_engine", slow_load)
    live = LiveServer(create_app(ServeConfig(artifact=str(serve_artifact), model_name=MODEL))).start()
    try:
        assert httpx.get(live.url + "/health").status_code == 503
        early = httpx.post(live.url + CHAT, json={"messages": USER})
        assert early.status_code == 503 and early.json()["error"]["code"] == "model_not_ready"
        release.set()
        end = time.monotonic() + 30
        while httpx.get(live.url + "/health").status_code != 200:
            assert time.monotonic() < end, "engine never loaded"
            time.sleep(0.05)
        assert httpx.post(live.url + CHAT, json={"messages": USER, "max_tokens": 2}).status_code == 200
        engine = live.app.state.specdec.engine
        # `auto`'s call costs were made ready before /health said ok: no request waits for them
        assert engine.call_costs_source in ("timed", "cache") and len(engine.target_call_costs.prior) == 17
    finally:
        release.set()
        live.stop()
