"""The bench's in-run cost measurements."""

import statistics

import pytest

from specdec.benchmarks.report import situation_section
from specdec.benchmarks.runner import BenchConfig, Run, call_costs_of_runs, rollback_cost, situation_rows, summarize
from specdec.runtime.prompts import PromptCase
from specdec.runtime.stats import GenerationStats

CASE = PromptCase(id="p", group="grounded", prompt="x", chat=False)


def _run(case: PromptCase = CASE, config: BenchConfig = BenchConfig("ngram K=4", "ngram", 4), **stats) -> Run:
    return Run(0, case, config, [], GenerationStats(**stats))


def _step(past: int, case: PromptCase) -> float:
    """A 1-token call's seconds: grows with the past, and the long prompt is slower."""
    return 0.010 * (1 + past / 100) * (1.5 if case is LONG else 1.0)


LONG = PromptCase(id="long", group="grounded", prompt="y", chat=False)
BASELINE = BenchConfig("target-only", "none")


def test_verify_cost_pairs_each_call_with_the_target_only_step_at_its_past():
    # t(n, past) = step(past) * (1 + 0.1 (n - 1)). The short prompt has mostly 1-token calls,
    # the long one mostly 5-token calls: pooled by n alone, v would come out far above 0.1.
    baselines = [_run(case, BASELINE, call_log=[(p, 1, _step(p, case)) for p in range(100)]) for case in (CASE, LONG)]
    short = [(p, 1, _step(p, CASE)) for p in range(0, 40)] + [(p, 5, 1.4 * _step(p, CASE)) for p in (50, 60)]
    long = [(p, 1, _step(p, LONG)) for p in (0, 1)] + [(p, 5, 1.4 * _step(p, LONG)) for p in range(20, 95, 5)]
    runs = [_run(CASE, call_log=short), _run(LONG, call_log=long)]
    costs, v, one = call_costs_of_runs(runs, baselines, min_samples=2)
    assert costs == {1: 1.0, 5: 1.4}
    assert abs(v - 0.1) < 1e-9
    assert abs(one - statistics.median(c[2] for b in baselines for c in b.stats.call_log)) < 1e-12
    pooled_one = statistics.median(c[2] for c in short + long if c[1] == 1)
    pooled_five = statistics.median(c[2] for c in short + long if c[1] == 5)
    assert (pooled_five / pooled_one - 1) / 4 > 0.3  # the confounding the pairing removes


def test_verify_cost_needs_pairs():
    baseline = _run(config=BASELINE, call_log=[(p, 1, 0.01) for p in range(10)])
    assert call_costs_of_runs([_run(call_log=[(p, 5, 0.014) for p in range(9)])], [baseline]) == ({}, 0.0, 0.0)
    # calls whose past the target-only run never saw (another prompt) are not paired
    other = PromptCase(id="q", group="open", prompt="z", chat=False)
    assert call_costs_of_runs([_run(other, call_log=[(p, 1, 0.01) for p in range(9)])], [baseline]) == ({}, 0.0, 0.0)


def test_call_costs_are_a_table_by_length_never_decreasing():
    # A step, as MLAS makes on the CPU: 2..3 tokens 1.1, 4 tokens 1.08 (noise), 5 tokens 1.3.
    baseline = _run(config=BASELINE, call_log=[(p, 1, 0.010) for p in range(60)])
    factor = {1: 1.0, 2: 1.1, 3: 1.1, 4: 1.08, 5: 1.3}
    calls = [(p, 1 + p % 5, 0.010 * factor[1 + p % 5]) for p in range(50)]
    costs, v, _ = call_costs_of_runs([_run(call_log=calls)], [baseline])
    assert costs == pytest.approx({1: 1.0, 2: 3.28 / 3, 3: 3.28 / 3, 4: 3.28 / 3, 5: 1.3})  # the dip pooled, 10 calls each
    assert 0.05 < v < 0.1  # one average slope for what lies beyond the table


def test_rollback_cost_per_rejection_in_steps():
    runs = [_run(rollback_seconds=0.004, acceptance_tests=10, accepted=6),  # 4 rejections: 1 ms each
            _run(rollback_seconds=0.0, acceptance_tests=5, accepted=5)]  # no rejection: not counted
    assert abs(rollback_cost(runs, step_seconds=0.020) - 0.05) < 1e-12


def test_loop_records_every_target_call(tiny_target_only_artifact):
    from specdec.runtime.engine import Engine, GenerationConfig

    engine = Engine.load(tiny_target_only_artifact, provider="cpu")
    result = engine.generate("one, two, three, one, two, three, one,",
                             GenerationConfig(max_new_tokens=24, drafter="ngram", num_draft_tokens=3))
    calls = result.stats.call_log
    assert len(calls) == result.stats.iterations
    assert {n for _, n, _ in calls} <= {1, 2, 3, 4} and all(t > 0 for _, _, t in calls)
    # each call's past is the cache length it ran on: the previous call's past plus what it committed
    prompt_length = len(result.prompt_ids)
    assert calls[0][0] == prompt_length
    assert all(later[0] > earlier[0] for earlier, later in zip(calls, calls[1:]))
    assert calls[-1][0] < prompt_length + len(result.token_ids)
    assert "call_log" not in result.stats.as_dict()


def test_situation_rows_pool_autos_runs_per_group():
    auto = BenchConfig("ngram auto", "ngram", "auto")
    open_case = PromptCase(id="o", group="open", prompt="z", chat=False)

    def counts(iterations, drafted, accepted, tests):
        return {"iterations": iterations, "drafted": drafted, "accepted": accepted, "acceptance_tests": tests}

    runs = [
        _run(CASE, auto, by_situation={"seen once": counts(3, 12, 9, 10), "no match": counts(1, 0, 0, 0)}),
        _run(LONG, auto, by_situation={"seen once": counts(1, 4, 0, 1), "ambiguous": counts(4, 4, 1, 4)}),
        _run(open_case, auto, by_situation={"seen once": counts(2, 8, 8, 8)}),
        _run(CASE, by_situation={"seen once": counts(50, 200, 0, 50)}),  # fixed K: not auto's
    ]
    rows = {(r["group"], r["situation"]): r for r in situation_rows(runs)}
    once = rows[("grounded", "seen once")]
    assert once["iterations"] == 4 and abs(once["iteration_share"] - 4 / 9) < 1e-12
    assert once["drafted_per_iteration"] == 4.0 and abs(once["alpha"] - 9 / 11) < 1e-12
    assert rows[("grounded", "no match")]["alpha"] is None
    assert rows[("open", "seen once")]["iteration_share"] == 1.0
    table = "\n".join(situation_section(situation_rows(runs)))
    assert "| grounded | seen once | 4 | 44% | 4.00 | 0.82 |" in table and "| grounded | no match | 1 |" in table
    assert situation_section([]) == []


def test_time_shares_pool_the_repeats_and_never_pass_the_whole():
    # Per run, target + prefill is all of the time; the medians of the parts (1.2 + 1.2) would
    # read 120% of the median total (2.0).
    parts = [(1.9, 0.1, 2.0), (0.1, 1.9, 2.0), (1.2, 1.2, 2.4)]
    runs = []
    for repeat, (target, prefill, total) in enumerate(parts):
        runs.append(Run(repeat, CASE, BASELINE, [],
                        GenerationStats(new_tokens=9, total_seconds=1.0, prefill_seconds=0.1)))
        runs.append(Run(repeat, CASE, BenchConfig("ngram K=4", "ngram", 4), [], GenerationStats(
            new_tokens=9, target_seconds=target, prefill_seconds=prefill, total_seconds=total)))
    row = next(r for r in summarize(runs) if r["config"] == "ngram K=4")
    assert abs(row["target_share"] - 1.0) < 1e-12 and row["draft_share"] == 0.0 and row["other_share"] < 1e-12


def test_configurations_add_the_phrase_table_where_the_artifact_has_one():
    from types import SimpleNamespace

    from specdec.benchmarks.runner import configurations
    from specdec.runtime.phrases import PhraseTable

    plain = configurations(SimpleNamespace(draft=None, phrases=None), 4)
    assert [(c.name, c.phrases) for c in plain] == [("target-only", False), ("ngram K=4", False),
                                                    ("ngram auto", False)]
    table = PhraseTable({(1,): 2}, 4)
    phrased = configurations(SimpleNamespace(draft=None, phrases=table), 4)
    assert [(c.name, c.drafter, c.phrases) for c in phrased[3:]] == [("ngram+phrases K=4", "ngram", True),
                                                                    ("ngram+phrases auto", "ngram", True)]
