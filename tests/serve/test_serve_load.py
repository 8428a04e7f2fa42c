"""The load generator (specdec.benchmarks.serve_load): its pure pieces, and a short run against the live server."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from specdec.benchmarks import serve_load
from specdec.benchmarks.serve_load_client import Record, parse_sse_line
from specdec.benchmarks.serve_load_report import Cell, mismatches, summarize
from specdec.benchmarks.serve_load_server import tree_cpu_seconds
from specdec.models.errors import SpecdecError
from tests.serve.conftest import MODEL


def test_loopback_only():
    assert serve_load.check_loopback("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"
    assert serve_load.check_loopback("http://localhost:1") == "http://localhost:1"
    assert serve_load.check_loopback("http://[::1]:80") == "http://[::1]:80"
    for url in ("http://10.0.0.1:8000", "http://192.168.1.2", "http://example.com", "ftp://127.0.0.1"):
        with pytest.raises(SpecdecError, match="loopback"):
            serve_load.check_loopback(url)
    result = CliRunner().invoke(serve_load.main, ["--url", "http://10.1.2.3:8000"])
    assert result.exit_code == 1 and "loopback" in result.output and "Traceback" not in result.output


def test_rounds_split_a_cells_requests_but_send_at_least_the_waves_asked_per_client():
    assert serve_load.round_sizes(32, 2, 4) == [16, 16]
    assert serve_load.round_sizes(33, 2, 4) == [17, 16]
    assert serve_load.round_sizes(3, 2, 3) == [2, 1]  # no minimum unless asked: fewer requests than clients
    assert serve_load.round_sizes(32, 2, 16) == [16, 16]  # one wave of 16 clients a round
    assert serve_load.round_sizes(32, 2, 16, min_waves=2) == [32, 32]
    assert serve_load.round_sizes(32, 2, 4, min_waves=2) == [16, 16]


def test_a_cells_rounds_send_every_case_before_any_twice_and_start_apart():
    def cases_sent(requests, repeats, clients, cases):
        sizes = serve_load.round_sizes(requests, repeats, clients)
        starts = [serve_load.round_start(sizes, r, clients, cases) for r in range(repeats)]
        return starts, [(start + i) % cases for start, size in zip(starts, sizes) for i in range(size)]

    # 16 requests over 2 rounds of a 16-case set: each case once (not cases 0-7 and 1-8, as rounds offset by
    # the clients sent, which left half the set out of the 1-client cell)
    for clients in (1, 4, 8):
        starts, sent = cases_sent(16, 2, clients, 16)
        assert sorted(sent) == list(range(16)) and starts == [0, 8]
    # Whole passes a round: each round still starts elsewhere, and the cell sends each case equally often
    starts, sent = cases_sent(48, 3, 4, 16)
    assert starts == [0, 20, 40] and all(sent.count(case) == 3 for case in range(16))
    assert len(set(cases_sent(48, 3, 1, 16)[0])) == 3


def test_summary_figures_by_hand():
    cell = Cell("s", "ngram", 2, seconds=4.0, records=[
        Record("a", ok=True, ttft=0.1, e2e=1.0, tokens=10, target_calls=5, drafted=12, accepted=6),
        Record("b", ok=True, ttft=0.3, e2e=3.0, tokens=30, target_calls=11, drafted=20, accepted=14),
        Record("c", ok=False, error="HTTP 429")])
    s = summarize(cell)
    assert (s["requests"], s["errors"], s["tokens"]) == (3, 1, 40)
    assert s["tokens_per_second"] == 10.0
    assert s["ttft_p50"] == pytest.approx(0.2) and s["ttft_p99"] == pytest.approx(0.298)
    assert s["e2e_p50"] == pytest.approx(2.0)
    assert s["tokens_per_target_call"] == pytest.approx((40 - 2) / (16 - 2))  # prefill calls left out
    assert s["acceptance_rate"] == pytest.approx(20 / 32)
    assert summarize(Cell("s", "none", 1))["ttft_p50"] is None


def test_open_loop_summary_by_hand():
    from specdec.benchmarks.serve_load_stats import GoodputTargets

    cell = Cell("s", "none", None, rate=2.0, seconds=4.0, send_times=[[0.0, 0.5, 1.0]], records=[
        # one token per chunk, 0.2 s apart: ITL 0.2 x 4, TPOT 0.8 / 4 = 0.2 (misses the 0.1 s target)
        Record("a", ok=True, ttft=0.2, e2e=1.0, tokens=5, chunk_times=[0.2, 0.4, 0.6, 0.8, 1.0]),
        # a chunk of 4 tokens 0.2 s after the first: ITL 0.05 x 4, TPOT 0.05
        Record("b", ok=True, ttft=0.1, e2e=0.5, tokens=5, chunk_times=[0.1, 0.3], chunk_tokens=[1, 5]),
        Record("c", ok=False, error="cancelled at the time limit")])
    s = summarize(cell)
    assert (s["requests"], s["errors"], s["tokens"], s["rate"], s["concurrency"]) == (3, 1, 10, 2.0, None)
    assert s["tokens_per_second"] == 2.5 and s["request_throughput"] == 0.5 and s["send_rate"] == 2.0
    assert s["itl_p50"] == pytest.approx(0.125) and s["itl_p90"] == pytest.approx(0.2)  # 4 x 0.05, 4 x 0.2
    assert s["tpot_p50"] == pytest.approx(0.125) and s["ttft_p50"] == pytest.approx(0.15)
    assert s["good_requests"] == 1 and s["goodput"] == 0.25 and s["goodput_share"] == pytest.approx(1 / 3)
    loose = summarize(cell, GoodputTargets(ttft=0.5, itl=0.25))
    assert loose["good_requests"] == 2 and loose["goodput_targets"] == {"ttft": 0.5, "itl": 0.25, "e2el": None}
    assert summarize(cell, GoodputTargets(ttft=0.5, itl=0.25, e2el=0.9))["good_requests"] == 1  # a's e2e is 1.0


def test_rounds_alternate_and_mismatches_are_found():
    order = list(serve_load.rounds(["p", "r"], ["none", "ngram"], [1, 4], repeats=2))
    assert order[:8] == [(1, 0, "p", "none"), (1, 0, "p", "ngram"), (1, 0, "r", "none"), (1, 0, "r", "ngram"),
                         (1, 1, "r", "ngram"), (1, 1, "r", "none"), (1, 1, "p", "ngram"), (1, 1, "p", "none")]
    assert len(order) == 16 and {o[0] for o in order[8:]} == {4}
    same = [Cell("p", d, 1, records=[Record("x", ok=True, text="hi")]) for d in ("none", "ngram")]
    assert mismatches(same) == []
    same[1].records.append(Record("y", ok=True, text="a"))
    same[0].records.append(Record("y", ok=True, text="b"))
    assert mismatches(same) == ["y"]
    assert parse_sse_line("data: [DONE]") is None and parse_sse_line(": ping") is None
    assert parse_sse_line('data: {"a": 1}') == {"a": 1}


def test_a_short_run_against_the_live_server(server, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": f"p{i}", "prompt": f"Count {i} red foxes and {i} hens."})
                                 for i in range(3)))
    result = CliRunner().invoke(serve_load.main, [
        "--url", f"tiny={server.url}", "--concurrency", "1,3", "--drafters", "none,model", "--requests", "3",
        "--rounds", "2", "--max-tokens", "12", "--prompts", str(prompts), "--model", MODEL,
        "--output", str(tmp_path / "out"), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    summaries = report["summaries"]
    assert [(s["concurrency"], s["drafter"]) for s in summaries] == [(1, "none"), (1, "model"), (3, "none"),
                                                                      (3, "model")]
    for s in summaries:
        assert s["requests"] == 3 and s["errors"] == 0 and 0 < s["tokens"] <= 36, s
        assert s["tokens_per_second"] > 0 and 0 < s["ttft_p50"] <= s["e2e_p50"] <= s["e2e_p99"]
    assert summaries[0]["tokens_per_target_call"] == 1.0  # target-only: one token per decode call
    assert report["setup"]["equal_texts"] == "yes"  # greedy: the draft model changes no text
    saved = json.loads((tmp_path / "out" / "serve_load.json").read_text())
    assert sum(len(c["records"]) for c in saved["cells"]) == 12
    assert "| tiny | 3 | draft model | 3 |" in (tmp_path / "out" / "serve_load.md").read_text()


def test_tree_cpu_seconds_counts_children(tmp_path):
    import os
    import subprocess
    import sys
    import time

    if not os.path.isdir("/proc"):
        pytest.skip("reads /proc")
    # a parent that sleeps, with a child that burns CPU until killed: the child's CPU counts for the parent's tree
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, "
                               "'-c', 'while True: pass']); time.sleep(60)"], start_new_session=True)
    try:
        end = time.monotonic() + 30
        while tree_cpu_seconds(parent.pid) < 0.3 and time.monotonic() < end:
            time.sleep(0.1)
        assert tree_cpu_seconds(parent.pid) >= 0.3
    finally:
        os.killpg(parent.pid, 9)
        parent.wait()
