"""serve_load's open loop (--rate) end to end, against a tiny fake OpenAI-compatible streaming server on
127.0.0.1 whose timings each prompt sets ("ttft=0.02 gap=0.01 chunks=4 per=1"): bounded in requests and time."""

from __future__ import annotations

import json
import threading
import time

import pytest
from click.testing import CliRunner

from specdec.benchmarks import serve_load
from specdec.benchmarks.serve_load_stats import arrival_times
from tests.serve.fake_sse import SSEHandler, loopback_server

HANG_SECONDS = 60.0  # a "hang" request streams nothing for this long unless the server stops first


class _Handler(SSEHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["messages"][0]["content"]
        self.server.seen.append(prompt)
        spec = dict(part.split("=") for part in prompt.split() if "=" in part)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        if "hang" in prompt:
            self.server.stopping.wait(HANG_SECONDS)
            return
        chunks, per = int(spec.get("chunks", 4)), int(spec.get("per", 1))
        # the running token count with each chunk only when asked for (vLLM's continuous_usage_stats)
        counts = body.get("stream_options", {}).get("continuous_usage_stats") and spec.get("usage") == "1"
        self._send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        time.sleep(float(spec.get("ttft", 0.02)))
        for i in range(chunks):
            if i:
                time.sleep(float(spec.get("gap", 0.01)))
            event = {"choices": [{"index": 0, "delta": {"content": "ab"[i % 2] * per}}]}
            if counts:
                event["usage"] = {"prompt_tokens": 3, "completion_tokens": per * (i + 1)}
            self._send(event)
        self._send({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
        self._send({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": per * chunks}})
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def fake_server():
    with loopback_server(_Handler, seen=[], stopping=threading.Event()) as server:
        try:
            yield server
        finally:
            server.stopping.set()  # a hanging request ends before the server shuts down


def _prompts(tmp_path, *texts: str):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"id": f"p{i}", "prompt": t}) for i, t in enumerate(texts)))
    return str(path)


def test_open_loop_reports_itl_and_goodput_and_sends_on_schedule(fake_server, tmp_path):
    texts = ["fast ttft=0.02 gap=0.01 chunks=4",
             "late ttft=1.2 gap=0.01 chunks=4",  # misses the TTFT target
             "slow ttft=0.02 gap=0.5 chunks=3",  # misses the ITL (TPOT) target
             "multi ttft=0.02 gap=0.2 chunks=3 per=2 usage=1"]  # 2 tokens a chunk, with the running count
    prompts = _prompts(tmp_path, *texts)
    result = CliRunner().invoke(serve_load.main, [
        "--url", f"fake={fake_server.url}", "--plain", "fake", "--rate", "20", "--seed", "3", "--requests", "8",
        "--rounds", "1", "--prompts", prompts, "--goodput-ttft", "0.8", "--goodput-itl", "0.25",
        "--output", str(tmp_path / "out"), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["setup"]["mode"] == "open" and "TTFT <= 0.8 s, TPOT <= 0.25 s" == report["setup"]["goodput"]
    [s] = report["summaries"]
    assert (s["rate"], s["concurrency"], s["requests"], s["errors"], s["not_sent"]) == (20.0, None, 8, 0, 0)
    assert s["tokens"] == 2 * (4 + 4 + 3 + 6)
    assert s["good_requests"] == 4 and s["goodput_share"] == 0.5  # fast and multi, twice each
    assert s["ttft_p99"] >= 1.2 and s["itl_p99"] >= 0.5  # the sleeps set floors only
    assert s["send_rate"] > 0 and s["request_throughput"] > 0 and s["tokens_per_second"] > 0
    for key in ("ttft", "itl", "tpot", "e2e"):
        assert s[f"{key}_p50"] <= s[f"{key}_p90"] <= s[f"{key}_p99"], key
    # the warm-up request (the first prompt), then the 8 of the cell, cycling over the prompts
    assert fake_server.seen[0] == texts[0] and sorted(fake_server.seen[1:]) == sorted(texts * 2)
    saved = json.loads((tmp_path / "out" / "serve_load.json").read_text())
    [cell] = saved["cells"]
    records = cell["records"]
    assert [r["prompt_id"] for r in records] == ["p0", "p1", "p2", "p3"] * 2
    # no request is sent before its Poisson time (seed 3, round 0); asyncio may wake a tick early
    schedule = arrival_times(8, 20.0, (3, 0), "poisson")
    assert all(r["sent"] >= at - 0.002 for r, at in zip(records, schedule))
    assert cell["send_times"] == [[r["sent"] for r in records]]
    multi = records[3]
    assert multi["chunk_tokens"] == [2, 4, 6] and len(multi["chunk_times"]) == 3 and multi["tokens"] == 6
    assert records[0]["chunk_tokens"] == [] and len(records[0]["chunk_times"]) == 4


def test_open_loop_stops_at_the_time_limit(fake_server, tmp_path):
    prompts = _prompts(tmp_path, "fast ttft=0.02 chunks=2", "hang")
    start = time.monotonic()
    result = CliRunner().invoke(serve_load.main, [
        "--url", f"fake={fake_server.url}", "--plain", "fake", "--rate", "2", "--arrivals", "constant",
        "--requests", "10", "--rounds", "1", "--prompts", prompts, "--time-limit", "1.5", "--json"])
    elapsed = time.monotonic() - start
    assert result.exit_code == 0, result.output
    [s] = json.loads(result.stdout)["summaries"]
    # sends at 0, 0.5 and 1.0 s; 1.5 s is past the limit (the warm-up came first): the rest never go out
    assert s["requests"] + s["not_sent"] == 10 and s["not_sent"] >= 7
    assert s["errors"] >= 1 and "cancelled at the time limit" in result.stderr
    assert s["requests"] - s["errors"] >= 1  # the fast ones finished
    assert elapsed < HANG_SECONDS / 3  # the hanging request did not hold the run


def test_rate_and_concurrency_are_one_or_the_other(fake_server):
    result = CliRunner().invoke(serve_load.main, ["--url", fake_server.url, "--rate", "2", "--concurrency", "4"])
    assert result.exit_code == 2 and "not both" in result.output
    result = CliRunner().invoke(serve_load.main, ["--url", fake_server.url, "--rate", "0"])
    assert result.exit_code == 2 and "must be > 0" in result.output
    assert fake_server.seen == []  # refused before any request
