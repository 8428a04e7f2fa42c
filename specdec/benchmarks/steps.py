"""Step-time benchmark: one target call over n new tokens on a past of P tokens, per graph.

Graphs are timed in alternation (each repetition visits all of them, order flipped every
time), and each figure is a median; the call is rolled back after every measurement so all
start from the same cache. Sessions must be made with spin=False: graphs that take turns
call by call would otherwise slow each other with busy-waiting threads (providers.py).
A graph in another process (onnxruntime-genai's) cannot take turns call by call: `specdec
bench --steps` times everything in rounds instead, both sides in every round, and reads the
medians of the rounds (`median_of_rounds`) and the side-by-side ratio per round (`round_ratios`),
since this machine's speed drifts by tens of percent over minutes.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import numpy as np

from specdec.runtime.session import ModelSession

PAST_LENGTHS = (64, 256, 1024)
NEW_TOKENS = (1, 5, 8)
STEP_REPEATS_PER_ROUND = 3  # `bench --steps`: repetitions of each cell per round


def time_steps(sessions: dict[str, ModelSession], past_lengths: Sequence[int] = PAST_LENGTHS,
               new_tokens: Sequence[int] = NEW_TOKENS, repeats: int = 9, seed: int = 0,
               progress: Callable[[str], None] = lambda message: None) -> dict[tuple[str, int, int], float]:
    """Return {(graph, past, n): median seconds of one call}; past lengths the models cannot hold are skipped."""
    limit = min(s.spec.max_positions for s in sessions.values())
    past_lengths = [p for p in past_lengths if p + max(new_tokens) <= limit]
    rng = np.random.default_rng(seed)
    vocab = min(s.vocab_limit for s in sessions.values())
    tokens = rng.integers(100, vocab, size=max(past_lengths, default=0) + max(new_tokens)).tolist()
    medians = {}
    for past in past_lengths:
        progress(f"past {past}")
        caches = {}
        for name, session in sessions.items():
            caches[name] = session.new_cache()
            session.forward(caches[name], tokens[:past], logits_rows=1)
        samples: dict[tuple[str, int], list[float]] = {(name, n): [] for name in sessions for n in new_tokens}
        names = list(sessions)
        for repeat in range(repeats):
            for n in new_tokens:
                for name in (names if repeat % 2 == 0 else names[::-1]):
                    cache = caches[name]
                    start = time.perf_counter()
                    sessions[name].forward(cache, tokens[past:past + n])
                    samples[(name, n)].append(time.perf_counter() - start)
                    cache.rollback(past)
        for (name, n), values in samples.items():
            medians[(name, past, n)] = statistics.median(values)
    return medians


def median_of_rounds(rounds: list[dict[tuple[str, int, int], float]]) -> dict[tuple[str, int, int], float]:
    """Return {(graph, past, n): median over the rounds of that cell's figure} (cells missing from a round skipped)."""
    cells = dict.fromkeys(cell for figures in rounds for cell in figures)
    return {cell: statistics.median(f[cell] for f in rounds if cell in f) for cell in cells}


def round_ratios(rounds: list[dict[tuple[str, int, int], float]], numerator: str,
                 denominator: str) -> dict[tuple[int, int], list[float]]:
    """Return {(past, n): [numerator / denominator in each round that timed both]}: ratios of figures
    taken minutes apart at most, where the medians of two separate runs drift more than the graphs differ."""
    out: dict[tuple[int, int], list[float]] = {}
    for figures in rounds:
        for (graph, past, n), seconds in figures.items():
            other = figures.get((denominator, past, n))
            if graph == numerator and other:
                out.setdefault((past, n), []).append(seconds / other)
    return out


def ratio_table(ratios: dict[tuple[int, int], list[float]], numerator: str, denominator: str) -> str:
    """Return the per-round ratios (of call times: above 1, the numerator is slower) as a Markdown table:
    median and range per past and call size."""
    ns = sorted({n for _, n in ratios})
    lines = [f"| time {numerator} / {denominator}, past | " + " | ".join(f"{n} token{'s' if n > 1 else ''}" for n in ns)
             + " |", "|---|" + "---|" * len(ns)]
    for past in sorted({p for p, _ in ratios}):
        cells = []
        for n in ns:
            values = ratios.get((past, n), [])
            cells.append(f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})" if values else "")
        lines.append(f"| {past} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def steps_table(medians: dict[tuple[str, int, int], float]) -> str:
    """Return the step times as a Markdown table, with the n-token / 1-token ratios."""
    graphs = list(dict.fromkeys(name for name, _, _ in medians))
    pasts = sorted({past for _, past, _ in medians})
    ns = sorted({n for _, _, n in medians})
    header = "| graph | past | " + " | ".join(f"{n} token{'s' if n > 1 else ''} (ms)" for n in ns) + " | " + \
        " | ".join(f"{n} / 1" for n in ns if n > 1) + " |"
    lines = [header, "|" + "---|" * (2 + len(ns) + len([n for n in ns if n > 1]))]
    for past in pasts:
        for graph in graphs:
            if (graph, past, ns[0]) not in medians:
                continue
            times = [medians[(graph, past, n)] for n in ns]
            ratios = [medians[(graph, past, n)] / medians[(graph, past, 1)] for n in ns if n > 1]
            lines.append(f"| {graph} | {past} | " + " | ".join(f"{t * 1e3:.1f}" for t in times) + " | "
                         + " | ".join(f"{r:.2f}x" for r in ratios) + " |")
    return "\n".join(lines)
