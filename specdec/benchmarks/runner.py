"""Running specdec configurations side by side on a prompt set, alternating, with repeats."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable, Sequence

from specdec.benchmarks.replay import CostModel, replay_ngram
from specdec.runtime.call_costs import non_decreasing, verify_cost_from_calls
from specdec.runtime.config import NGRAM_MIN_AUTO, NGRAM_MIN_FIXED_K, GenerationConfig
from specdec.runtime.engine import Engine
from specdec.runtime.prompts import PromptCase
from specdec.runtime.stats import GenerationStats, situation_alpha

BASELINE = "target-only"


@dataclass(frozen=True)
class BenchConfig:
    """One way of decoding: a drafter and K."""

    name: str
    drafter: str  # "none", "model" or "ngram"
    num_draft_tokens: int | str | None = None
    phrases: bool = False  # n-gram drafter: also the artifact's phrase table (off: prompt lookup alone)


@dataclass
class Run:
    """One generation of one prompt under one configuration."""

    repeat: int
    prompt: PromptCase
    config: BenchConfig
    token_ids: list[int]
    stats: GenerationStats


def configurations(engine: Engine, k: int) -> list[BenchConfig]:
    """Return target-only, then each available drafter at fixed K and at auto (n-gram: prompt lookup alone, and
    with the artifact's phrase table where it has one)."""
    configs = [BenchConfig(BASELINE, "none")]
    drafters = (["model"] if engine.draft is not None else []) + ["ngram"]
    for drafter in drafters:
        configs.append(BenchConfig(f"{drafter} K={k}", drafter, k))
        configs.append(BenchConfig(f"{drafter} auto", drafter, "auto"))
    if getattr(engine, "phrases", None) is not None:
        configs.append(BenchConfig(f"ngram+phrases K={k}", "ngram", k, phrases=True))
        configs.append(BenchConfig("ngram+phrases auto", "ngram", "auto", phrases=True))
    return configs


def run_bench(engine: Engine, prompts: Sequence[PromptCase], configs: Sequence[BenchConfig], max_new_tokens: int,
              repeats: int, progress: Callable[[str], None] = lambda message: None,
              first_repeat: int = 0) -> list[Run]:
    """Return every run. Within a repeat each prompt runs all configurations back to back, in an
    order rotated per prompt and repeat, so slow drift of the machine hits all of them alike.
    Repeats are numbered from `first_repeat` (a caller may interleave other work between them)."""
    runs = []
    total = repeats * len(prompts) * len(configs)
    for repeat in range(first_repeat, first_repeat + repeats):
        for index, case in enumerate(prompts):
            shift = (repeat + index) % len(configs)
            for config in list(configs[shift:]) + list(configs[:shift]):
                progress(f"[{len(runs) + 1}/{total}] repeat {repeat + 1}, {case.id}: {config.name}")
                result = engine.generate(case.prompt, GenerationConfig(
                    max_new_tokens=max_new_tokens, drafter=config.drafter,
                    num_draft_tokens=config.num_draft_tokens, phrases=config.phrases, chat=case.chat))
                runs.append(Run(repeat, case, config, result.token_ids, result.stats))
    return runs


def summarize(runs: Sequence[Run], cost: CostModel | None = None) -> list[dict]:
    """Return one row per (prompt, configuration) with medians over repeats.

    speedup is the median over repeats of (decode tokens/s) / (target-only decode tokens/s
    of the same prompt in the same repeat); theoretical_speedup is Theorem 3.8 over each
    run's measured alpha, c and draft lengths, and theoretical_speedup_verify the same with
    the measured call costs t(n) of `cost` (none: the paper's); greedy_equal says whether
    the tokens match target-only's.
    """
    call_cost = cost.call if cost else None
    baseline = {(r.repeat, r.prompt.id): r for r in runs if r.config.name == BASELINE}
    rows = []
    keys = list(dict.fromkeys((r.prompt.id, r.config.name) for r in runs))
    for prompt_id, config_name in keys:
        group = [r for r in runs if r.prompt.id == prompt_id and r.config.name == config_name]
        ratios = [r.stats.decode_tokens_per_second / baseline[(r.repeat, prompt_id)].stats.decode_tokens_per_second
                  for r in group]
        median = lambda key: statistics.median(getattr(r.stats, key) for r in group)  # noqa: E731
        rows.append({
            "prompt": prompt_id,
            "group": group[0].prompt.group,
            "config": config_name,
            "tokens": median("new_tokens"),
            "tokens_per_second": median("tokens_per_second"),  # end to end, prefill included
            "decode_tokens_per_second": median("decode_tokens_per_second"),
            "speedup": statistics.median(ratios),
            "alpha": median("alpha"),
            "acceptance_rate": median("acceptance_rate"),
            "tokens_per_target_call": median("tokens_per_target_call"),
            "draft_share": _time_share(group, "draft_seconds"),
            "target_share": _time_share(group, "target_seconds", "prefill_seconds"),
            "other_share": _time_share(group, "other_seconds"),
            "theoretical_speedup": median("theoretical_speedup"),
            "theoretical_speedup_verify": statistics.median(r.stats.expected_speedup(call_cost=call_cost)
                                                           for r in group),
            "greedy_equal": all(r.token_ids == baseline[(r.repeat, prompt_id)].token_ids for r in group),
        })
    return rows


def _time_share(group: Sequence[Run], *parts: str) -> float:
    """Return the share of the runs' total time spent in `parts` (GenerationStats fields), pooled over
    the runs: medians of the parts need not add up to the median whole (a report once read 101%)."""
    total = sum(r.stats.total_seconds for r in group)
    return sum(getattr(r.stats, part) for r in group for part in parts) / total if total else 0.0


def group_summary(rows: Sequence[dict]) -> list[dict]:
    """Return per (group, configuration): median speedup, median theoretical speedup, and their ratio."""
    out = []
    for group, config in dict.fromkeys((r["group"], r["config"]) for r in rows):
        sel = [r for r in rows if r["group"] == group and r["config"] == config]
        speedup = statistics.median(r["speedup"] for r in sel)
        theory = statistics.median(r["theoretical_speedup"] for r in sel)
        theory_verify = statistics.median(r["theoretical_speedup_verify"] for r in sel)
        out.append({"group": group, "config": config, "speedup": speedup, "theoretical_speedup": theory,
                    "share_of_theory": speedup / theory if theory else 0.0,
                    "theoretical_speedup_verify": theory_verify,
                    "share_of_theory_verify": speedup / theory_verify if theory_verify else 0.0,
                    "tokens_per_second": statistics.median(r["tokens_per_second"] for r in sel),
                    "decode_tokens_per_second": statistics.median(r["decode_tokens_per_second"] for r in sel),
                    "greedy_equal": all(r["greedy_equal"] for r in sel)})
    return out


def rollback_cost(runs: Sequence[Run], step_seconds: float) -> float:
    """Return the median cost of one cache rollback, in 1-token target steps, over the speculative runs.

    A rejection (acceptance tests minus accepted drafts) is what triggers a rollback.
    """
    per_rollback = [r.stats.rollback_seconds / (r.stats.acceptance_tests - r.stats.accepted)
                    for r in runs if r.stats.acceptance_tests > r.stats.accepted]
    return statistics.median(per_rollback) / step_seconds if per_rollback and step_seconds > 0 else 0.0


def replay_rows(runs: Sequence[Run], prompt_ids: dict[str, list[int]], rows: Sequence[dict], cost: CostModel,
                ks: Sequence[int], measured_config: str) -> list[dict]:
    """Return per prompt: the measured speedup of `measured_config` next to n-gram drafting replayed
    over the target-only greedy output (first repeat) at each K in `ks` and with the best
    possible draft-length choice (the oracle), under `cost`."""
    out = []
    for run in runs:
        if run.config.name != BASELINE or run.repeat != 0:
            continue
        measured = next((r["speedup"] for r in rows if r["prompt"] == run.prompt.id and r["config"] == measured_config),
                        None)
        replays = {k: replay_ngram(prompt_ids[run.prompt.id], run.token_ids, k, cost, ngram_min=NGRAM_MIN_FIXED_K)
                   for k in ks}
        oracle = replay_ngram(prompt_ids[run.prompt.id], run.token_ids, None, cost, ngram_min=NGRAM_MIN_AUTO)
        out.append({"prompt": run.prompt.id, "group": run.prompt.group, "measured_config": measured_config,
                    "measured_speedup": measured,
                    "replay_speedup": {str(k): r.speedup for k, r in replays.items()},
                    "oracle_speedup": oracle.speedup, "oracle_tokens_per_call": oracle.tokens_per_call})
    return out


def situation_rows(runs: Sequence[Run]) -> list[dict]:
    """Return, per prompt group and drafting situation, how `auto`'s iterations fared over all its runs:
    iterations (and their share of the group's), drafted tokens per iteration, and alpha (None: no test)."""
    totals: dict[tuple[str, str], dict[str, int]] = {}
    for run in runs:
        if run.config.num_draft_tokens != "auto":
            continue
        for situation, counts in run.stats.by_situation.items():
            total = totals.setdefault((run.prompt.group, situation), dict.fromkeys(counts, 0))
            for name, value in counts.items():
                total[name] += value
    per_group: dict[str, int] = {}
    for (group, _), counts in totals.items():
        per_group[group] = per_group.get(group, 0) + counts["iterations"]
    rows = [{"group": group, "situation": situation, "iterations": c["iterations"],
             "iteration_share": c["iterations"] / per_group[group],
             "drafted_per_iteration": c["drafted"] / c["iterations"],
             "alpha": situation_alpha(c)}
            for (group, situation), c in totals.items()]
    return sorted(rows, key=lambda r: (r["group"], -r["iterations"]))


def call_costs_of_runs(runs: Sequence[Run], baseline_runs: Sequence[Run],
                       min_samples: int = 5) -> tuple[dict[int, float], float, float]:
    """Return ({n: t(n)}, v, 1-token call seconds) from the target calls of `runs` themselves.

    Each call of a speculative run is divided by the target-only call at the same past
    length in the same prompt and repeat (`baseline_runs`; greedy outputs are identical, so
    every past length a speculative call sees was also a target-only step). Pairing matters:
    a call's time grows with the past too, and pooled across prompts the long grounded
    prompts would give most of the K+1-token calls and the short open ones most of the
    1-token calls, inflating the cost of long calls. t(n) = r(n) / r(1), r(n) the median
    ratio of the n-token calls, made non-decreasing in n (a longer call is never cheaper;
    a dip is timing noise, pooled with its neighbours by their numbers of calls); lengths
    with fewer than `min_samples` calls are left out. v is the least-squares slope of
    t(n) - 1 against n - 1, each length weighted by its number of calls: the average cost
    of one more token. The seconds are the median target-only call. ({}, 0, 0) when fewer
    than `min_samples` 1-token calls pair up.
    """
    steps: dict[tuple[str, int], dict[int, float]] = {}
    for run in baseline_runs:
        steps[(run.prompt.id, run.repeat)] = {past: seconds for past, n, seconds in run.stats.call_log if n == 1}
    ratios: dict[int, list[float]] = {}
    for run in runs:
        baseline = steps.get((run.prompt.id, run.repeat), {})
        for past, n, seconds in run.stats.call_log:
            if baseline.get(past):
                ratios.setdefault(n, []).append(seconds / baseline[past])
    if len(ratios.get(1, [])) < min_samples:
        return {}, 0.0, 0.0
    kept = {n: values for n, values in sorted(ratios.items()) if len(values) >= min_samples}
    medians = {n: statistics.median(values) for n, values in kept.items()}
    costs = non_decreasing({n: median / medians[1] for n, median in medians.items()},
                           {n: len(values) for n, values in kept.items()}, pinned=1)
    one_token = statistics.median(seconds for table in steps.values() for seconds in table.values())
    verify_cost = verify_cost_from_calls(medians, {n: len(values) for n, values in kept.items()})
    return costs, verify_cost, one_token
