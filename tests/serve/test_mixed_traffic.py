"""Production traffic mixed under load: schemas, required and auto tool calls, a prediction, logprobs,
penalties and seeded sampling, streamed and not, among bad requests and cancelled streams, 8 clients on the
batch engine. Every answer equals the same request's answer alone; bad ones get a 400; the server still serves."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.serve.conftest import MODEL, assembled_chat_stream, live_server
from tests.serve.test_structured_serve import PERSON, WEATHER

QUESTIONS = ["Weather in Paris?", "the the the the red red", "one two three one two", "Hello world"]
PREDICTED = "the the the the red red red red blue blue blue"


def _bodies() -> list[tuple[str, dict]]:
    """Return (name, chat body) of every kind of good request, greedy but for the seeded ones."""
    bodies = []
    for n, question in enumerate(QUESTIONS):
        base = {"messages": [{"role": "user", "content": question}], "max_tokens": 16, "temperature": 0}
        bodies += [
            (f"schema/{n}", {**base, "response_format": {"type": "json_schema",
                                                         "json_schema": {"name": "person", "schema": PERSON}}}),
            (f"required/{n}", {**base, "max_tokens": 64, "tools": [WEATHER], "tool_choice": "required"}),
            (f"auto/{n}", {**base, "max_tokens": 64, "tools": [WEATHER], "tool_choice": "auto"}),
            (f"prediction/{n}", {**base, "prediction": {"type": "content", "content": PREDICTED}}),
            (f"logprobs/{n}", {**base, "logprobs": True, "top_logprobs": 3}),
            (f"penalties/{n}", {**base, "presence_penalty": 0.8, "frequency_penalty": 0.5}),
            (f"seeded/{n}", {**base, "temperature": 1.0, "top_p": 0.95, "seed": 40 + n}),
        ]
    return bodies


BAD = [  # (body, the parameter its 400 names)
    ({"top_logprobs": 50, "logprobs": True}, "top_logprobs"),
    ({"prediction": {"type": "content", "content": 5}}, "prediction"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}}, "response_format"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"presence_penalty": 7}, "presence_penalty"),
]


def _answer(client: httpx.Client, body: dict, stream: bool) -> tuple:
    """Return (status, answer): the answer's text, its calls (name, arguments as JSON), finish reason and
    (token, logprob) pairs, read from the whole reply or the assembled stream."""
    body = {**body, "model": MODEL, "stream": stream}
    if not stream:
        reply = client.post("/v1/chat/completions", json=body)
        if reply.status_code != 200:
            return reply.status_code, reply.json()
        choice = reply.json()["choices"][0]
        calls = [(c["function"]["name"], _arguments(c["function"]["arguments"]))
                 for c in choice["message"].get("tool_calls") or []]
        entries = (choice.get("logprobs") or {}).get("content") or []
        return 200, (choice["message"].get("content") or "", calls, choice["finish_reason"],
                     [(e["token"], e["logprob"]) for e in entries])
    with client.stream("POST", "/v1/chat/completions", json=body) as reply:
        if reply.status_code != 200:
            return reply.status_code, json.loads(reply.read())
        text, calls, finish, entries = assembled_chat_stream(reply.iter_lines())
    return 200, (text, [(name, _arguments(arguments)) for name, arguments in calls], finish, entries)


def _arguments(text: str):
    """Return a call's arguments as JSON, or as text where max_tokens cut them."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _same(a: tuple, b: tuple) -> bool:
    """Whether two answers agree: text, calls and finish exactly, logprobs within 1e-4."""
    return a[:3] == b[:3] and [t for t, _ in a[3]] == [t for t, _ in b[3]] and all(
        abs(x - y) <= 1e-4 for (_, x), (_, y) in zip(a[3], b[3]))


def test_mixed_production_traffic_under_load_answers_as_alone(serve_engine, serve_artifact):
    bodies = _bodies()
    with live_server(serve_engine, serve_artifact, max_batch=8, num_draft_tokens="auto", max_queue=64) as live:
        with httpx.Client(base_url=live.url, timeout=120) as client:
            alone = {}
            for name, body in bodies:
                status, alone[name] = _answer(client, body, stream=False)
                assert status == 200, (name, alone[name])
            assert any(answer[1] for name, answer in alone.items() if name.startswith("required"))
            jobs = [("good", name, body, stream) for name, body in bodies for stream in (False, True)]
            jobs += [("bad", param, {"messages": [{"role": "user", "content": "x"}], **body}, stream)
                     for body, param in BAD for stream in (False, True)]
            jobs += [("cancel", str(n), {"messages": [{"role": "user", "content": q}], "max_tokens": 64}, True)
                     for n, q in enumerate(QUESTIONS)]
            random.Random(0).shuffle(jobs)

            def run(job: tuple) -> str | None:
                kind, name, body, stream = job
                if kind == "cancel":  # read two events, then hang up
                    with client.stream("POST", "/v1/chat/completions",
                                       json={**body, "model": MODEL, "stream": True}) as reply:
                        for _, _line in zip(range(2), reply.iter_lines()):
                            pass
                    return None if reply.status_code == 200 else f"cancelled {name}: {reply.status_code}"
                status, answer = _answer(client, body, stream)
                if kind == "bad":
                    ok = status == 400 and answer["error"]["param"].startswith(name)
                    return None if ok else f"bad {name}: {status} {answer}"
                if status != 200 or not _same(answer, alone[name]):
                    return f"{name} (stream {stream}): {status} {answer} != {alone[name]}"
                return None

            with ThreadPoolExecutor(8) as pool:
                failures = [f for f in pool.map(run, jobs) if f]
            assert not failures, "\n".join(failures[:3])
            assert client.get("/health").status_code == 200
        assert live.state.batch.kv_usage == 0.0
