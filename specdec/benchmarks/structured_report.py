"""The structured-output benchmark's figures and report: validity, tokens/s and TTFT (serve_load_report's
summary), prediction tokens, the grammar's mask cost per target call, speculation / target-only ratios per
round, the Markdown report and the plot."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from specdec.benchmarks.serve_load_client import Record
from specdec.benchmarks.serve_load_report import Cell, summarize
from specdec.benchmarks.structured_workloads import StructuredItem, check_answer

BASE_SERVER = "specdec"  # every ratio is against this server's target-only cell of the same workload and clients
# "none" is also the label of the anchors' own plain decoding (no speculation)
LABELS = {"none": "target-only", "auto": "speculation"}


@dataclass
class StructuredCell(Cell):
    """serve_load's Cell of one workload, with each round's tokens and seconds (for paired ratios)."""

    workload: str = ""
    round_tokens: list[int] = field(default_factory=list)
    round_seconds: list[float] = field(default_factory=list)


def edit_references(cells: Iterable[StructuredCell]) -> dict[str, str]:
    """Return {prompt id: text} of specdec's target-only edits, each from the cell with the fewest clients that
    answered it (the reference every edit's text must equal)."""
    references: dict[str, str] = {}
    ordered = sorted((c for c in cells if c.server == BASE_SERVER and c.drafter == "none" and c.workload == "edit"),
                     key=lambda c: c.concurrency or 0)
    for cell in ordered:
        for record in cell.records:
            if record.ok:
                references.setdefault(record.prompt_id, record.text)
    return references


def answer(record: Record) -> str:
    """Return a record's whole answer as one string: its text, then its tool calls (name and arguments)."""
    return record.text + "".join(f"\n{call.get('name')}({call.get('arguments')})" for call in record.tool_calls)


def differing(cells: Iterable[StructuredCell]) -> list[str]:
    """Return the prompt ids whose greedy answers (text and tool calls) differ between any two of `cells`."""
    answers: dict[str, set[str]] = {}
    for cell in cells:
        for record in cell.records:
            if record.ok:
                answers.setdefault(record.prompt_id, set()).add(answer(record))
    return sorted(pid for pid, variants in answers.items() if len(variants) > 1)


def validity(records: Sequence[Record], items: Mapping[str, StructuredItem],
             references: Mapping[str, str]) -> tuple[int, int, str | None, int]:
    """Return (valid answers, answers checked, the first invalid one's reason, invalid answers cut at max_tokens)
    over the completed records."""
    valid, checked, first, cut = 0, 0, None, 0
    for record in records:
        if not record.ok:
            continue
        checked += 1
        reason = check_answer(items[record.prompt_id], record.text, record.tool_calls, references.get(record.prompt_id))
        if reason is None:
            valid += 1
            continue
        cut += record.finish_reason == "length"
        if first is None:
            first = f"{record.prompt_id}: {reason}"
    return valid, checked, first, cut


def mask_cost(records: Sequence[Record]) -> tuple[float | None, float | None]:
    """Return (mask milliseconds per target call, mask seconds / total seconds) over the records whose specdec
    stats carry mask_seconds: sums over requests, not means of ratios; (None, None) when none do.

    E.g. stats {mask 0.02 s, 10 calls, 1.0 s} and {0.04 s, 20 calls, 1.0 s} -> (2.0, 0.03).
    """
    stats = [r.stats for r in records if r.ok and "mask_seconds" in r.stats]
    if not stats:
        return None, None
    mask = sum(s["mask_seconds"] for s in stats)
    calls = sum(s.get("target_calls", 0) for s in stats)
    total = sum(s.get("total_seconds", 0.0) for s in stats)
    return (1000 * mask / calls if calls else None), (mask / total if total else None)


def prediction_totals(records: Sequence[Record]) -> tuple[int, int] | None:
    """Return (accepted, rejected) prediction tokens summed over the records that reported them, else None."""
    counted = [r.prediction_tokens for r in records if r.ok and r.prediction_tokens is not None]
    if not counted:
        return None
    return sum(a for a, _ in counted), sum(b for _, b in counted)


def round_ratios(cell: StructuredCell, base: StructuredCell) -> list[float]:
    """Return tokens/s of `cell` over `base` round by round (rounds run side by side, alternating order); rounds
    either lacks or with no tokens are left out. E.g. (100 tok / 2 s, 90 / 3) over (50 / 2, 60 / 3) -> [2.0, 1.5]."""
    ratios = []
    for tokens, seconds, base_tokens, base_seconds in zip(cell.round_tokens, cell.round_seconds,
                                                          base.round_tokens, base.round_seconds):
        if tokens and seconds > 0 and base_tokens and base_seconds > 0:
            ratios.append((tokens / seconds) / (base_tokens / base_seconds))
    return ratios


def summarize_cell(cell: StructuredCell, items: Mapping[str, StructuredItem], references: Mapping[str, str],
                   base: StructuredCell | None = None) -> dict[str, Any]:
    """Return a cell's figures: serve_load's (tokens/s, TTFT, ...) plus validity, prediction tokens, mask cost and
    its tokens/s against `base` (specdec's target-only cell of the same workload and clients)."""
    summary = summarize(cell)
    valid, checked, first, cut = validity(cell.records, items, references)
    mask_ms, mask_share = mask_cost(cell.records)
    predicted = prediction_totals(cell.records)
    ratio = ratios = None
    if base is not None and base is not cell:
        mine, theirs = summary["tokens_per_second"], summarize(base)["tokens_per_second"]
        ratio = mine / theirs if mine and theirs else None
        ratios = round_ratios(cell, base)
    return {**summary, "workload": cell.workload, "valid": valid, "checked": checked,
            "validity": valid / checked if checked else None, "first_invalid": first, "invalid_cut": cut,
            "accepted_prediction_tokens": predicted[0] if predicted else None,
            "rejected_prediction_tokens": predicted[1] if predicted else None,
            "mask_ms_per_target_call": mask_ms, "mask_share": mask_share,
            "vs_target_only": ratio, "round_ratios": ratios,
            "round_ratio_median": statistics.median(ratios) if ratios else None}


def _fmt(value: float | None, digits: int = 2, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def _ratio_text(s: dict[str, Any]) -> str:
    if s["vs_target_only"] is None:
        return "-"
    rounds = s["round_ratios"] or []
    spread = f" ({min(rounds):.2f}-{max(rounds):.2f})" if len(rounds) > 1 else ""
    return f"{s['vs_target_only']:.2f}x{spread}"


def markdown(summaries: Sequence[dict[str, Any]], setup: dict[str, Any]) -> str:
    """Return the report: setup, CPU, threads and command, then one table per workload (a row per server x clients
    x decoding) and each server's first invalid answer."""
    lines = ["# Structured outputs, tool calls and predicted edits: speculation against target-only", "",
             f"Setup: {setup['setup']}", "", f"CPU: {setup['cpu']}; threads per server: {setup['threads']}", "",
             f"Command: `{setup['command']}`", "",
             "Valid: extract answers that parse and meet their JSON schema; tool calls that name one of the request's "
             "tools with arguments that meet its parameters; edits whose text equals specdec's target-only text of "
             "the same request (greedy); cut: invalid because max_tokens ended the answer. vs target-only: tokens/s over specdec's target-only cell of the same "
             "workload and clients, all rounds pooled (in brackets the lowest and highest single round; rounds "
             "alternate the servers and decodings). Mask: time building grammar masks per target call, and its "
             "share of the requests' total seconds (specdec's own stats).", ""]
    for workload in dict.fromkeys(s["workload"] for s in summaries):
        rows = [s for s in summaries if s["workload"] == workload]
        lines += [f"## {workload}", "",
                  "| server | clients | decoding | requests | valid | tok/s | vs target-only | TTFT p50 s | TTFT p90 s "
                  "| tokens/target call | mask ms/call | mask share | prediction tokens accepted / rejected |",
                  "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for s in rows:
            requests = f"{s['requests'] - s['errors']}" + (f" ({s['errors']} failed)" if s["errors"] else "")
            cut = f"; {s['invalid_cut']} cut" if s.get("invalid_cut") else ""
            valid = "-" if s["validity"] is None else f"{100 * s['validity']:.0f}% ({s['valid']}/{s['checked']}{cut})"
            predicted = ("-" if s["accepted_prediction_tokens"] is None
                         else f"{s['accepted_prediction_tokens']} / {s['rejected_prediction_tokens']}")
            share = s["mask_share"]
            lines.append(f"| {s['server']} | {s['concurrency']} | {LABELS.get(s['drafter'], s['drafter'])} "
                         f"| {requests} | {valid} | {_fmt(s['tokens_per_second'], 1)} | {_ratio_text(s)} "
                         f"| {_fmt(s['ttft_p50'])} | {_fmt(s['ttft_p90'])} | {_fmt(s['tokens_per_target_call'])} "
                         f"| {_fmt(s['mask_ms_per_target_call'])} | {'-' if share is None else f'{100 * share:.1f}%'} "
                         f"| {predicted} |")
        firsts = {s["server"]: s["first_invalid"] for s in reversed(rows) if s["first_invalid"]}
        if firsts:
            lines += ["", "First invalid answer: " + "; ".join(f"{server}, {first}" for server, first in firsts.items())]
        lines.append("")
    lines.append(f"Greedy answers equal across specdec's decodings: {setup['equal_texts']}")
    for note in setup.get("notes", []):
        lines.append(f"Note: {note}")
    if setup.get("not_run"):
        lines.append(f"Not run (time limit): {', '.join(setup['not_run'])}")
    if setup.get("plot"):
        lines += ["", f"![tokens/s by clients, per workload]({setup['plot']})"]
    return "\n".join(lines) + "\n"


def plot(summaries: Sequence[dict[str, Any]], path: str) -> None:
    """Write a PNG: aggregate tokens/s against clients, one panel per workload, a line per server x decoding."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(s["workload"] for s in summaries))
    figure, axes = plt.subplots(1, len(workloads), figsize=(4.6 * len(workloads), 4.0), squeeze=False)
    for axis, workload in zip(axes[0], workloads):
        lines: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for s in summaries:
            if s["workload"] == workload:
                lines.setdefault((s["server"], s["drafter"]), []).append(s)
        for (server, drafter), points in lines.items():
            points = sorted(points, key=lambda s: s["concurrency"])
            axis.plot([s["concurrency"] for s in points], [s["tokens_per_second"] or 0 for s in points], marker="o",
                      label=f"{server}, {LABELS.get(drafter, drafter)}")
        ticks = sorted({s["concurrency"] for s in summaries})
        axis.set_xscale("log", base=2)
        axis.set_xticks(ticks, [str(t) for t in ticks])
        axis.set_ylim(bottom=0)
        axis.set_xlabel("streaming clients")
        axis.set_title(f"{workload}: output tokens/s")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
