"""serve_load's scenarios (--turns, --burst, --prefill-lengths) end to end: against a fake OpenAI-compatible
server on 127.0.0.1 that streams with set timings and exports specdec's TTFT parts, reached as a specdec server
and as a plain one at once; and a short multi-turn and prefill run against the live specdec server."""

from __future__ import annotations

import json
import threading
import time

import pytest
from click.testing import CliRunner

from specdec.benchmarks import serve_load
from specdec.benchmarks.serve_load_prompts import count_tokens
from specdec.benchmarks.serve_load_workloads import FOLLOW_UPS, LONG_PROMPTS
from tests.bench.test_serve_load_scenarios import trained_bpe
from tests.serve.conftest import MODEL, live_server
from tests.serve.fake_sse import SSEHandler, loopback_server

LONG_GAP, SLOW_GAP, SLOW_SECONDS = 0.01, 0.08, 0.3  # a running request's gap, and while a new prompt arrives
EOS_AFTER = 150  # a running request without ignore_eos ends here (the model's end of text)


class _Handler(SSEHandler):
    def do_GET(self) -> None:
        from prometheus_client import generate_latest

        body = generate_latest(self.server.registry) if self.path == "/metrics" else b""
        self.send_response(200 if self.path in ("/health", "/metrics") else 404)
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.seen.append((self.path, body))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        if self.path == "/v1/completions":
            prompt_tokens = count_tokens(self.server.tokenizer, body["prompt"])
            self._stream([0.0001 * prompt_tokens], "text", prompt_tokens, "drafter" in body)
            return
        last = body["messages"][-1]["content"]
        if any(prompt in last for prompt in LONG_PROMPTS):
            chunks = body["max_tokens"] if body.get("ignore_eos") else min(EOS_AFTER, body["max_tokens"])
            self._stream([LONG_GAP] * chunks, "content", 10, "drafter" in body, slow=True)
            return
        self.server.slow_until = time.perf_counter() + SLOW_SECONDS  # a new prompt's prefill slows the others
        first = 0.08 if len(body["messages"]) == 1 else 0.02  # a later turn's prefix is cached
        self._stream([first, 0.005, 0.005], "content", 10 * len(body["messages"]), "drafter" in body)

    def _stream(self, gaps: list[float], key: str, prompt_tokens: int, specdec: bool, slow: bool = False) -> None:
        start = time.perf_counter()
        for i, gap in enumerate(gaps):
            time.sleep(SLOW_GAP if slow and time.perf_counter() < self.server.slow_until else gap)
            delta = {"text": f"t{i} "} if key == "text" else {"delta": {"content": f"t{i} "}}
            self._send({"choices": [{"index": 0, **delta}]})
            if i == 0 and specdec:  # where the first token's time went, as specdec's /metrics tells it
                for part, seconds in (("server", 0.001), ("prefill", time.perf_counter() - start - 0.001)):
                    self.server.parts.labels(MODEL, part).observe(seconds)
        self._send({"choices": [{"index": 0, "finish_reason": "length", **({"text": ""} if key == "text" else
                                                                          {"delta": {}})}]})
        self._send({"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(gaps)}})
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def fake_server():
    from prometheus_client import CollectorRegistry, Histogram

    registry = CollectorRegistry()
    parts = Histogram("specdec:ttft_part_seconds", "parts", ["model_name", "part"], registry=registry)
    with loopback_server(_Handler, seen=[], lock=threading.Lock(), slow_until=0.0, tokenizer=trained_bpe(),
                         registry=registry, parts=parts) as server:
        yield server


def _prompts(tmp_path) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"id": f"p{i}", "prompt": f"Fox {i} runs far. Hen {i} sits. Owl {i} hoots."})
                              for i in range(3)))
    return str(path)


def _run(fake_server, tmp_path, *args: str):
    result = CliRunner().invoke(serve_load.main, [
        "--url", f"spec={fake_server.url}", "--url", f"plain={fake_server.url}", "--plain", "plain",
        "--drafters", "none", "--rounds", "1", "--prompts", _prompts(tmp_path), "--model", MODEL,
        "--output", str(tmp_path / "out"), "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), (tmp_path / "out" / "serve_load.md").read_text()


def test_turn_two_sends_the_streamed_answer_and_a_follow_up_to_every_server(fake_server, tmp_path):
    report, table = _run(fake_server, tmp_path, "--turns", "2", "--concurrency", "2", "--requests", "3")
    assert report["setup"]["mode"] == "turns"
    spec, plain = report["summaries"]
    for s in (spec, plain):
        assert (s["requests"], s["errors"], s["turn1"]["requests"], s["turn2"]["requests"]) == (6, 0, 3, 3)
        assert s["turn2"]["ratio_p50"] < 0.6 and s["turn2"]["prompt_tokens_mean"] == 30  # 3 messages
    chats = [body for path, body in fake_server.seen[2:] if path == "/v1/chat/completions"]  # after 2 warm-ups
    seconds = [body["messages"] for body in chats if len(body["messages"]) == 3]
    assert len(seconds) == 6
    for first, answer, question in seconds:
        assert first["content"].startswith("Request ") and answer == {"role": "assistant", "content": "t0 t1 t2 "}
        assert question["role"] == "user" and question["content"] in FOLLOW_UPS
    assert len({json.dumps(m) for m in seconds}) == 3  # both servers got the same three conversations
    assert all("drafter" not in body for body in chats if "ignore_eos" in body)
    # specdec gets each decoding's own prefix-cache namespace; the plain server only OpenAI's fields
    assert {body.get("cache_salt") for body in chats if "drafter" in body} == {"decoding-none"}
    assert not any("cache_salt" in body for body in chats if "drafter" not in body)
    assert "| spec | 2 | target-only | 2 | 3 | 30 |" in table
    assert spec["ttft_parts_ms"]["sum"] > 0 and plain["ttft_parts_ms"] == {}  # /metrics read for specdec only
    assert "| spec | 2 | target-only | 1.0 |" in table and "| plain | 2 | target-only | 1.0 |" not in table


def test_a_think_time_holds_each_next_turn_back(fake_server, tmp_path):
    """--think-time S: a client sends turn 2 S seconds after its answer ended, as a user reading it (an idle server
    meanwhile re-prefills the reply); the setup says so."""
    report, table = _run(fake_server, tmp_path, "--turns", "2", "--concurrency", "1", "--requests", "2",
                         "--think-time", "0.4")
    assert "sent 0.4 s after the answer ended" in report["setup"]["setup"]
    for s in report["summaries"]:  # two conversations, each waiting once
        assert s["turn2"]["requests"] == 2 and s["seconds"] >= 0.8, s["seconds"]
    (tmp_path / "quick").mkdir()
    quick, _ = _run(fake_server, tmp_path / "quick", "--turns", "2", "--concurrency", "1", "--requests", "2")
    assert all(s["seconds"] < 0.8 for s in quick["summaries"]) and "as soon as" in quick["setup"]["setup"]


def test_a_burst_slows_the_running_requests_gaps(fake_server, tmp_path):
    report, table = _run(fake_server, tmp_path, "--burst", "3", "--burst-running", "2", "--max-tokens", "4")
    spec, plain = report["summaries"]
    for s in (spec, plain):
        assert s["requests"] == 5 and s["errors"] == 0 and s["idle_gaps"] > 50 and s["burst_gaps"] >= 2
        assert s["idle_itl_p50"] < SLOW_GAP / 2 and s["burst_itl_p99"] >= SLOW_GAP * 0.9
        assert s["itl_p99_ratio"] > 1.5 and s["burst_ttft_p50"] >= 0.08
    # ignore_eos goes to the plain server only: specdec refuses it, and its requests end at their end of text
    assert plain["running_tokens"] == [192, 192] and spec["running_tokens"] == [EOS_AFTER, EOS_AFTER]
    burst = [body for _, body in fake_server.seen if "Request" in body["messages"][-1]["content"]
             and not any(p in body["messages"][-1]["content"] for p in LONG_PROMPTS)]
    assert len({b["messages"][0]["content"] for b in burst}) == 3  # distinct prompts; the same on both servers
    assert "| spec | 3 | target-only | 5 |" in table and "p99 burst / idle" in table


def test_prefill_prompts_are_exact_and_each_new(fake_server, tmp_path):
    tokenizer_dir = tmp_path / "art" / "tokenizer"
    tokenizer_dir.mkdir(parents=True)
    fake_server.tokenizer.save(str(tokenizer_dir / "tokenizer.json"))
    report, table = _run(fake_server, tmp_path, str(tmp_path / "art"), "--prefill-lengths", "8,40", "--rounds", "2")
    assert [(s["server"], s["load"]) for s in report["summaries"]] == [("spec", 8), ("spec", 40), ("plain", 8),
                                                                       ("plain", 40)]
    for s in report["summaries"]:
        assert s["requests"] == 2 and s["prompt_tokens_reported"] == [s["load"]] and s["prompt_tokens_per_second"] > 0
    prompts = [body["prompt"] for path, body in fake_server.seen if path == "/v1/completions"]
    assert len(prompts) == 12 and len(set(prompts)) == 6  # 2 lengths x (a warm-up + 2 rounds), once per server
    assert len({p[:6] for p in prompts}) == 6  # every prompt starts elsewhere: no prefix cache holds one
    assert "| spec | 40 | 2 | 40 |" in table


def test_scenarios_are_runs_of_their_own(fake_server, tmp_path):
    for args, message in ((["--turns", "2", "--burst", "2"], "each is a run of its own"),
                          (["--rate", "1", "--prefill-lengths", "8"], "each is a run of its own"),
                          (["--burst", "2", "--plot", str(tmp_path / "p.png")], "--plot draws"),
                          (["--prefill-lengths", "8"], "needs ARTIFACT")):
        result = CliRunner().invoke(serve_load.main, ["--url", fake_server.url, *args])
        assert result.exit_code != 0 and message in result.output, (args, result.output)
    assert fake_server.seen == []  # refused before any request


def test_turns_and_prefill_against_the_live_server(serve_engine, serve_artifact, tmp_path):
    prompts = _prompts(tmp_path)  # short: the tiny model has 512 positions and a small vocabulary
    with live_server(serve_engine, serve_artifact, max_batch=2, kv_capacity=256, prefix_cache=True) as server:
        for args in (["--turns", "2", "--concurrency", "2", "--requests", "2", "--max-tokens", "6"],
                     [str(serve_artifact), "--prefill-lengths", "12", "--rounds", "1"]):
            result = CliRunner().invoke(serve_load.main, [
                "--url", f"tiny={server.url}", "--drafters", "none", "--rounds", "1", "--model", MODEL, "--json",
                "--prompts", prompts, *args])
            assert result.exit_code == 0, result.output
            [s] = json.loads(result.stdout)["summaries"]
            assert s["errors"] == 0 and s["requests"] >= 1
            # the batch engine tells where each first token's time went: the parts add up to about the TTFT
            parts = s["ttft_parts_ms"]
            assert parts["prefill"] > 0 and 0 < parts["sum"] <= 1000 * s["ttft_mean"] * 1.5
    assert s["prompt_tokens_reported"] == [12]
