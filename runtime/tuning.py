"""`specdec tune`: measure c, alpha and step-time growth; tabulate expected vs measured speedup over K."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

from specdec.runtime.engine import Engine, GenerationConfig
from specdec.runtime.prompts import PromptCase
from specdec.runtime.session import ModelSession
from specdec.runtime.theory import expected_tokens_per_iteration


def step_times(session: ModelSession, context: list[int], max_tokens: int, repeats: int = 5) -> list[float]:
    """Return the median seconds of one call over n = 1..max_tokens new tokens after `context`.

    Each call is rolled back before the next, so every measurement starts from the same cache.
    """
    cache = session.new_cache()
    session.forward(cache, context)
    medians = []
    for n in range(1, max_tokens + 1):
        tokens = context[-n:] if len(context) >= n else (context * n)[:n]
        samples = []
        for _ in range(repeats):
            before = cache.run_seconds
            session.forward(cache, tokens)
            samples.append(cache.run_seconds - before)
            cache.rollback(len(context))
        medians.append(statistics.median(samples))
    return medians


def expected_speedup_with_verify_curve(alpha: float, k: int, cost_ratio: float, verify_ratio: float) -> float:
    """Return Theorem 3.8's speedup with the measured cost of verifying k+1 tokens.

    verify_ratio: time of a (k+1)-token target call over a 1-token call (1.0 gives the paper's formula).
    """
    return expected_tokens_per_iteration(alpha, k) / (k * cost_ratio + verify_ratio)


@dataclass
class TuneRow:
    """Expected and measured speedup for one K."""

    k: int
    expected_paper: float  # Theorem 3.8: verification costs one target step
    expected: float  # with the measured verify-time growth
    measured: float | None  # tokens/s at K over target-only tokens/s, same prompts, alternating runs
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
    recommended_k: int = 1

    @property
    def verify_cost(self) -> float:
        """Return the mean extra target cost per verified token, in 1-token steps (least squares through n=1)."""
        times = self.target_step_seconds
        base = times[0]
        xs = list(range(len(times)))
        num = sum(x * (t / base - 1.0) for x, t in zip(xs, times))
        den = sum(x * x for x in xs)
        return max(num / den, 0.0) if den else 0.0

    def as_dict(self) -> dict:
        """Return the report as JSON-ready data."""
        data = asdict(self)
        data["verify_cost"] = self.verify_cost
        return data


def _run_set(engine: Engine, prompts: Sequence[PromptCase], config: GenerationConfig) -> tuple[float, int, int, int]:
    seconds = tokens = accepted = tests = 0
    for case in prompts:
        result = engine.generate(case.prompt, GenerationConfig(**{**config.__dict__, "chat": case.chat}))
        seconds += result.stats.total_seconds - result.stats.prefill_seconds
        tokens += result.stats.new_tokens - 1
        accepted += result.stats.accepted
        tests += result.stats.acceptance_tests
    return seconds, tokens, accepted, tests


def tune(engine: Engine, prompts: Sequence[PromptCase], drafter: str, max_k: int = 16, max_new_tokens: int = 64,
         measure: bool = True, progress: Callable[[str], None] = lambda message: None) -> TuneReport:
    """Return expected and measured speedups for K = 1..max_k with the given drafter.

    Measured runs alternate target-only and speculative decoding over the same prompts, so
    drift on a noisy machine hits both; speedups are ratios of decode tokens/s.
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
    measured: dict[int, float] = {}
    alphas: dict[int, float] = {}
    total_accepted = total_tests = 0
    baseline_seconds = baseline_tokens = 0.0
    if measure:
        for k in range(1, max_k + 1):
            progress(f"measuring K={k} against target-only")
            plain = _run_set(engine, prompts, GenerationConfig(**{**base.__dict__, "drafter": "none"}))
            spec = _run_set(engine, prompts, GenerationConfig(**{**base.__dict__, "num_draft_tokens": k}))
            baseline_seconds += plain[0]
            baseline_tokens += plain[1]
            measured[k] = (spec[1] / spec[0]) / (plain[1] / plain[0])
            alphas[k] = spec[2] / spec[3] if spec[3] else 0.0
            total_accepted += spec[2]
            total_tests += spec[3]
    else:
        progress("estimating alpha at K=4")
        spec = _run_set(engine, prompts, GenerationConfig(**{**base.__dict__, "num_draft_tokens": 4}))
        total_accepted, total_tests = spec[2], spec[3]
    alpha = total_accepted / total_tests if total_tests else 0.0

    report = TuneReport(drafter=drafter, alpha=alpha, cost_ratio=cost_ratio, target_step_seconds=target_times,
                        draft_step_seconds=draft_step,
                        baseline_tokens_per_second=baseline_tokens / baseline_seconds if baseline_seconds else 0.0)
    for k in range(1, max_k + 1):
        a = alphas.get(k, alpha)
        report.rows.append(TuneRow(
            k=k,
            expected_paper=expected_tokens_per_iteration(a, k) / (k * cost_ratio + 1.0),
            expected=expected_speedup_with_verify_curve(a, k, cost_ratio, target_times[k] / target_times[0]),
            measured=measured.get(k),
            alpha_measured=alphas.get(k),
        ))
    score = (lambda row: row.measured) if measure else (lambda row: row.expected)
    report.recommended_k = max(report.rows, key=score).k
    return report


def format_table(report: TuneReport) -> str:
    """Return the tune report as a Markdown table with a header line."""
    lines = [
        f"drafter {report.drafter}: alpha {report.alpha:.3f}, c {report.cost_ratio:.3f}, "
        f"target 1-token call {report.target_step_seconds[0] * 1e3:.1f} ms, verify cost per extra token "
        f"{report.verify_cost:.3f} steps, target-only {report.baseline_tokens_per_second:.1f} tok/s",
        "",
        "| K | alpha at K | expected (paper) | expected (measured verify cost) | measured |",
        "|---|---|---|---|---|",
    ]
    for row in report.rows:
        measured = f"{row.measured:.2f}x" if row.measured is not None else "-"
        alpha = f"{row.alpha_measured:.2f}" if row.alpha_measured is not None else "-"
        marker = " **recommended**" if row.k == report.recommended_k else ""
        lines.append(f"| {row.k}{marker} | {alpha} | {row.expected_paper:.2f}x | {row.expected:.2f}x | {measured} |")
    return "\n".join(lines)
