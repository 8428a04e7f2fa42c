"""The load generator's report: a cell's figures (throughput, TTFT / ITL / TPOT / e2e percentiles,
goodput), the greedy-text comparison, the markdown table and the plot."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from specdec.benchmarks.serve_load_client import Record
from specdec.benchmarks.serve_load_parts import PARTS, part_means_ms
from specdec.benchmarks.serve_load_stats import (GoodputTargets, achieved_rate, count_good, inter_token_latencies,
                                                 percentiles, time_per_output_token)

DRAFTER_LABELS = {"none": "target-only", "ngram": "n-gram", "model": "draft model", "auto": "auto"}


@dataclass
class Cell:
    """All requests of one (server, drafter, load) with their wall time; the load is `concurrency`
    closed-loop clients, or open-loop arrivals at `rate` requests/s."""

    server: str
    drafter: str
    concurrency: int | None  # None in an open-loop cell
    records: list[Record] = field(default_factory=list)
    seconds: float = 0.0  # wall time of the cell's rounds, summed
    cpu_seconds: float | None = None  # CPU time of the server's processes over those rounds (servers started here)
    rate: float | None = None  # open loop: the requests/s asked for
    send_times: list[list[float]] = field(default_factory=list)  # open loop: per round, when each was sent
    not_sent: int = 0  # open loop: scheduled requests that the time limit kept from being sent
    parts: dict[str, list[float]] = field(default_factory=dict)  # TTFT part -> [Δsum s, Δcount] from /metrics


def summarize(cell: Cell, targets: GoodputTargets = GoodputTargets()) -> dict[str, Any]:
    """Return a cell's figures: requests, errors, tokens, tokens/s, requests/s, TTFT / ITL / TPOT / e2e
    percentiles, goodput under `targets`, tokens per target call, acceptance."""
    done = [r for r in cell.records if r.ok]
    tokens = sum(r.tokens for r in done)
    ttft = [r.ttft for r in done if r.ttft is not None]
    e2e = [r.e2e for r in done if r.e2e is not None]
    timed = [r for r in done if r.ttft is not None and r.e2e is not None]
    itl = [gap for r in done for gap in inter_token_latencies(r.chunk_times, r.chunk_tokens or None)]
    tpot_all = [time_per_output_token(r.chunk_times, r.tokens) for r in timed]
    good = count_good([r.ttft for r in timed], tpot_all, [r.e2e for r in timed], targets)
    calls = sum(r.target_calls for r in done)
    drafted = sum(r.drafted for r in done)
    seconds = cell.seconds if cell.seconds > 0 else None
    return {
        "server": cell.server, "drafter": cell.drafter, "concurrency": cell.concurrency, "rate": cell.rate,
        "requests": len(cell.records), "errors": len(cell.records) - len(done), "not_sent": cell.not_sent,
        "tokens": tokens, "seconds": cell.seconds,
        "tokens_per_second": tokens / seconds if seconds else None,
        "request_throughput": len(done) / seconds if seconds else None,  # completed requests/s (vLLM's)
        "send_rate": achieved_rate(cell.send_times),  # open loop: the rate the sender achieved
        # CPU the server got: cores used on average, and CPU per generated token (its work, whatever it waited)
        "server_cores": cell.cpu_seconds / cell.seconds if cell.cpu_seconds is not None and cell.seconds else None,
        "server_cpu_ms_per_token": 1000 * cell.cpu_seconds / tokens if cell.cpu_seconds is not None and tokens else None,
        **percentiles(ttft, "ttft"), **percentiles(itl, "itl"),
        # TPOT percentiles over requests of 2+ tokens, as vLLM's (goodput counts a 1-token request's as 0)
        **percentiles([t for t, r in zip(tpot_all, timed) if r.tokens > 1], "tpot"),
        **percentiles(e2e, "e2e"),
        "goodput_targets": {"ttft": targets.ttft, "itl": targets.itl, "e2el": targets.e2el},
        "good_requests": good,
        "goodput": good / seconds if seconds else None,  # requests/s that met every target (vLLM's goodput)
        "goodput_share": good / len(cell.records) if cell.records else None,  # of the requests sent
        # decode calls only: the prefill is one call per request whatever the drafter
        "tokens_per_target_call": (tokens - len(done)) / (calls - len(done)) if calls > len(done) else None,
        "acceptance_rate": sum(r.accepted for r in done) / drafted if drafted else None,
        "ttft_mean": sum(ttft) / len(ttft) if ttft else None,  # beside the server's TTFT parts, which add up to it
        "ttft_parts_ms": part_means_ms(cell.parts),
    }


def mismatches(cells: Sequence[Cell]) -> list[str]:
    """Return the prompt ids whose greedy texts differ between any two cells (drafters, servers)."""
    texts: dict[str, set[str]] = {}
    for cell in cells:
        for record in cell.records:
            if record.ok:
                texts.setdefault(record.prompt_id, set()).add(record.text)
    return sorted(pid for pid, variants in texts.items() if len(variants) > 1)


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _load(s: dict[str, Any]) -> str:
    return str(s["concurrency"]) if s["rate"] is None else f"{s['rate']:g}"


def markdown(summaries: Sequence[dict[str, Any]], setup: dict[str, Any]) -> str:
    """Return the report: setup, one table row per (server, load, drafter), speedup vs target-only."""
    base = {(s["server"], _load(s)): s for s in summaries if s["drafter"] == "none"}
    open_loop = any(s["rate"] is not None for s in summaries)
    lines = [f"Setup: {setup['setup']}", "", f"Command: `{setup['command']}`", "",
             f"| server | {'req/s asked' if open_loop else 'clients'} | decoding | requests "
             + ("| req/s sent | req/s done " if open_loop else "")
             + "| tok/s | vs target-only | TTFT p50 s | TTFT p90 s | TTFT p99 s | ITL p50 s | ITL p90 s | ITL p99 s "
             "| e2e p50 s | e2e p99 s | goodput | tokens/target call | server cores | server CPU ms/token |",
             "|---|---:|---|---:|" + ("---:|---:|" if open_loop else "") + "---:|" * 14]
    for s in summaries:
        ref = base.get((s["server"], _load(s)))
        ratio = (s["tokens_per_second"] / ref["tokens_per_second"]
                 if ref and s["drafter"] != "none" and s["tokens_per_second"] and ref["tokens_per_second"] else None)
        requests = f"{s['requests'] - s['errors']}" + (f" ({s['errors']} failed)" if s["errors"] else "")
        share = s.get("goodput_share")
        lines.append(f"| {s['server']} | {_load(s)} | {DRAFTER_LABELS.get(s['drafter'], s['drafter'])} "
                     f"| {requests} "
                     + (f"| {_fmt(s.get('send_rate'))} | {_fmt(s.get('request_throughput'))} " if open_loop else "")
                     + f"| {_fmt(s['tokens_per_second'], 1)} | {_fmt(ratio) + 'x' if ratio else '-'} "
                     f"| {_fmt(s['ttft_p50'])} | {_fmt(s.get('ttft_p90'))} | {_fmt(s['ttft_p99'])} "
                     f"| {_fmt(s.get('itl_p50'), 3)} | {_fmt(s.get('itl_p90'), 3)} | {_fmt(s.get('itl_p99'), 3)} "
                     f"| {_fmt(s['e2e_p50'])} | {_fmt(s['e2e_p99'])} "
                     f"| {'-' if share is None else f'{100 * share:.0f}%'} "
                     f"| {_fmt(s['tokens_per_target_call'])} | {_fmt(s.get('server_cores'))} "
                     f"| {_fmt(s.get('server_cpu_ms_per_token'), 0)} |")
    lines += ["", f"Goodput: share of the requests sent that met {setup.get('goodput', 'the targets')}.",
              f"Greedy texts equal across drafters and servers: {setup['equal_texts']}"]
    if setup.get("not_run"):
        lines.append(f"Not run (time limit): {', '.join(setup['not_run'])}")
    lines += parts_table(summaries, "req/s asked" if open_loop else "clients", _load)
    return "\n".join(lines) + "\n"


def parts_table(summaries: Sequence[dict[str, Any]], load_name: str, load_of: Callable[[dict], str]) -> list[str]:
    """Return the lines of the TTFT-parts table (a blank line first): per cell of a specdec server that exports
    them, each part's mean ms, their sum and the client's mean TTFT; no lines when no cell has them."""
    rows = [s for s in summaries if s.get("ttft_parts_ms")]
    if not rows:
        return []
    lines = ["", "Where the first token's time went (specdec's `specdec:ttft_part_seconds`: mean ms per request "
             "over every request of the cell; the client's TTFT also holds the network's share):", "",
             f"| server | {load_name} | decoding | " + " | ".join(PARTS) + " | sum of parts | client TTFT mean |",
             "|---|---:|---|" + "---:|" * (len(PARTS) + 2)]
    for s in rows:
        means, mean = s["ttft_parts_ms"], s.get("ttft_mean")
        lines.append(f"| {s['server']} | {load_of(s)} | {DRAFTER_LABELS.get(s['drafter'], s['drafter'])} | "
                     + " | ".join(_fmt(means.get(p), 1) for p in PARTS)
                     + f" | {_fmt(means.get('sum'), 1)} | {_fmt(None if mean is None else 1000 * mean, 1)} |")
    return lines


def plot(summaries: Sequence[dict[str, Any]], path: str) -> None:
    """Write a PNG: aggregate tokens/s (left) and TTFT p90 (right) against clients (or the open-loop rate),
    a line per server x decoding."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    lines: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for s in summaries:
        lines.setdefault((s["server"], s["drafter"]), []).append(s)
    open_loop = any(s["rate"] is not None for s in summaries)
    x_of = (lambda s: s["rate"]) if open_loop else (lambda s: s["concurrency"])
    for (server, drafter), points in lines.items():
        points = sorted(points, key=x_of)
        label = f"{server}, {DRAFTER_LABELS.get(drafter, drafter)}"
        xs = [x_of(s) for s in points]
        left.plot(xs, [s["tokens_per_second"] or 0 for s in points], marker="o", label=label)
        right.plot(xs, [s.get("ttft_p90") or 0 for s in points], marker="o", label=label)
    ticks = sorted({x_of(s) for s in summaries})
    for axis, title in ((left, "aggregate output tokens/s"), (right, "time to first token, p90 (s)")):
        axis.set_xscale("log", base=2)
        axis.set_xticks(ticks, [f"{t:g}" for t in ticks])
        axis.set_xlabel("requests/s asked (open loop)" if open_loop else "streaming clients")
        axis.set_title(title)
        axis.grid(alpha=0.3)
    right.set_yscale("log")
    left.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
