"""Measuring what target calls cost on this machine: timed calls, and a per-machine disk cache of the result.

One entry point, `calibrate`: the t(n) table that `-k auto` needs for an artifact that
`specdec tune` did not time. The table is a fact of the graph, the hardware, the onnxruntime
build and the thread count, so one timing serves every later process that shares all four.
A missing, unreadable or read-only cache only costs the timing, never an error.

Cache location: $SPECDEC_CACHE_DIR, else $XDG_CACHE_HOME/specdec, else ~/.cache/specdec, under
call-costs/. SPECDEC_NO_CACHE=1 turns it off.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from specdec.models.manifest import is_call_cost_table
from specdec.runtime.call_costs import non_decreasing, relative_costs_from_step_times
from specdec.runtime.machine import cpu_model
from specdec.runtime.providers import ort
from specdec.runtime.session import ModelSession


@dataclass(frozen=True)
class Calibration:
    """A t(n) table and where it came from."""

    call_costs: dict[int, float]  # n -> t(n) / t(1), n = 1..max_tokens (at least)
    source: str  # "cache" (an earlier process on this machine) or "timed" (just now)
    seconds: float  # spent timing (0 from the cache)
    cache_file: Path | None  # where a timed table was kept (None: not kept)


def calibrate(target: ModelSession, context: list[int], max_tokens: int, threads: int | None) -> Calibration:
    """Return t(n) for n = 1..max_tokens: from the disk cache, else timed now (CALIBRATION_ROUNDS rounds,
    made non-decreasing) and cached.

    context: tokens the timed calls run after (see `timing_context`).
    """
    target_files = ",".join(f"{name}={digest}" for name, digest in sorted(target.spec.sha256.items()))
    key = cache_key(target_files, target.device, threads, ort.__version__)
    cached = load_call_costs(key, max_tokens)
    if cached is not None:
        return Calibration(cached, "cache", 0.0, None)
    start = time.perf_counter()
    costs = non_decreasing(relative_costs_from_step_times(
        step_times(target, timing_context(context, target.spec.max_positions - max_tokens),
                   max_tokens, repeats=CALIBRATION_ROUNDS)), pinned=1)
    return Calibration(costs, "timed", time.perf_counter() - start, save_call_costs(key, costs))


def timing_context(context: list[int], room: int) -> list[int]:
    """Return CALIBRATION_CONTEXT tokens (at most `room`) for timed calls to run after: the end of
    `context`, repeated when it is shorter.

    A call's cost curve depends on the past it attends over (SmolLM2, 2 threads: t(2) 1.06 after 32
    tokens, 1.10 after 256), and the table is kept for every later request: it should not depend on
    how long the first one happened to be.
    """
    length = max(1, min(CALIBRATION_CONTEXT, room))
    tokens = list(context) or [0]
    return (tokens * (length // len(tokens) + 1))[-length:]


def step_times(session: ModelSession, context: list[int], max_tokens: int, repeats: int = 5) -> list[float]:
    """Return the median seconds of one call over n = 1..max_tokens new tokens after `context`.

    Each call is rolled back before the next, so every measurement starts from the same
    cache; the lengths take turns within each round, so drift of a noisy machine hits all alike.
    """
    cache = session.new_cache()
    session.forward(cache, context, logits_rows=1)
    samples: list[list[float]] = [[] for _ in range(max_tokens)]
    for _ in range(repeats):
        for n in range(1, max_tokens + 1):
            tokens = context[-n:] if len(context) >= n else (context * n)[:n]
            before = cache.run_seconds
            session.forward(cache, tokens)
            samples[n - 1].append(cache.run_seconds - before)
            cache.rollback(len(context))
    return [statistics.median(times) for times in samples]


CACHE_DIR_ENV = "SPECDEC_CACHE_DIR"
NO_CACHE_ENV = "SPECDEC_NO_CACHE"
_FORMAT = 2  # 2: 7 rounds, pooled non-decreasing (3-round tables read t(2) 15-20% high on a noisy box)
CALIBRATION_CONTEXT = 256  # prompt tokens the timed calls run after
CALIBRATION_ROUNDS = 7


def cache_dir() -> Path | None:
    """Return the folder holding cached call-cost tables, or None when caching is off."""
    if os.environ.get(NO_CACHE_ENV, "").strip() not in ("", "0"):
        return None
    root = os.environ.get(CACHE_DIR_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "specdec")
    return Path(root) / "call-costs"


def cache_key(graph_digest: str, device: str, threads: int | None, runtime_version: str) -> str:
    """Return the file stem naming one (graph, device, threads, onnxruntime, machine) combination.

    graph_digest: anything that changes with the target's files (the engine joins their sha256s).
    """
    parts = {"graph": graph_digest, "device": device, "threads": threads or os.cpu_count(),
             "onnxruntime": runtime_version, "machine": platform.machine(), "cpu": cpu_model(),
             "cpus": os.cpu_count()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def load_call_costs(key: str, max_tokens: int) -> dict[int, float] | None:
    """Return the cached {n: t(n) / t(1)} for n = 1..(at least) max_tokens, or None if there is none.

    A file that is unreadable, of another format, or shorter than max_tokens counts as none.
    """
    folder = cache_dir()
    if folder is None:
        return None
    try:
        data = json.loads((folder / f"{key}.json").read_text())
        costs = data["call_costs"]
        if data.get("format") != _FORMAT or not is_call_cost_table(costs) or len(costs) < max_tokens:
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return {n: float(c) for n, c in enumerate(costs, start=1)}


def save_call_costs(key: str, costs: dict[int, float]) -> Path | None:
    """Write the table for `key` atomically; return its path, or None when it could not be written."""
    folder = cache_dir()
    if folder is None or not costs:
        return None
    table = [costs[n] for n in range(1, max(costs) + 1) if n in costs]
    if len(table) != max(costs):
        return None  # only a gapless 1..n table is worth keeping
    path = folder / f"{key}.json"
    temporary: str | None = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        # Rename over the old file, so a reader in another process never sees half a table.
        with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".tmp", delete=False) as out:
            temporary = out.name
            json.dump({"format": _FORMAT, "call_costs": table}, out)
        os.replace(temporary, path)
    except OSError:
        if temporary is not None:
            Path(temporary).unlink(missing_ok=True)
        return None
    return path
