"""Step-time benchmark: one target call over n new tokens on a past of P tokens, per graph.

Graphs are timed in alternation (each repetition visits all of them, order flipped every
time), and each figure is a median; the call is rolled back after every measurement so all
start from the same cache. Sessions must be made with spin=False: graphs that take turns
call by call would otherwise slow each other with busy-waiting threads (providers.py).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import numpy as np

from specdec.runtime.session import ModelSession

PAST_LENGTHS = (64, 256, 1024)
NEW_TOKENS = (1, 5, 8)


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
