"""Where a specdec server's time to first token went, per cell of the load generator: its /metrics histogram
`specdec:ttft_part_seconds{model_name, part}` read before and after the cell, each part's mean over the cell's
requests as Δsum / Δcount. A server without that histogram (another server, an older specdec) gives nothing.

Parts, in the order a first token meets them: server (arrival to handed to the engine), step_boundary (to the
scheduler's first look between steps), slot_wait, chunk_wait, prefill, stream (first token computed to first
piece sent); they add up to the TTFT the server saw, which the client sees plus the network's share.
"""

from __future__ import annotations

from typing import Mapping

METRIC = "specdec:ttft_part_seconds"
PARTS = ("server", "step_boundary", "slot_wait", "chunk_wait", "prefill", "stream")

Totals = dict[str, tuple[float, float]]  # part -> (sum of seconds, count), summed over every label set


def parse_ttft_parts(text: str) -> Totals | None:
    """Return {part: (seconds summed, requests counted)} from a Prometheus text exposition, or None when it holds
    no `specdec:ttft_part_seconds` histogram.

    E.g. 'specdec:ttft_part_seconds_sum{model_name="m",part="prefill"} 0.5' and '..._count{...} 2' ->
    {"prefill": (0.5, 2.0)}.
    """
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, list[float]] = {}
    found = False
    for family in text_string_to_metric_families(text):
        found = found or family.name == METRIC
        for sample in family.samples:  # by the sample's name: an untyped exposition gives a family per sample name
            kind = sample.name[len(METRIC):] if sample.name.startswith(METRIC) else None
            if kind not in ("_sum", "_count") or "part" not in sample.labels:
                continue
            found = True
            entry = totals.setdefault(sample.labels["part"], [0.0, 0.0])
            entry[0 if kind == "_sum" else 1] += sample.value
    return {part: (s, c) for part, (s, c) in totals.items()} if found else None


def parts_delta(before: Totals | None, after: Totals | None) -> Totals | None:
    """Return each part's (Δsum, Δcount) from `before` to `after` (a part absent before counts from 0), or None
    unless both were read."""
    if before is None or after is None:
        return None
    return {part: (s - before.get(part, (0.0, 0.0))[0], c - before.get(part, (0.0, 0.0))[1])
            for part, (s, c) in after.items()}


def add_totals(into: dict[str, list[float]], delta: Totals | None) -> None:
    """Add one round's (Δsum, Δcount) per part to a cell's running totals (nothing for None)."""
    for part, (s, c) in (delta or {}).items():
        entry = into.setdefault(part, [0.0, 0.0])
        entry[0] += s
        entry[1] += c


def part_means_ms(totals: Mapping[str, tuple[float, float] | list[float]]) -> dict[str, float | None]:
    """Return {part: mean milliseconds} (PARTS first in their order, any other part after; None where nothing was
    counted), plus "sum": the parts' means added up (None when any is missing); {} when nothing was counted."""
    if not any(count > 0 for _, count in totals.values()):
        return {}
    order = [p for p in PARTS if p in totals] + sorted(p for p in totals if p not in PARTS)
    means = {part: 1000.0 * totals[part][0] / totals[part][1] if totals[part][1] > 0 else None for part in order}
    values = list(means.values())
    means["sum"] = sum(values) if values and None not in values else None
    return means


def scrape_ttft_parts(url: str) -> Totals | None:
    """Return the parts' totals on the server at `url` (GET /metrics), or None if it has none or did not answer."""
    import httpx

    try:
        reply = httpx.get(url + "/metrics", timeout=10, trust_env=False)
    except httpx.HTTPError:
        return None
    return parse_ttft_parts(reply.text) if reply.status_code == 200 else None
