import pytest

from specdec.runtime.call_costs import TargetCallCosts, non_decreasing, relative_costs_from_step_times


def feed(costs: TargetCallCosts, tokens: int, seconds: float, times: int = 3) -> None:
    for _ in range(times):
        costs.observe(tokens, seconds)


def test_measured_lengths_give_their_own_ratio():
    costs = TargetCallCosts(prior={5: 3.0}, prior_verify_cost=0.5)
    feed(costs, 1, 0.020)
    feed(costs, 5, 0.023)
    assert costs.relative(1) == 1.0
    assert costs.relative(5) == pytest.approx(1.15)  # measured beats the prior table


def test_a_length_needs_min_calls_before_it_is_trusted():
    costs = TargetCallCosts(prior={5: 1.4})
    feed(costs, 1, 0.020)
    feed(costs, 5, 0.023, times=2)
    assert costs.relative(5) == pytest.approx(1.4)
    costs.observe(5, 0.023)
    assert costs.relative(5) == pytest.approx(1.15)


def test_unmeasured_lengths_use_the_prior_table_then_a_line_then_the_prior_line():
    assert TargetCallCosts(prior_verify_cost=0.1).relative(4) == pytest.approx(1.3)  # prior line 1 + 0.1 * 3
    costs = TargetCallCosts(prior={3: 1.4}, prior_verify_cost=0.1)
    assert costs.relative(3) == pytest.approx(1.4)
    assert costs.relative(4) == pytest.approx(1.6)  # the table's line through (1, 1) and (3, 1.4) beats v
    feed(costs, 1, 0.010)
    feed(costs, 2, 0.012)  # measured line: t(n) = 8 ms + 2 ms n
    assert costs.relative(3) == pytest.approx(1.4)  # the prior table still wins over a guess
    assert costs.relative(6) == pytest.approx(20 / 10)


def test_lengths_beyond_the_prior_table_follow_its_line():
    # A table tuned up to 5 tokens, then a cap raised to 9: t(9) must not read as t(5).
    costs = TargetCallCosts(prior={1: 1.0, 2: 1.05, 3: 1.1, 4: 1.15, 5: 1.2})
    assert costs.relative(9) == pytest.approx(1.4)
    feed(costs, 1, 0.010)
    feed(costs, 2, 0.013)  # this run's own timings, once there, take over: 7 ms + 3 ms n
    assert costs.relative(9) == pytest.approx(34 / 10)


def test_a_drafter_that_always_drafts_still_times_its_calls():
    costs = TargetCallCosts(prior={2: 1.5, 3: 1.7, 5: 2.0})  # a calibration that read calls dear
    feed(costs, 2, 0.022)
    feed(costs, 5, 0.028)  # no 1-token calls: the line 18 ms + 2 ms n puts one at 20 ms
    assert costs.relative(2) == pytest.approx(1.1) and costs.relative(5) == pytest.approx(1.4)
    assert costs.relative(3) == pytest.approx(1.2)  # between two timed lengths: their line, not the prior's 1.7
    steep = TargetCallCosts()
    feed(steep, 2, 0.010)
    feed(steep, 5, 0.040)  # the line would put a 1-token call at 0 s
    assert steep.relative(5) == pytest.approx(5.0)  # t(1) >= t(5) / 5
    close = TargetCallCosts(prior={2: 1.1, 3: 1.2})
    feed(close, 2, 0.024)
    feed(close, 3, 0.023)  # noise: a line through 2 and 3 would read t(2) 0.96, floored to 1
    table = close.table(3)
    assert table[2] == pytest.approx(table[3]) and table[2] > 1.1  # the prior's shape, scaled to their times


def test_never_cheaper_than_a_one_token_call():
    costs = TargetCallCosts(prior={2: 0.9})
    assert costs.relative(2) == 1.0
    feed(costs, 1, 0.020)
    feed(costs, 4, 0.018)  # timing noise
    assert costs.relative(4) == 1.0
    assert costs.relative(8) == 1.0  # the line through them slopes down: floored


def test_drift_is_followed_and_one_slow_call_is_not():
    costs = TargetCallCosts(window=5)
    feed(costs, 1, 0.010, times=5)
    feed(costs, 2, 0.011, times=4)
    costs.observe(2, 0.050)  # the OS took the core once
    assert costs.relative(2) == pytest.approx(1.1)
    feed(costs, 2, 0.015, times=5)  # the machine really slows down for 2-token calls
    assert costs.relative(2) == pytest.approx(1.5)


def test_a_dip_is_noise_the_table_never_decreases():
    costs = TargetCallCosts(prior={2: 1.1, 3: 1.2, 4: 1.15, 5: 1.3})
    assert costs.table(5) == pytest.approx([1.0, 1.0, 1.1, 1.175, 1.175, 1.3])  # the dip pooled with 3
    assert costs.relative(4) == pytest.approx(1.175)


def test_one_slow_length_does_not_make_every_longer_call_dear():
    costs = TargetCallCosts()
    feed(costs, 1, 0.020, times=16)
    feed(costs, 2, 0.040)  # three cold calls: t(2) reads 2.0
    feed(costs, 5, 0.024, times=13)
    table = costs.table(5)
    # Lifting every length to the highest shorter one read t(5) = 2.0; pooled by calls, t(2..5) ~1.3.
    assert table[2] == table[5] and 1.2 < table[5] < 1.4


def test_a_length_not_called_for_a_while_is_timed_afresh():
    costs = TargetCallCosts(fresh_calls=10)
    feed(costs, 1, 0.020, times=5)
    feed(costs, 2, 0.040)  # cold: t(2) reads 2.0, and a policy that believes it stops calling 2 tokens
    assert costs.relative(2) == pytest.approx(2.0)
    feed(costs, 1, 0.020, times=10)
    assert costs.relative(2) == pytest.approx(1.0 + costs.prior_verify_cost)  # stale: back to the guess
    feed(costs, 2, 0.022)  # called again: the old times are gone, the new ones count alone
    assert costs.relative(2) == pytest.approx(1.1)


def test_non_decreasing_pools_by_weight_and_keeps_the_pinned_length():
    assert non_decreasing({1: 1.0, 2: 1.3, 3: 1.1}, {2: 1, 3: 3}, pinned=1) == pytest.approx({1: 1.0, 2: 1.15, 3: 1.15})
    assert non_decreasing({1: 1.0, 2: 0.9, 3: 1.2}, pinned=1) == pytest.approx({1: 1.0, 2: 1.0, 3: 1.2})
    assert non_decreasing({1: 1.0, 2: 1.2, 3: 1.1, 4: 1.0}) == pytest.approx({1: 1.0, 2: 1.1, 3: 1.1, 4: 1.1})


def test_one_token_seconds_takes_the_call_length_out():
    costs = TargetCallCosts(prior={4: 1.3})
    assert costs.one_token_seconds(4, 0.013) == pytest.approx(0.010)


def test_relative_costs_from_step_times():
    assert relative_costs_from_step_times([0.02, 0.022, 0.03]) == pytest.approx({1: 1.0, 2: 1.1, 3: 1.5})
    assert relative_costs_from_step_times([]) == {}



def test_auto_times_the_calls_once_per_engine_unless_tuned(tiny_target_only_artifact):
    from specdec.runtime.engine import Engine, GenerationConfig

    engine = Engine.load(tiny_target_only_artifact, provider="cpu")
    prompt = "one, two, three, one, two, three, one,"
    plain = engine.generate(prompt, GenerationConfig(max_new_tokens=12, drafter="none"))
    fixed = engine.generate(prompt, GenerationConfig(max_new_tokens=12, drafter="ngram", num_draft_tokens=3))
    assert engine.target_call_costs.prior == {} and engine.calibration_seconds == 0.0  # only auto needs t(n)
    config = GenerationConfig(max_new_tokens=12, drafter="ngram", num_draft_tokens="auto", max_draft_tokens_auto=5)
    auto = engine.generate(prompt, config)
    assert sorted(engine.target_call_costs.prior) == [1, 2, 3, 4, 5, 6] and engine.calibration_seconds > 0
    assert engine.target_call_costs.prior[1] == 1.0
    assert auto.token_ids == plain.token_ids == fixed.token_ids  # still exact
    table, seconds = dict(engine.target_call_costs.prior), engine.calibration_seconds
    engine.generate(prompt, config)
    assert engine.target_call_costs.prior == table and engine.calibration_seconds == seconds


def test_a_tuned_table_is_not_timed_again(tiny_target_only_artifact, tmp_path):
    import shutil

    from specdec.models.manifest import update_runtime_defaults
    from specdec.runtime.engine import Engine, GenerationConfig

    artifact = tmp_path / "art"
    shutil.copytree(tiny_target_only_artifact, artifact)
    update_runtime_defaults(artifact, {"target_call_costs": [1.0, 1.1, 1.15]})
    engine = Engine.load(artifact, provider="cpu")
    engine.generate("one, two, one, two,", GenerationConfig(max_new_tokens=6, drafter="ngram", num_draft_tokens="auto"))
    assert engine.target_call_costs.prior == {1: 1.0, 2: 1.1, 3: 1.15} and engine.calibration_seconds == 0.0


def test_time_call_costs_readies_auto_before_any_request(tiny_target_only_artifact):
    from specdec.runtime.engine import Engine, GenerationConfig

    engine = Engine.load(tiny_target_only_artifact, provider="cpu")
    assert engine.call_costs_source is None and engine.target_call_costs.prior == {}
    assert engine.time_call_costs(max_draft_tokens=5) in ("timed", "cache")
    table = dict(engine.target_call_costs.prior)
    assert sorted(table) == [1, 2, 3, 4, 5, 6]
    engine.generate("one, two, one, two,", GenerationConfig(max_new_tokens=6, drafter="ngram", num_draft_tokens="auto",
                                                            max_draft_tokens_auto=5))
    assert engine.target_call_costs.prior == table  # the request found it ready


def test_the_kept_table_follows_every_call_and_a_new_prior():
    costs = TargetCallCosts(prior={3: 1.4}, prior_verify_cost=0.1)
    first = costs.table(4)
    first[3] = 99.0  # the caller's copy: the kept table is not theirs to change
    assert costs.table(4)[3] == pytest.approx(1.4)
    costs.prior = {3: 1.8}  # what calibration or `specdec tune` does: a new table, not an edit
    assert costs.table(4)[3] == pytest.approx(1.8)
    feed(costs, 1, 0.020)
    feed(costs, 3, 0.030)
    assert costs.table(4)[3] == pytest.approx(1.5)
    assert costs.table(6) == TargetCallCosts(prior={3: 1.8}, prior_verify_cost=0.1, _recent=costs._recent,
                                             _medians=costs._medians, _calls=costs._calls,
                                             _last_call=costs._last_call).table(6)
