"""Reliability figures on one engine: many threads give what one thread gives; a long soak keeps memory flat."""

from __future__ import annotations

import os
import threading
from collections import Counter

import numpy as np
import pytest

from specdec.runtime.engine import Engine, GenerationConfig

PROMPTS = ["The quick brown fox", "one, two, three, one, two, three, one,", "def add(a, b):\n    return",
           "Hello world! Hello world!", "Once upon a time"]


@pytest.fixture(scope="module")
def engine(tiny_close_artifacts):
    # the draft is the target plus weight noise: drafts get accepted, rejected and crowned with bonus tokens
    return Engine.load(tiny_close_artifacts["llama"], provider="cpu", threads=1)


def _requests(count: int, max_new_tokens: int = 16) -> list[tuple[str, GenerationConfig]]:
    """Return `count` (prompt, config): greedy and sampled, model and n-gram drafters, K 1..4, own seeds."""
    requests = []
    for i in range(count):
        sampled = i % 2 == 1
        requests.append((PROMPTS[i % len(PROMPTS)], GenerationConfig(
            max_new_tokens=max_new_tokens, seed=i, drafter=("model", "ngram")[(i // 2) % 2],
            num_draft_tokens=1 + (i // 4) % 4, ngram_min=1, temperature=(0.0, 0.9, 0.0, 1.3)[i % 4],
            top_k=(0, 0, 0, 20)[i % 4], top_p=(1.0, 0.95, 1.0, 1.0)[i % 4] if sampled else 1.0)))
    return requests


def _outcome(result) -> tuple:
    s = result.stats
    return tuple(result.token_ids), result.finish_reason, s.drafted, s.accepted, s.acceptance_tests, s.bonus_tokens


def test_eight_threads_by_fifty_generations_equal_the_same_four_hundred_one_at_a_time(engine):
    """8 threads x 50 generations on one engine (mixed greedy/sampled, model and n-gram drafters, K 1..4):
    token for token, and count for count, what the same 400 requests give one at a time."""
    requests = _requests(400)
    sequential = [_outcome(engine.generate(prompt, config)) for prompt, config in requests]
    parallel: list[tuple | None] = [None] * len(requests)
    errors = []
    start = threading.Barrier(8)

    def worker(t: int) -> None:
        try:
            start.wait()  # all eight begin together, so their generations interleave
            for i in range(t, len(requests), 8):
                parallel[i] = _outcome(engine.generate(*requests[i]))
        except BaseException as err:  # noqa: BLE001  (reported below, with the request)
            errors.append((t, repr(err)))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    differing = [i for i in range(len(requests)) if parallel[i] != sequential[i]]
    assert differing == [], f"{len(differing)} of 400 differ, first {requests[differing[0]]}"
    mix = Counter()
    for (prompt, config), (_, _, drafted, accepted, tests, bonus) in zip(requests, sequential):
        mix.update({config.drafter: 1, "sampled" if config.temperature else "greedy": 1, "accepted": accepted,
                    "rejections": tests - accepted, "bonus": bonus})
    assert mix["model"] == mix["ngram"] == 200 and mix["sampled"] == mix["greedy"] == 200
    assert mix["accepted"] > 400 and mix["rejections"] > 100 and mix["bonus"] > 50, mix


def _rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads resident memory from /proc")
def test_soak_of_a_thousand_generations_keeps_resident_memory_flat(engine, capsys):
    """1,000 generations (after 100 to warm up) on one engine: the least-squares slope of resident memory
    over the run is printed, and must stay under 2 MB per 1,000 generations.

    Leaking one request's tiny KV caches (both models, ~60 positions) would cost ~20 MB per 1,000.
    """
    requests = _requests(1100, max_new_tokens=8)
    for prompt, config in requests[:100]:
        engine.generate(prompt, config)
    samples = []  # (generations done, RSS MB)
    for n, (prompt, config) in enumerate(requests[100:], start=1):
        engine.generate(prompt, config)
        if n % 50 == 0:
            samples.append((n, _rss_mb()))
    done, rss = np.array(samples).T
    slope = np.polyfit(done, rss, 1)[0] * 1000  # MB per 1,000 generations
    with capsys.disabled():
        print(f"\nsoak: 1000 generations, RSS {rss[0]:.1f} -> {rss[-1]:.1f} MB, slope {slope:+.2f} MB per 1,000")
    assert slope < 2.0, (slope, samples)
