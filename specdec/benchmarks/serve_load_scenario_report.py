"""The scenarios' report: each cell's figures (multi-turn TTFT by turn, ITL beside a burst, prefill speed),
their Markdown tables and, for specdec servers, where the time to first token went."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Sequence

from specdec.benchmarks.serve_load_client import Record
from specdec.benchmarks.serve_load_parts import part_means_ms
from specdec.benchmarks.serve_load_report import DRAFTER_LABELS, _fmt, parts_table
from specdec.benchmarks.serve_load_stats import percentile, percentiles

SCENARIOS = ("turns", "burst", "prefill")


@dataclass
class ScenarioCell:
    """All rounds of one (server, drafter, load) of a scenario; the load is the clients (turns), the burst's
    size (burst) or the prompt's tokens (prefill)."""

    scenario: str  # one of SCENARIOS
    server: str
    drafter: str
    load: int
    records: dict[str, list[Record]] = field(default_factory=dict)  # by role: "turn1".., "running", "burst", "prefill"
    idle_gaps: list[float] = field(default_factory=list)  # burst: the running requests' chunk gaps, idle window
    burst_gaps: list[float] = field(default_factory=list)  # burst: their gaps overlapping the burst window
    ended_early: int = 0  # burst: running requests that ended before the burst's last first token
    seconds: float = 0.0
    parts: dict[str, list[float]] = field(default_factory=dict)  # TTFT part -> [Δsum s, Δcount] from /metrics


def _ttfts(records: Sequence[Record]) -> list[float]:
    return [r.ttft for r in records if r.ok and r.ttft is not None]


def _common(cell: ScenarioCell) -> dict[str, Any]:
    every = [r for records in cell.records.values() for r in records]
    ttft = _ttfts(every)
    return {"scenario": cell.scenario, "server": cell.server, "drafter": cell.drafter, "load": cell.load,
            "requests": len(every), "errors": sum(not r.ok for r in every), "seconds": cell.seconds,
            # every request's TTFT, as the client saw it: beside the server's parts, which cover the same requests
            "ttft_mean": sum(ttft) / len(ttft) if ttft else None, "ttft_parts_ms": part_means_ms(cell.parts)}


def summarize_scenario(cell: ScenarioCell) -> dict[str, Any]:
    """Return a scenario cell's figures (the scenario's own, then requests, errors and the TTFT parts)."""
    summary = _common(cell)
    if cell.scenario == "turns":
        turns = sorted(int(role[4:]) for role in cell.records)
        first = _ttfts(cell.records.get("turn1", []))
        for turn in turns:
            ttft = _ttfts(cell.records[f"turn{turn}"])
            records = cell.records[f"turn{turn}"]
            summary[f"turn{turn}"] = {
                "requests": len(records), "errors": sum(not r.ok for r in records),
                **percentiles(ttft, "ttft", (50, 90)),
                "prompt_tokens_mean": _mean([r.prompt_tokens for r in records]),
                # the target: a later turn's TTFT at most half the first's (its prefix is cached)
                "ratio_p50": _ratio(percentile(ttft, 50), percentile(first, 50)),
                "ratio_p90": _ratio(percentile(ttft, 90), percentile(first, 90))}
    elif cell.scenario == "burst":
        idle = percentiles(cell.idle_gaps, "idle_itl", (50, 99))
        burst = percentiles(cell.burst_gaps, "burst_itl", (50, 99))
        running = cell.records.get("running", [])
        summary.update(idle, **burst, idle_gaps=len(cell.idle_gaps), burst_gaps=len(cell.burst_gaps),
                       itl_p99_ratio=_ratio(burst["burst_itl_p99"], idle["idle_itl_p99"]),
                       **percentiles(_ttfts(cell.records.get("burst", [])), "burst_ttft", (50, 90)),
                       # usage's count; a request that failed midway: its chunks
                       running_tokens=[r.tokens if r.ok else len(r.chunk_times) for r in running],
                       ended_early=cell.ended_early)
    else:
        summary.update(_prefill_figures(cell.load, cell.records.get("prefill", [])))
    return summary


def _prefill_figures(length: int, records: Sequence[Record]) -> dict[str, Any]:
    """Return a prefill cell's figures: prompt tokens the server counted, TTFT and prompt tokens/s (medians)."""
    done = [r for r in records if r.ok]
    # max_tokens 1: a first token with no text (an end of text) streams none; its end is then the first token
    ttft = [r.ttft if r.ttft is not None else r.e2e for r in done]
    rates = [(r.prompt_tokens or length) / t for r, t in zip(done, ttft) if t]
    return {"prompt_tokens_reported": sorted({r.prompt_tokens for r in done}, key=lambda v: (v is None, v or 0)),
            "ttft_median": statistics.median(ttft) if ttft else None,
            "prompt_tokens_per_second": statistics.median(rates) if rates else None}


def _mean(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _label(s: dict[str, Any]) -> str:
    return DRAFTER_LABELS.get(s["drafter"], s["drafter"])


def _requests(s: dict[str, Any]) -> str:
    return f"{s['requests'] - s['errors']}" + (f" ({s['errors']} failed)" if s["errors"] else "")


def turns_table(summaries: Sequence[dict[str, Any]]) -> list[str]:
    """Return the multi-turn table's lines: TTFT p50 / p90 per turn, each later turn over the first."""
    lines = ["| server | clients | decoding | turn | requests | prompt tokens (mean) | TTFT p50 s | TTFT p90 s "
             "| vs turn 1 (p50) | vs turn 1 (p90) |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in summaries:
        for turn in sorted(int(key[4:]) for key in s if key.startswith("turn") and key[4:].isdigit()):
            t = s[f"turn{turn}"]
            lines.append(f"| {s['server']} | {s['load']} | {_label(s)} | {turn} | {_requests(t)} "
                         f"| {_fmt(t['prompt_tokens_mean'], 0)} | {_fmt(t['ttft_p50'], 3)} | {_fmt(t['ttft_p90'], 3)} "
                         + ("| - | - |" if turn == 1 else f"| {_times(t['ratio_p50'])} | {_times(t['ratio_p90'])} |"))
    return lines


def burst_table(summaries: Sequence[dict[str, Any]]) -> list[str]:
    """Return the burst table's lines: the running requests' ITL idle and in the burst, the burst's TTFT."""
    lines = ["| server | burst | decoding | requests | idle ITL p50 s | idle ITL p99 s | burst ITL p50 s "
             "| burst ITL p99 s | p99 burst / idle | burst TTFT p50 s | burst TTFT p90 s | gaps idle / burst "
             "| running tokens | running ended early |", "|---|---:|---|---:|" + "---:|" * 10]
    for s in summaries:
        lines.append(f"| {s['server']} | {s['load']} | {_label(s)} | {_requests(s)} | {_fmt(s['idle_itl_p50'], 3)} "
                     f"| {_fmt(s['idle_itl_p99'], 3)} | {_fmt(s['burst_itl_p50'], 3)} | {_fmt(s['burst_itl_p99'], 3)} "
                     f"| {_times(s['itl_p99_ratio'])} | {_fmt(s['burst_ttft_p50'], 3)} | {_fmt(s['burst_ttft_p90'], 3)} "
                     f"| {s['idle_gaps']} / {s['burst_gaps']} | {', '.join(map(str, s['running_tokens']))} "
                     f"| {s['ended_early']} |")
    return lines


def prefill_table(summaries: Sequence[dict[str, Any]]) -> list[str]:
    """Return the prefill table's lines: per server and prompt length, TTFT and prompt tokens/s (medians)."""
    lines = ["| server | prompt tokens | requests | prompt tokens the server counted | TTFT median s "
             "| prompt tokens/s (median) |", "|---|---:|---:|---|---:|---:|"]
    for s in summaries:
        counted = ", ".join("?" if v is None else str(v) for v in s["prompt_tokens_reported"]) or "-"
        lines.append(f"| {s['server']} | {s['load']} | {_requests(s)} | {counted} | {_fmt(s['ttft_median'], 3)} "
                     f"| {_fmt(s['prompt_tokens_per_second'], 0)} |")
    return lines


def scenario_markdown(summaries: Sequence[dict[str, Any]], setup: dict[str, Any]) -> str:
    """Return the scenario's report: setup, command, its table, and the TTFT parts where servers export them."""
    scenario = summaries[0]["scenario"] if summaries else setup.get("mode")
    table, load_name = {"turns": (turns_table, "clients"), "burst": (burst_table, "burst"),
                        "prefill": (prefill_table, "prompt tokens")}[scenario]
    lines = [f"Setup: {setup['setup']}", "", f"Command: `{setup['command']}`", "", *table(summaries),
             *parts_table(summaries, load_name, lambda s: str(s["load"]))]
    if setup.get("not_run"):
        lines += ["", f"Not run (time limit): {', '.join(setup['not_run'])}"]
    return "\n".join(lines) + "\n"
