"""What a server on a network refuses before any route runs: no key, a foreign Host, a non-JSON or too
large body, input past its limits. Never a 5xx, and the server stays up."""

from __future__ import annotations

import json

import httpx
from click.testing import CliRunner

from specdec.cli.main import main
from specdec.serve.guard import host_name, key_matches
from tests.serve.conftest import MODEL, live_server

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "temperature": 0}


def test_keys_guard_every_route_but_health(serve_engine, serve_artifact):
    with live_server(serve_engine, serve_artifact, api_keys=("k-one", "k-two")) as server:
        url = server.url
        assert httpx.get(url + "/health").status_code == 200
        for method, path in [("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/chat/completions")]:
            reply = httpx.request(method, url + path, json=CHAT)
            assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key", path
            assert httpx.request(method, url + path, json=CHAT,
                                 headers={"Authorization": "Bearer k-wrong"}).status_code == 401
            assert httpx.request(method, url + path, json=CHAT,
                                 headers={"Authorization": "Bearer k-two"}).status_code == 200
    with live_server(serve_engine, serve_artifact, api_keys=("k",), public_metrics=True) as server:
        assert httpx.get(server.url + "/metrics").status_code == 200
        assert httpx.get(server.url + "/v1/models").status_code == 401


def test_a_non_loopback_host_without_a_key_refuses_to_start_in_one_line(serve_artifact):
    result = CliRunner().invoke(main, ["serve", str(serve_artifact), "--host", "0.0.0.0", "--port", "0"])
    assert result.exit_code != 0
    assert result.output.strip().count("\n") == 0 and "--allow-no-key" in result.output


def test_bad_input_gets_a_4xx_and_the_server_stays_up(serve_engine, serve_artifact):
    with live_server(serve_engine, serve_artifact) as server:
        post = server.url + "/v1/chat/completions"
        big = json.dumps({**CHAT, "padding": "x" * (2 << 20)})
        assert httpx.post(post, content=big, headers={"content-type": "application/json"}).status_code == 413

        def chunks():  # no Content-Length: cut off while read
            yield json.dumps(CHAT)[:-1].encode() + b', "padding": "'
            for _ in range(40):
                yield b"x" * 65536
            yield b'"}'
        assert httpx.post(post, content=chunks(), headers={"content-type": "application/json"}).status_code == 413
        assert httpx.post(post, content=json.dumps(CHAT), headers={"content-type": "text/plain"}).status_code == 415
        assert httpx.post(post, json=CHAT, headers={"host": "attacker.example"}).status_code == 421
        deep = "[" * 100_000 + "]" * 100_000
        assert httpx.post(post, content=deep, headers={"content-type": "application/json"}).status_code == 400
        many = {**CHAT, "messages": [{"role": "user", "content": "hi"}] * 10_000}
        assert httpx.post(post, json=many).status_code == 400
        assert httpx.post(post, json={**CHAT, "stop": ["x"] * 100}).status_code == 400
        assert httpx.post(post, json={**CHAT, "stop": ["x" * 1000]}).status_code == 400
        huge = httpx.post(post, json={**CHAT, "max_tokens": 10 ** 9})
        assert huge.status_code == 400 and "positions" in huge.json()["error"]["message"]
        assert httpx.post(post, json=CHAT).status_code == 200  # still serving


def test_key_and_host_parsing():
    assert key_matches("Bearer abc", ("x", "abc")) and not key_matches("Bearer abd", ("abc",))
    assert not key_matches(None, ("abc",)) and not key_matches("Basic abc", ("abc",))
    assert host_name("[::1]:8000") == "::1" and host_name("localhost:80") == "localhost"
    assert host_name("127.0.0.1") == "127.0.0.1"


def test_an_artifact_without_a_chat_template_serves_completions(serve_artifact, tmp_path):
    import shutil

    from specdec.runtime import Engine, GenerationConfig
    from specdec.serve import ServeConfig
    from specdec.serve.app import create_app
    from tests.serve.conftest import LiveServer

    plain = tmp_path / "plain"
    shutil.copytree(serve_artifact, plain)
    manifest = json.loads((plain / "specdec.json").read_text())
    manifest["tokenizer"]["chat_template"] = None
    (plain / "specdec.json").write_text(json.dumps(manifest))
    config = ServeConfig(artifact=str(plain), model_name=MODEL, max_batch=2)
    server = LiveServer(create_app(config, load_in_background=False)).start()  # loads and times like the CLI
    try:
        reply = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 6,
                                                                  "temperature": 0}, timeout=60)
        assert reply.status_code == 200
        expected = Engine.load(plain, provider="cpu").generate("Hello", GenerationConfig(max_new_tokens=6)).text
        assert reply.json()["choices"][0]["text"] == expected
        chat = httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=60)
        assert chat.status_code == 400 and "/v1/completions" in chat.json()["error"]["message"]
    finally:
        server.stop()
