"""The batch bound's replay arithmetic, and the tool run end to end on a tiny artifact."""

import json
import subprocess
import sys

import pytest

from specdec.benchmarks.batch_bound import Trace, replay, step_pricer


def _flat(fed):
    return 1.0  # a step costs the same whatever it feeds: a memory-bound call


def _linear(fed):
    return float(sum(fed))  # every fed token costs the same: a compute-bound call


COPY = Trace("copy", "grounded", drafted=(3, 3, 3, 3), accepted=(3, 3, 3, 3))  # 16 tokens in 4 iterations
OPEN = Trace("open", "open", drafted=(0,) * 16, accepted=(0,) * 16)  # 16 tokens, nothing accepted


def test_nothing_accepted_gains_nothing():
    plain, oracle = (replay([OPEN], 4, policy, _flat) for policy in ("plain", "oracle"))
    assert oracle.tokens_per_second == pytest.approx(plain.tokens_per_second)


def test_memory_bound_steps_gain_the_tokens_per_iteration():
    plain, oracle = (replay([COPY], 4, policy, _flat) for policy in ("plain", "oracle"))
    assert oracle.tokens_per_second / plain.tokens_per_second == pytest.approx(4.0)
    assert oracle.steps * 4 == plain.steps


def test_compute_bound_steps_gain_nothing_and_waste_costs():
    wasteful = Trace("miss", "grounded", drafted=(4,) * 16, accepted=(0,) * 16)
    plain, oracle = (replay([COPY, OPEN], 2, policy, _linear) for policy in ("plain", "oracle"))
    assert oracle.tokens_per_second == pytest.approx(plain.tokens_per_second)
    assert replay([wasteful], 2, "lookup", _linear).tokens_per_second == pytest.approx(
        replay([wasteful], 2, "plain", _linear).tokens_per_second / 5)


def test_every_step_is_a_full_batch_and_lanes_rotate_prompts():
    run = replay([COPY, OPEN], 3, "plain", _linear, requests_per_lane=2)
    assert run.verify_tokens == run.steps * 3 == run.tokens  # plain: one token per lane a step
    with pytest.raises(ValueError):
        replay([COPY], 1, "greedy", _flat)


def test_step_pricer_takes_the_cheaper_plain_call_and_interpolates_ragged():
    price = step_pricer(0.030, {8: 0.032, 16: 0.048, 24: 0.060})
    assert price([1] * 8) == 0.030
    assert price([2] * 8) == 0.048
    assert price([1] * 4 + [3] * 4) == 0.048
    assert price([1] * 8 + [4]) == pytest.approx(0.032 + 0.016 * 4 / 8)  # 12 tokens: between 8 and 16
    assert price([4] * 8) == pytest.approx(0.060 + 0.012 * 8 / 8)  # 32: the last line extended
    assert step_pricer(None, {8: 0.032, 16: 0.048})([1] * 8) == 0.032  # no batched call: the ragged one


def test_bound_tool_runs_on_a_tiny_artifact(tiny_close_artifacts, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": i, "group": g, "prompt": p, "chat": False}) for i, g, p in (
        ("copy", "grounded", "1 2 3 4 1 2 3 4 1 2 3 4 1 2"), ("open", "open", "The cat sat on"))))
    run = subprocess.run([sys.executable, "-m", "specdec.benchmarks.batch_bound", str(tiny_close_artifacts["llama"]),
                          "--prompts", str(prompts), "--lanes", "2,8", "-k", "4", "--max-new-tokens", "12",
                          "--threads", "1", "--repeats", "1", "--json"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert [row["lanes"] for row in report["lanes"]] == [2, 8]
    assert [t["prompt_id"] for t in report["traces"]] == ["copy", "open"]
    for trace in report["traces"]:
        assert sum(trace["accepted"]) <= sum(trace["drafted"]) and max(trace["drafted"]) <= 4
    for row in report["lanes"]:
        assert min(map(int, row["ragged_call_s"])) == row["lanes"] and all(s > 0 for s in row["ragged_call_s"].values())
        assert row["oracle_tok_s"] >= row["lookup_tok_s"] * 0.999  # the oracle verifies a subset of lookup's drafts
        # a flat step: both gain exactly the tokens per iteration, the oracle no less than lookup
        assert row["flat_oracle_vs_plain"] == pytest.approx(row["flat_lookup_vs_plain"])
        assert row["flat_oracle_vs_plain"] >= 1.0


def test_bound_tool_refuses_a_missing_artifact_in_one_line(tmp_path):
    run = subprocess.run([sys.executable, "-m", "specdec.benchmarks.batch_bound", str(tmp_path / "none")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and run.stderr.startswith("error:") and len(run.stderr.strip().splitlines()) == 1
