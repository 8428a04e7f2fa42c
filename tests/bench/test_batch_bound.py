"""The batch bound's replay arithmetic, and the tool run end to end on a tiny artifact."""

import json
import subprocess
import sys

import pytest

from specdec.benchmarks.batch_bound import (CallPrices, Trace, lookup_policy, oracle_policy, plain_policy, plan_policy,
                                             replay)


def _flat(fed):
    return 1.0  # a step costs the same whatever it feeds: a memory-bound call


def _linear(fed):
    return float(sum(fed))  # every fed token costs the same: a compute-bound call


COPY = Trace("copy", "grounded", drafted=(3, 3, 3, 3), accepted=(3, 3, 3, 3))  # 16 tokens in 4 iterations
OPEN = Trace("open", "open", drafted=(0,) * 16, accepted=(0,) * 16)  # 16 tokens, nothing accepted


def test_nothing_accepted_gains_nothing():
    plain, oracle = (replay([OPEN], 4, policy, _flat) for policy in (plain_policy, oracle_policy))
    assert oracle.tokens_per_second == pytest.approx(plain.tokens_per_second)


def test_memory_bound_steps_gain_the_tokens_per_iteration():
    plain, oracle = (replay([COPY], 4, policy, _flat) for policy in (plain_policy, oracle_policy))
    assert oracle.tokens_per_second / plain.tokens_per_second == pytest.approx(4.0)
    assert oracle.steps * 4 == plain.steps


def test_compute_bound_steps_gain_nothing_and_waste_costs():
    wasteful = Trace("miss", "grounded", drafted=(4,) * 16, accepted=(0,) * 16)
    plain, oracle = (replay([COPY, OPEN], 2, policy, _linear) for policy in (plain_policy, oracle_policy))
    assert oracle.tokens_per_second == pytest.approx(plain.tokens_per_second)
    assert replay([wasteful], 2, lookup_policy(8), _linear).tokens_per_second == pytest.approx(
        replay([wasteful], 2, plain_policy, _linear).tokens_per_second / 5)


def test_a_shorter_k_leaves_the_rest_of_a_copy_for_the_next_step():
    one = replay([COPY], 1, lookup_policy(1), _flat, requests_per_lane=1)
    assert one.tokens == 16 and one.steps == 8  # each step: one accepted draft and the token after it
    assert one.verify_tokens == 16
    with pytest.raises(ValueError, match="lookup proposes"):
        replay([OPEN], 1, lambda lanes, traces: [1] * len(lanes), _flat, name="eager")


def test_every_step_is_a_full_batch_and_lanes_rotate_prompts():
    run = replay([COPY, OPEN], 3, plain_policy, _linear, requests_per_lane=2)
    assert run.verify_tokens == run.steps * 3 == run.tokens  # plain: one token per lane a step


def test_the_plan_drafts_where_steps_are_flat_and_not_where_every_token_costs_a_step():
    # A flat step: every draft is free, so the plan drafts; a step priced per token: drafts only cost.
    flat = CallPrices(2, 1.0, {2: 1.0, 8: 1.0})
    linear = CallPrices(2, 2.0, {2: 2.0, 8: 8.0})
    plain = replay([COPY], 2, plain_policy, flat.step)
    planned = replay([COPY], 2, plan_policy(4, flat.plain, flat.ragged, 1.0), flat.step)
    assert planned.tokens_per_second > 1.5 * plain.tokens_per_second
    cautious = replay([COPY, OPEN], 2, plan_policy(4, linear.plain, linear.ragged, 1.0), linear.step)
    assert cautious.verify_tokens == cautious.tokens  # nothing drafted: each draft's chance is under 1


def test_a_plan_that_leaves_a_copy_unverified_learns_from_it_and_drafts():
    # Each draft costs 0.6 of a plain token: a chance of 0.5 (a fresh record) does not pay, a learned one does.
    long_copy = Trace("long copy", "grounded", drafted=(8,) * 8, accepted=(8,) * 8)
    prices = CallPrices(2, 2.0, {2: 2.0, 3: 2.6, 4: 3.2, 10: 6.8})
    plain = replay([long_copy], 2, plain_policy, prices.step, requests_per_lane=2)
    planned = replay([long_copy], 2, plan_policy(4, prices.plain, prices.ragged, 1.0), prices.step,
                     requests_per_lane=2)
    assert planned.tokens == plain.tokens
    assert planned.steps < 0.7 * plain.steps  # its shadows showed lookup right every time, so it drafts


def test_call_prices_take_the_cheaper_plain_call_and_interpolate_ragged():
    prices = CallPrices(8, 0.030, {8: 0.032, 16: 0.048, 24: 0.060})
    assert prices.step([1] * 8) == 0.030
    assert prices.step([2] * 8) == 0.048
    assert prices.step([1] * 4 + [3] * 4) == 0.048
    assert prices.step([1] * 8 + [4]) == pytest.approx(0.032 + 0.016 * 4 / 8)  # 12 tokens: between 8 and 16
    assert prices.step([4] * 8) == pytest.approx(0.060 + 0.012 * 8 / 8)  # 32: the last line extended
    assert CallPrices(8, None, {8: 0.032, 16: 0.048}).step([1] * 8) == 0.032  # no batched call: the ragged one


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
        assert row["oracle_tok_s"] >= row["plan_tok_s"] * 0.999
        assert row["flat_lookup_vs_plain"] >= 1.0


def test_bound_tool_refuses_a_missing_artifact_in_one_line(tmp_path):
    run = subprocess.run([sys.executable, "-m", "specdec.benchmarks.batch_bound", str(tmp_path / "none")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and run.stderr.startswith("error:") and len(run.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("lanes", ["x", "0", "2,,4"])
def test_bound_tool_refuses_bad_lane_counts_before_any_work(tmp_path, lanes, capsys):
    from specdec.benchmarks.batch_bound import main

    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "none"), "--lanes", lanes])
    assert exit_info.value.code == 2
    assert "--lanes" in capsys.readouterr().err.strip().splitlines()[-1]
