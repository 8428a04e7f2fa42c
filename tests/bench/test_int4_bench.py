"""The int4 bench's arithmetic (speedups, goals) and the profile reader, on records made up for the test."""

import pytest

from specdec.benchmarks.int4 import GENAI_PLAIN, goals, markdown, summarize
from specdec.benchmarks.int4_profile import summarize_profile
from specdec.benchmarks.runner import BASELINE


def _rec(system, config, prompt, group, tps, repeat=0, tokens=(1, 2, 3), theory=1.0):
    return {"system": system, "config": config, "repeat": repeat, "prompt": prompt, "group": group,
            "token_ids": list(tokens), "decode_tps": tps, "alpha": 0.5, "c": 0.3, "tokens_per_call": 1.5,
            "theory": theory, "by_situation": {}}


def test_speedups_are_per_repeat_against_the_same_systems_baseline():
    records = []
    for repeat, load in ((0, 1.0), (1, 0.5)):  # the second repeat ran on a box twice as slow: ratios hold
        records += [_rec("fp32", BASELINE, "story", "open", 20 * load, repeat),
                    _rec("fp32", "int4 draft auto", "story", "open", 30 * load, repeat, theory=1.6),
                    _rec("int4", BASELINE, "rewrite", "grounded", 40 * load, repeat),
                    _rec("int4", "ngram auto", "rewrite", "grounded", 100 * load, repeat, tokens=(1, 2, 4)),
                    _rec("genai", GENAI_PLAIN, "rewrite", "grounded", 50 * load, repeat)]
    rows = {(r["system"], r["config"]): r for r in summarize(records)}
    assert rows[("fp32", "int4 draft auto")]["speedup"] == pytest.approx(1.5)
    assert rows[("fp32", "int4 draft auto")]["theory"] == pytest.approx(1.6)
    assert rows[("int4", "ngram auto")]["speedup"] == pytest.approx(2.5)
    assert rows[("int4", "ngram auto")]["greedy_equal"] is False  # one token differs from target-only
    assert rows[("int4", BASELINE)]["vs_genai"] == pytest.approx(0.8)
    met = {goal.split(":")[0].split(" >=")[0]: ok for goal, _, ok in goals(list(rows.values()))}
    assert met["specdec int4 target-only decode"] is False  # 0.8x genai
    assert met["fp32 + int4 draft auto"] is True  # 1.5x open, never below 1.0x, equal tokens
    assert met["int4 target + prompt lookup"] is False  # 2.5x but not greedy-equal
    report = markdown({"date": "d", "setup": "s", "rows": list(rows.values()), "goals": goals(list(rows.values()))})
    assert "| 1.60x |" in report and "| NO |" in report


def test_profile_summary_assigns_kernels_to_their_run_and_skips_warmup():
    events = [{"cat": "Session", "name": "model_run", "ts": 0, "dur": 100},  # prefill: skipped
              {"cat": "Node", "name": "a_kernel_time", "ts": 10, "dur": 90, "args": {"op_name": "MatMulNBits"}},
              {"cat": "Session", "name": "model_run", "ts": 200, "dur": 50},
              {"cat": "Node", "name": "b_kernel_time", "ts": 210, "dur": 30, "args": {"op_name": "MatMulNBits"}},
              {"cat": "Node", "name": "c_kernel_time", "ts": 240, "dur": 8, "args": {"op_name": "Mul"}},
              {"cat": "Session", "name": "model_run", "ts": 300, "dur": 70},
              {"cat": "Node", "name": "b_kernel_time", "ts": 310, "dur": 50, "args": {"op_name": "MatMulNBits"}},
              {"cat": "Node", "name": "fence_before", "ts": 320, "dur": 5, "args": {"op_name": "Mul"}}]
    s = summarize_profile(events, skip_runs=1)
    assert s["runs"] == 2 and s["model_run_ms"] == pytest.approx(0.060)
    assert s["kernels_ms"] == pytest.approx(0.044)
    assert s["by_op"] == pytest.approx({"MatMulNBits": 0.040, "Mul": 0.004})
    assert list(s["by_op"]) == ["MatMulNBits", "Mul"]
