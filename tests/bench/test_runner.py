"""The bench's in-run cost measurements."""

from specdec.bench.runner import BenchConfig, Run, rollback_cost, verify_cost_of_runs
from specdec.runtime.prompts import PromptCase
from specdec.runtime.stats import GenerationStats

CASE = PromptCase(id="p", group="grounded", prompt="x", chat=False)


def _run(**stats) -> Run:
    return Run(0, CASE, BenchConfig("ngram K=4", "ngram", 4), [], GenerationStats(**stats))


def test_verify_cost_from_the_runs_own_calls():
    # t(n) = 10 ms * (1 + 0.1 (n - 1)); lengths with too few calls are left out
    runs = [_run(call_seconds={1: [0.010] * 6, 5: [0.014] * 4, 3: [0.0120]}),
            _run(call_seconds={1: [0.010] * 4, 5: [0.014] * 6, 2: [0.5]})]
    v, one = verify_cost_of_runs(runs)
    assert abs(v - 0.1) < 1e-9 and abs(one - 0.010) < 1e-12
    assert verify_cost_of_runs([_run(call_seconds={5: [0.014] * 9})]) == (0.0, 0.0)


def test_rollback_cost_per_rejection_in_steps():
    runs = [_run(rollback_seconds=0.004, acceptance_tests=10, accepted=6),  # 4 rejections: 1 ms each
            _run(rollback_seconds=0.0, acceptance_tests=5, accepted=5)]  # no rejection: not counted
    assert abs(rollback_cost(runs, step_seconds=0.020) - 0.05) < 1e-12


def test_loop_records_every_target_call(tiny_target_only_artifact):
    from specdec.runtime.engine import Engine, GenerationConfig

    engine = Engine.load(tiny_target_only_artifact, provider="cpu")
    result = engine.generate("one, two, three, one, two, three, one,",
                             GenerationConfig(max_new_tokens=24, drafter="ngram", num_draft_tokens=3))
    calls = result.stats.call_seconds
    assert sum(len(times) for times in calls.values()) == result.stats.iterations
    assert set(calls) <= {1, 2, 3, 4} and all(t > 0 for times in calls.values() for t in times)
    assert "call_seconds" not in result.stats.as_dict()
