"""The load generator's pure math: the order of its rounds, arrival schedules, inter-token latencies from chunk
timestamps (and their split into an idle and a burst window), time per output token, percentiles and goodput.
No I/O; every function is tested with hand-made cases (tests/bench/test_serve_load_stats.py).

Definitions follow vLLM's `benchmark_serving` (benchmarks/benchmark_serving.py, now
vllm/benchmarks/serve.py) so figures read alike:
- TTFT: seconds from sending a request to its first chunk carrying text.
- ITL: the gaps between a request's successive text chunks, pooled over all requests for percentiles.
- TPOT: per request, (last text chunk - TTFT) / (output tokens - 1); 0 for one token or none.
- goodput: requests that met every target (TTFT <= t, TPOT <= t, end-to-end <= t, all inclusive) per
  second of the run; we also give their share of the requests sent (failed ones count as not met).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

ARRIVALS = ("poisson", "constant")
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class GoodputTargets:
    """Per-request latency targets (seconds); None leaves a figure out of goodput."""

    ttft: float | None = 0.5  # time to first token
    itl: float | None = 0.1  # vLLM's TPOT target: the request's mean gap per token after the first
    e2el: float | None = None  # end-to-end latency


def percentile(values: Sequence[float], q: float) -> float | None:
    """Return the q-th percentile (numpy's linear interpolation) of `values`, or None when empty."""
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else None


def percentiles(values: Sequence[float], name: str, qs: Sequence[int] = PERCENTILES) -> dict[str, float | None]:
    """Return {f"{name}_p{q}": q-th percentile} for each q (None when `values` is empty)."""
    return {f"{name}_p{q}": percentile(values, q) for q in qs}


def arrival_times(n: int, rate: float, seed: int | Sequence[int], kind: str = "poisson") -> np.ndarray:  # [n] s
    """Return the send times of `n` requests at `rate` requests/s, from 0: the first is sent at once.

    "poisson": gaps drawn from an exponential of mean 1/rate (a Poisson process, vLLM's burstiness 1),
    from numpy's generator seeded with `seed` (an int or ints); "constant": gaps of exactly 1/rate.
    E.g. n=3, rate=2, "constant" -> [0.0, 0.5, 1.0].
    """
    if n < 0 or not rate > 0:
        raise ValueError(f"arrival_times needs n >= 0 and rate > 0, got n={n}, rate={rate}")
    if kind == "constant":
        gaps = np.full(max(n - 1, 0), 1.0 / rate)
    elif kind == "poisson":
        gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=max(n - 1, 0))
    else:
        raise ValueError(f"unknown arrivals '{kind}' (use {', '.join(ARRIVALS)})")
    return np.concatenate([np.zeros(min(n, 1)), np.cumsum(gaps)])


def inter_token_latencies(chunk_times: Sequence[float], chunk_tokens: Sequence[int] | None = None) -> list[float]:
    """Return a request's inter-token latencies (seconds) from the arrival times of its text chunks.

    chunk_times: [chunks] seconds from sending to each chunk that carried text (the first one is TTFT).
    chunk_tokens: [chunks] completion tokens so far as the server reported with each chunk, or None.

    vLLM's benchmark_serving appends one gap per chunk whatever it carries (a chunk of several tokens is
    one long gap); it counts multi-token chunks only in TPOT. SGLang's bench_serving, when it knows each
    chunk's token count, spreads a chunk's gap evenly over its new tokens (`adjust_itl`) and a chunk with
    no new token passes its gap on to the next. We do SGLang's split when counts are given for every
    chunk (vLLM streams them with stream_options.continuous_usage_stats), vLLM's gap per chunk otherwise.
    E.g. times [1.0, 1.2, 1.8] -> [0.2, 0.6]; with tokens [1, 2, 5] -> [0.2, 0.2, 0.2, 0.2].
    """
    times = [float(t) for t in chunk_times]
    if chunk_tokens is None or len(chunk_tokens) != len(times):
        return [b - a for a, b in zip(times, times[1:])]
    gaps: list[float] = []
    last_time, last_tokens = (times[0], chunk_tokens[0]) if times else (0.0, 0)
    for time, tokens in zip(times[1:], chunk_tokens[1:]):
        new = tokens - last_tokens
        if new <= 0:  # no new token: its gap rolls into the next chunk's, as SGLang does
            continue
        gaps += [(time - last_time) / new] * new
        last_time, last_tokens = time, tokens
    return gaps


def time_per_output_token(chunk_times: Sequence[float], tokens: int) -> float:
    """Return vLLM's TPOT: (last text chunk - first) / (tokens - 1) seconds, or 0.0 for one token or none.

    It is the request's mean gap per token after the first, whatever the chunks carried."""
    if tokens <= 1 or not len(chunk_times):
        return 0.0
    return (float(chunk_times[-1]) - float(chunk_times[0])) / (tokens - 1)


def meets_targets(ttft: float, tpot: float, e2el: float, targets: GoodputTargets) -> bool:
    """Return whether one completed request met every target that is set (each bound inclusive)."""
    return all(value <= bound for value, bound in ((ttft, targets.ttft), (tpot, targets.itl), (e2el, targets.e2el))
               if bound is not None)


def count_good(ttft: Sequence[float], tpot: Sequence[float], e2el: Sequence[float], targets: GoodputTargets) -> int:
    """Return how many completed requests met every target; the three sequences hold one entry per request."""
    if not len(ttft) == len(tpot) == len(e2el):
        raise ValueError(f"one entry per request: got {len(ttft)} TTFT, {len(tpot)} TPOT, {len(e2el)} e2e")
    return sum(meets_targets(a, b, c, targets) for a, b, c in zip(ttft, tpot, e2el))


def achieved_rate(send_times: Sequence[Sequence[float]]) -> float | None:
    """Return the request rate the sender achieved over its rounds: gaps between sends / seconds they took.

    send_times: one list per round of the seconds each request was actually sent. A round of n sends
    spans n - 1 gaps, so (n - 1) / span estimates the rate; rounds are pooled. None under 2 sends a round.
    E.g. [[0.0, 0.5, 1.0], [0.0, 1.0]] -> 3 gaps / 2.0 s = 1.5.
    """
    gaps = sum(max(len(times) - 1, 0) for times in send_times)
    span = sum(float(max(times)) - float(min(times)) for times in send_times if len(times) > 1)
    return gaps / span if gaps and span > 0 else None


def window_gaps(chunk_times: Sequence[float], idle: tuple[float, float],
                burst: tuple[float, float]) -> tuple[list[float], list[float]]:
    """Return (idle gaps, burst gaps): a running request's gaps between successive text chunks, split by window.

    chunk_times: [chunks] when each text chunk arrived, on the clock the windows use.
    idle: (start, end) of the idle window; a gap counts there when it lies wholly inside it.
    burst: (start, end) of the burst window (from sending the burst until its last request's first token); a
    gap counts there when it overlaps it: the gap the burst's arrival cut into and the one it ended in
    (the "one gap after") count too.
    E.g. times [0, 1, 2, 3, 5, 6], idle (0, 2.5), burst (2.5, 4) -> ([1, 1], [1, 2]).
    """
    idle_gaps, burst_gaps = [], []
    for before, after in zip(chunk_times, chunk_times[1:]):
        if idle[0] <= before and after <= idle[1]:
            idle_gaps.append(after - before)
        if after > burst[0] and before < burst[1]:
            burst_gaps.append(after - before)
    return idle_gaps, burst_gaps


def rounds(servers: Sequence[str], drafters: Sequence[str], concurrency: Sequence[float], repeats: int,
           plain: Sequence[str] = ()) -> Iterator[tuple[float, int, str, str]]:
    """Yield (load, round, server, drafter) in run order: per load (clients, or an open-loop rate), rounds
    alternate all pairs.

    A `plain` server (not specdec) runs only its own decoding, under the drafter label "none"."""
    for c in concurrency:
        for repeat in range(repeats):
            pairs = [(s, d) for s in servers for d in drafters if s not in plain or d == "none"]
            if repeat % 2:  # the second round runs the pairs backwards, so no pair always runs first
                pairs.reverse()
            for server, drafter in pairs:
                yield c, repeat, server, drafter


def round_sizes(requests: int, repeats: int, clients: int, min_waves: int = 0) -> list[int]:
    """Return the requests of each round of a cell: `requests` split over `repeats` rounds, but at least
    `min_waves` x `clients` a round."""
    return [max(requests // repeats + (1 if r < requests % repeats else 0), min_waves * clients)
            for r in range(repeats)]


def round_start(sizes: list[int], repeat: int, clients: int, cases: int) -> int:
    """Return the index (mod `cases`) of round `repeat`'s first case: just after the cases the earlier rounds
    sent, so that a cell sends every case once before any twice; where those rounds ended on a whole pass
    over the cases, `clients` further per round, so that no two rounds' first requests are the same ones.
    Example (16 cases): rounds of 8 at 1 client start at 0, 8; rounds of 16 at 4 clients at 0, 20, 40."""
    start = sum(sizes[:repeat])
    return start if start % cases else start + repeat * clients
