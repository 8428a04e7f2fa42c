"""`specdec tune`: measure c, alpha and t(n); tabulate expected vs measured speedup over K; store the best K."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

from specdec.benchmarks.report import cell
from specdec.models.manifest import update_runtime_defaults
from specdec.runtime.calibration import step_times, timing_context
from specdec.runtime.call_costs import relative_costs_from_step_times, verify_cost_from_calls
from specdec.runtime.engine import Engine, GenerationConfig
from specdec.runtime.prompts import PromptCase
from specdec.runtime.session import ModelSession
from specdec.runtime.theory import expected_speedup, expected_speedup_over_lengths


@dataclass
class TuneRow:
    """Expected and measured speedup for one K."""

    k: int
    expected_paper: float  # Theorem 3.8: verification costs one target step
    expected: float  # with the measured call costs t(n), over the K actually drafted (when measured)
    measured: float | None  # pooled decode tokens/s at K over target-only, same prompts, alternating runs
    alpha_measured: float | None = None  # per-token acceptance at this K


@dataclass
class TuneReport:
    """Everything `specdec tune` measured."""

    drafter: str
    alpha: float  # pooled over all measured K
    cost_ratio: float  # c: draft call / 1-token target call
    target_step_seconds: list[float]  # index n-1: a call over n tokens
    draft_step_seconds: float
    baseline_tokens_per_second: float
    rows: list[TuneRow] = field(default_factory=list)
    recommended_k: int | str = 1  # the best measured K, or "auto" when auto measured better still
    auto_measured: float | None = None  # `-k auto` (capped at max_k) measured like each fixed K
    auto_alpha: float | None = None
    # a prefill of long_call_prefill_tokens through the long-call kernel over one through the short-call
    # kernel (None: the graph has one kernel, exported with --no-long-call-attention or not fp32)
    long_call_prefill_ratio: float | None = None
    long_call_prefill_tokens: int = 0

    @property
    def call_costs(self) -> list[float]:
        """Return t(n) / t(1) for n = 1..max_k + 1: what `auto` reads from the artifact."""
        return list(relative_costs_from_step_times(self.target_step_seconds).values())

    @property
    def verify_cost(self) -> float:
        """Return the mean extra target cost per verified token, in 1-token steps."""
        return verify_cost_from_calls(dict(enumerate(self.target_step_seconds, start=1)))

    def as_dict(self) -> dict:
        """Return the report as JSON-ready data."""
        data = asdict(self)
        data["verify_cost"] = self.verify_cost
        data["call_costs"] = self.call_costs
        return data


@dataclass
class _Measured:
    speedup: float  # pooled decode tokens/s of speculative over target-only, same prompts, back to back
    accepted: int
    tests: int
    draft_lengths: dict[int, int]  # K actually drafted -> iterations, over all runs
    baseline_tokens_per_second: float

    @property
    def alpha(self) -> float:
        return self.accepted / self.tests if self.tests else 0.0


def recommend(rows: Sequence[TuneRow], auto_measured: float | None, by_measurement: bool) -> int | str:
    """Return the K to store: the row with the best measured (else expected) speedup, or "auto"
    when auto's measured speedup beats every fixed K's.

    Auto has to beat the best of max_k noisy fixed-K measurements, a maximum that noise
    lifts, so a tie goes to the fixed K, whose output is also reproducible under sampling.
    """
    score = (lambda row: row.measured) if by_measurement else (lambda row: row.expected)
    best = max(rows, key=score)
    if by_measurement and auto_measured is not None and auto_measured > best.measured:
        return "auto"
    return best.k


def _measure_k(engine: Engine, prompts: Sequence[PromptCase], base: GenerationConfig, k: int | str,
               repeats: int) -> _Measured:
    seconds = {True: 0.0, False: 0.0}
    tokens = {True: 0, False: 0}
    accepted = tests = 0
    lengths: dict[int, int] = {}
    plain_config = replace(base, drafter="none")
    spec_config = replace(base, num_draft_tokens=k)
    for repeat in range(repeats):
        for index, case in enumerate(prompts):
            # Back to back on the same prompt, order flipped each time: drift hits both sides alike.
            order = [plain_config, spec_config] if (repeat + index) % 2 == 0 else [spec_config, plain_config]
            for config in order:
                stats = engine.generate(case.prompt, replace(config, chat=case.chat)).stats
                plain = config.drafter == "none"
                seconds[plain] += stats.total_seconds - stats.prefill_seconds
                tokens[plain] += stats.new_tokens - 1
                if not plain:
                    accepted += stats.accepted
                    tests += stats.acceptance_tests
                    for length, count in stats.draft_lengths.items():
                        lengths[length] = lengths.get(length, 0) + count
    spec_rate, plain_rate = tokens[False] / seconds[False], tokens[True] / seconds[True]
    return _Measured(spec_rate / plain_rate, accepted, tests, lengths, plain_rate)


LONG_CALL_ROUNDS = 5
# Below this prefill ratio the long-call kernel is worth its Ifs, which every call pays (~0.5 ms a SmolLM2
# step on 2 cores): a Xeon read 0.87-0.91x, an AMD EPYC 0.97-1.00x (docs/FAIR_ANCHORS.md, "The long-call kernel depends on the CPU").
LONG_CALL_WORTH = 0.95


def long_call_prefill_ratio(session: ModelSession, context: list[int], rounds: int = LONG_CALL_ROUNDS) -> float | None:
    """Return the median over alternating rounds of (a prefill of `context` through the graph's long-call
    kernel) / (the same prefill through its short-call kernel), or None when the graph has one kernel."""
    if not session.spec.long_call_name:
        return None
    kept = session.long_call_rows
    seconds: dict[bool, list[float]] = {True: [], False: []}
    try:
        for round_index in range(rounds + 1):  # the first round warms both kernels up and is not kept
            for long_kernel in ((True, False) if round_index % 2 == 0 else (False, True)):
                session.long_call_rows = 0 if long_kernel else len(context)
                cache = session.new_cache()
                session.forward(cache, context, logits_rows=1)
                if round_index:
                    seconds[long_kernel].append(cache.run_seconds)
    finally:
        session.long_call_rows = kept
    return statistics.median(a / b for a, b in zip(seconds[True], seconds[False]))


def tune(engine: Engine, prompts: Sequence[PromptCase], drafter: str, max_k: int = 16, max_new_tokens: int = 64,
         measure: bool = True, repeats: int = 1,
         progress: Callable[[str], None] = lambda message: None) -> TuneReport:
    """Return expected and measured speedups for K = 1..max_k with the given drafter.

    Each measurement runs target-only and speculative decoding back to back on the same
    prompt (order alternating); the measured speedup is pooled decode tokens/s over all
    prompts, and the expected one uses the alpha and draft lengths pooled the same way.
    """
    context = engine.prompt_ids(prompts[0].prompt, prompts[0].chat)[:256]
    progress("timing target calls over 1..%d tokens" % (max_k + 1))
    target_times = step_times(engine.target, context, max_k + 1)
    draft_step = 0.0
    if drafter == "model" and engine.draft is not None:
        progress("timing draft calls")
        draft_step = step_times(engine.draft, context, 1)[0]
    cost_ratio = draft_step / target_times[0]

    base = GenerationConfig(max_new_tokens=max_new_tokens, drafter=drafter)
    measured: dict[int, _Measured] = {}
    if measure:
        for k in range(1, max_k + 1):
            progress(f"measuring K={k} against target-only")
            measured[k] = _measure_k(engine, prompts, base, k, repeats)
    else:
        progress("estimating alpha at K=4")
        measured_alpha = _measure_k(engine, prompts, base, 4, 1)
    pool = list(measured.values()) or [measured_alpha]
    accepted, tests = sum(m.accepted for m in pool), sum(m.tests for m in pool)
    alpha = accepted / tests if tests else 0.0

    report = TuneReport(drafter=drafter, alpha=alpha, cost_ratio=cost_ratio, target_step_seconds=target_times,
                        draft_step_seconds=draft_step,
                        baseline_tokens_per_second=statistics.median(m.baseline_tokens_per_second for m in pool))
    call_cost = relative_costs_from_step_times(target_times).__getitem__  # n = 1..max_k + 1
    for k in range(1, max_k + 1):
        m = measured.get(k)
        a = m.alpha if m and m.tests else alpha
        report.rows.append(TuneRow(
            k=k,
            expected_paper=expected_speedup(a, k, cost_ratio),
            expected=(expected_speedup_over_lengths(a, m.draft_lengths, cost_ratio, call_cost) if m
                      else expected_speedup(a, k, cost_ratio, call_cost)),
            measured=m.speedup if m else None,
            alpha_measured=a if m else None,
        ))
    if measure:
        # auto reads t(n) from the table this run measured, which is what gets stored.
        engine.target_call_costs.prior = relative_costs_from_step_times(target_times)
        progress(f"measuring K=auto (cap {max_k}) against target-only")
        auto = _measure_k(engine, prompts, replace(base, max_draft_tokens_auto=max_k), "auto", repeats)
        report.auto_measured, report.auto_alpha = auto.speedup, auto.alpha
    report.recommended_k = recommend(report.rows, report.auto_measured, measure)
    if engine.target.spec.long_call_name:
        progress("timing prefills through the long-call and the short-call attention kernel")
        prefill = timing_context(context, engine.target.spec.max_positions - 1)
        report.long_call_prefill_ratio = long_call_prefill_ratio(engine.target, prefill)
        report.long_call_prefill_tokens = len(prefill)
    return report


def format_table(report: TuneReport) -> str:
    """Return the tune report as a Markdown table with a header line."""
    lines = [
        f"drafter {report.drafter}: alpha {report.alpha:.3f}, c {report.cost_ratio:.3f}, "
        f"target 1-token call {report.target_step_seconds[0] * 1e3:.1f} ms, verify cost per extra token "
        f"{report.verify_cost:.3f} steps, target-only {report.baseline_tokens_per_second:.1f} tok/s",
        "",
        "| K | alpha at K | expected (paper, nominal K) | expected (measured call costs, K drafted) | measured |",
        "|---|---|---|---|---|",
    ]
    for row in report.rows:
        marker = " **recommended**" if row.k == report.recommended_k else ""
        lines.append(f"| {row.k}{marker} | {cell(row.alpha_measured)} | {row.expected_paper:.2f}x | "
                     f"{row.expected:.2f}x | {cell(row.measured, '{:.2f}x')} |")
    if report.auto_measured is not None:
        marker = " **recommended**" if report.recommended_k == "auto" else ""
        lines.append(f"| auto (cap {len(report.rows)}){marker} | {report.auto_alpha:.2f} | - | - | "
                     f"{report.auto_measured:.2f}x |")
    if report.long_call_prefill_ratio is not None:
        ratio = report.long_call_prefill_ratio
        lines += ["", f"long-call attention kernel: a {report.long_call_prefill_tokens}-token prefill {ratio:.2f}x "
                  "the short-call kernel's; its Ifs cost every call ~0.5 ms (SmolLM2, 2 cores). "
                  + ("Worth keeping on this machine." if ratio < LONG_CALL_WORTH else
                     "Not worth them on this machine: export with --no-long-call-attention.")]
    return "\n".join(lines)


def save_tuned_defaults(artifact: Path, report: TuneReport) -> None:
    """Store the recommended K, the drafter and the measured t(n) in the artifact's manifest."""
    update_runtime_defaults(artifact, {"num_draft_tokens": report.recommended_k, "drafter": report.drafter,
                                       "verify_cost": round(report.verify_cost, 4),
                                       "target_call_costs": [round(r, 4) for r in report.call_costs],
                                       "tuned": {"alpha": round(report.alpha, 4),
                                                 "cost_ratio": round(report.cost_ratio, 4)}})
