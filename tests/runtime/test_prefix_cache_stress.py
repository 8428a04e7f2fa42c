"""A seeded stress test of the batch engine's prefix cache: prompt families sharing prefixes of 16 to ~900 tokens,
exact duplicates, strict prefixes, a chat's second turns and unrelated prompts arrive in bursts from several
threads, staggered while others run, and one after another; a few are cancelled mid-prefill or mid-stream.
Every request that runs to its end must give its prompt's target-only greedy tokens, and its first token's
logprobs bit for bit those of the same prompt prefilled alone without the prefix cache (batch_chunks.py: a reused
prefix is computed as a fresh aligned prefill computes it). A cancelled request's tokens are a prefix of its own.

The plain Engine's prefill is one call (the long-call kernel past 64 rows), which rounds otherwise (~1e-6), so
the logprobs' reference is a BatchEngine without the prefix cache, each prompt alone; the tokens' is the Engine.
Arrival timing between threads is not seeded (the workload is): any interleaving must give the same outputs; the
light-load phase runs one request at a time on a fresh engine, so it is deterministic.

What the stress test found, and the tests after it keep fixed: a query of 32m + 1 rows computes its last row
otherwise (batch_chunks.last_row), and a reused prefix made such rows where a fresh prefill has none (and none
where it has one), or reused one; so did a ragged row of 64m + 1 fresh tokens. Logprobs ~1e-7 apart, tokens alike."""

from __future__ import annotations

import json
import shutil
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pytest

from specdec.runtime import batch_idle, batch_step
from specdec.runtime.batch import BatchEngine
from specdec.runtime.batch_chunks import (AMONG, chunk_end, chunk_pieces, granule_end, last_row, prefill_end,
                                          prefill_start, reprefill_piece)
from specdec.runtime.engine import Engine, GenerationConfig

from tests.conftest import _export

POSITIONS = 1280  # the long tiny target's positions (the shared fixtures' tiny models have 512)
SHARED = (16, 17, 40, 63, 64, 65, 127, 128, 129, 200, 300, 511, 512, 513, 700, 900)  # family prefix lengths
NEW_TOKENS = 12
LONG_TOKENS = 40  # the cancelled requests' max_new_tokens: they are still running when cancelled
MID_PREFILL = -1  # Job.cancel_after: cancel once the prompt has prefilled a chunk of its own, before its first token


@pytest.fixture(scope="module")
def long_engine(tiny_sources, tmp_path_factory):
    """The tiny llama target with 1280 positions (RoPE: no weight depends on them), exported target-only."""
    target, _ = tiny_sources["llama"]
    root = tmp_path_factory.mktemp("tiny-long")
    source = shutil.copytree(target, root / "target")
    config = json.loads((source / "config.json").read_text())
    config["max_position_embeddings"] = POSITIONS
    (source / "config.json").write_text(json.dumps(config))
    return Engine.load(_export(source, None, root / "art"), provider="cpu", threads=1)


@dataclass(eq=False)  # jobs of one prompt are distinct jobs
class Job:
    """One request of the workload and what came of it."""

    prompt: list[int]
    config: GenerationConfig
    cancel_after: int | None = None  # cancel after this many iterations (MID_PREFILL: while prefilling); None: never
    close: bool = False  # cancel by closing the stream's iterator, else by stream.cancel()
    tokens: list[int] = field(default_factory=list)  # committed, as the consumer saw them
    first_logprobs: object = None  # the first (prefill) iteration's TokenLogprobs
    finish: str | None = None
    error: BaseException | None = None


def _tokens(rng: np.random.Generator, n: int) -> list[int]:
    """Return n seeded token ids of the tiny vocabulary, no special ones."""
    return [int(t) for t in rng.integers(20, 390, n)]


def _config(rng: np.random.Generator, tokens: int = NEW_TOKENS) -> GenerationConfig:
    """Return a greedy config with logprobs, drafting by prompt lookup one time in three (ragged verify calls)."""
    drafting = dict(drafter="ngram", num_draft_tokens="auto", ngram_min=1) if rng.random() < 1 / 3 else \
        dict(drafter="none")
    return GenerationConfig(max_new_tokens=tokens, logprobs=2, **drafting)


def _first_turn(rng: np.random.Generator) -> tuple[list[list[int]], list[list[int]]]:
    """Return (prompts, cancelled prompts): families that start with one document's first L tokens (L of SHARED and
    random, so any two share min(L) tokens), families of a second document, strict prefixes, duplicates and
    unrelated prompts, shuffled; the cancelled ones share families' prefixes, and one is long and unrelated."""
    documents = [_tokens(rng, 960), _tokens(rng, 500)]
    lengths = [int(n) for n in rng.choice(SHARED, 8, replace=False)] + [int(n) for n in rng.integers(16, 950, 2)]
    prompts = [documents[0][:n] + _tokens(rng, int(rng.integers(1, 40))) for n in lengths
               for _ in range(int(rng.integers(2, 4)))]
    prompts += [documents[1][:int(n)] + _tokens(rng, int(rng.integers(1, 30))) for n in rng.integers(16, 480, 4)]
    prompts += [_tokens(rng, int(rng.integers(3, 120))) for _ in range(5)]
    for i in rng.choice(len(prompts), 4, replace=False):  # strict prefixes: at a chunk boundary, one past, anywhere
        whole = prompts[int(i)]
        prompts.append(whole[:int(rng.choice([64, 65, int(rng.integers(17, len(whole)))]))] if len(whole) > 66
                       else whole[:max(1, len(whole) - 3)])
    prompts += [list(prompts[int(i)]) for i in rng.choice(len(prompts), 4, replace=False)]  # exact duplicates
    order = rng.permutation(len(prompts))
    cancelled = [documents[0][:int(n)] + _tokens(rng, 5) for n in rng.choice(SHARED, 3, replace=False)]
    return [prompts[int(i)] for i in order], cancelled + [_tokens(rng, 700)]


def _reply(answer: list[int], engine: Engine) -> list[int]:
    """Return a greedy answer as a chat's history keeps it: without its EOS."""
    return [t for t in answer if t not in engine.eos_token_ids]


def _second_turn(rng: np.random.Generator, engine: Engine, prompts: list[list[int]], answers: list[list[int]],
                 long_cancelled: list[int]) -> list[list[int]]:
    """Return later prompts: second turns (a first prompt + its greedy answer + a new message), repeats of first
    prompts, and prompts starting with the long prompt cancelled mid-prefill (its slot keeps what it prefilled)."""
    picks = rng.choice(len(prompts), 8, replace=False)
    turns = [prompts[int(i)] + _reply(answers[int(i)], engine) + _tokens(rng, int(rng.integers(1, 20)))
             for i in picks[:6]]
    repeats = [list(prompts[int(i)]) for i in picks[6:]]
    return turns + repeats + [long_cancelled[:int(n)] + _tokens(rng, 4) for n in (100, 300)]


def _consume(batch: BatchEngine, job: Job, stream_ready: threading.Event | None = None, streams=None) -> None:
    """Submit `job`, read its stream to the end (or cancel it as the job says); fill in what came of it."""
    def seen(iteration):
        if job.first_logprobs is None:
            assert iteration.prefill
            job.first_logprobs = iteration.logprobs
        job.tokens.extend(iteration.committed)
        if job.cancel_after is not None and not job.close and len(job.tokens) >= job.cancel_after >= 1:
            stream.cancel()

    try:
        try:
            stream = batch.stream(job.prompt, job.config, on_iteration=seen)
            if streams is not None:
                streams[tuple(job.prompt)] = stream
        finally:
            if stream_ready is not None:
                stream_ready.set()
        if job.cancel_after == 0:
            stream.cancel()  # while it waits for a slot, or just admitted
        pieces = iter(stream)
        for _ in pieces:
            if job.close and len(job.tokens) >= job.cancel_after:
                pieces.close()  # a client that hangs up: the generator's exit cancels the request
                break
        job.finish = stream.result.finish_reason if stream.result is not None else "closed"
    except BaseException as err:  # raised again by the test, on its own thread
        job.error = err


def _cancelling_mid_prefill(batch: BatchEngine, streams: dict, jobs: list[Job]) -> list[int]:
    """Make the scheduler cancel each MID_PREFILL job once its prompt has prefilled a chunk of its own past what it
    reused, and not all of it; return a list that gets the positions each held then."""
    targets = {tuple(j.prompt) for j in jobs if j.cancel_after == MID_PREFILL}
    first_seen: dict[tuple[int, ...], int] = {}
    held, plan = [], batch._plan_chunks

    def planned():
        chunks = plan()
        for request in batch._prefilling:
            key = tuple(request.prompt_ids)
            if key not in targets or key not in streams:
                continue
            length = request.cache.length
            first_seen.setdefault(key, length)
            if first_seen[key] < length < len(key):
                held.append(length)
                targets.discard(key)
                streams[key].cancel()
        return chunks

    batch._plan_chunks = planned
    return held


def _run_wave(batch: BatchEngine, rng: np.random.Generator, jobs: list[Job], streams: dict) -> None:
    """Run `jobs`: about half submitted at once from a thread each, the rest one by one (a few ms apart) while those
    run; return when every job has ended."""
    burst = [j for j in jobs if rng.random() < 0.5]
    staggered = [j for j in jobs if j not in burst]
    pauses = rng.uniform(0, 0.004, len(staggered))
    gate = threading.Barrier(len(burst) + 1)

    def at_once(job):
        gate.wait()
        _consume(batch, job, streams=streams)

    threads = [threading.Thread(target=at_once, args=(j,)) for j in burst]
    for thread in threads:
        thread.start()
    gate.wait()
    for job, pause in zip(staggered, pauses):
        time.sleep(pause)
        ready = threading.Event()
        threads.append(threading.Thread(target=_consume, args=(batch, job, ready, streams)))
        threads[-1].start()
        ready.wait(timeout=30)  # submitted in this order
    for thread in threads:
        thread.join(timeout=120)
        assert not thread.is_alive(), "a stream never ended"


def _alone(engine: Engine, prompts: list[list[int]]) -> list:
    """Return each prompt's first-token TokenLogprobs from a prefill of it alone in a BatchEngine without the prefix
    cache (aligned chunks in the plain graph's calls)."""
    alone = BatchEngine(engine, max_batch=2, kv_capacity=POSITIONS, prefix_cache=False)
    try:
        return [_first_logprobs(alone, p) for p in prompts]
    finally:
        alone.shutdown()


def _first_logprobs(batch: BatchEngine, prompt: list[int]):
    """Return the TokenLogprobs of the first token of `prompt` run in `batch` (greedy, no drafts)."""
    iterations = []
    for _ in batch.stream(prompt, GenerationConfig(max_new_tokens=1, drafter="none", logprobs=2),
                          on_iteration=iterations.append):
        pass
    return iterations[0].logprobs


def _references(engine: Engine, prompts: list[list[int]], tokens: list[int]) -> tuple[list, list]:
    """Return (each prompt's target-only greedy tokens from the Engine, its first token's logprobs alone: `_alone`)."""
    answers = [engine.generate(p, GenerationConfig(max_new_tokens=n, drafter="none")).token_ids
               for p, n in zip(prompts, tokens)]
    return answers, _alone(engine, prompts)


def _check(jobs: list[Job], answers: list, first: list, label: str) -> None:
    """Assert each job's outcome against its prompt's references."""
    for i, (job, answer, logprobs) in enumerate(zip(jobs, answers, first)):
        what = f"{label} job {i} ({len(job.prompt)} prompt tokens, cancel_after={job.cancel_after})"
        if job.error is not None:
            raise AssertionError(f"{what} raised") from job.error
        if job.cancel_after is None:
            assert job.finish in ("length", "eos"), (what, job.finish)
            assert job.tokens == answer, f"{what}: {job.tokens} != target-only {answer}"
        else:
            assert job.tokens == answer[:len(job.tokens)], f"{what}: {job.tokens} not a prefix of {answer}"
        if job.first_logprobs is not None:
            got = job.first_logprobs
            assert got.top_ids[0].tolist() == logprobs.top_ids[0].tolist(), what
            assert np.array_equal(got.top_values[0], logprobs.top_values[0]), \
                (what, float(np.abs(got.top_values[0] - logprobs.top_values[0]).max()))


def _light_load_cycle(engine: Engine, rng: np.random.Generator, max_batch: int, budget: int) -> BatchEngine:
    """Run, one at a time on a fresh engine, `max_batch` distinct prompts, then each one's second turn (the first
    prompt's first, the others in a seeded order); assert each against its references; return the engine (shut down).

    Past the ragged graph's rows this is the load of 85331d4: new requests take the slots below the window, the
    prompts given back first were stashed above it, and the first second turn copies its prefix from the slot given
    back longest ago, the one a stash picks as its spare (it overwrote it first, before the fix).
    """
    prompts = [_tokens(rng, int(rng.integers(30, 200))) for _ in range(max_batch)]
    jobs = [Job(p, _config(rng)) for p in prompts]
    answers, first = _references(engine, prompts, [NEW_TOKENS] * len(prompts))
    turns = [p + _reply(a, engine) + _tokens(rng, 5) for p, a in zip(prompts, answers)]
    order = [0] + [int(i) + 1 for i in rng.permutation(len(turns) - 1)]
    later = [Job(turns[i], _config(rng)) for i in order]
    later_answers, later_first = _references(engine, [j.prompt for j in later], [NEW_TOKENS] * len(later))
    batch = BatchEngine(engine, max_batch=max_batch, kv_capacity=POSITIONS, prefill_budget=budget)
    try:
        for job in jobs + later:
            _consume(batch, job)
        _check(jobs, answers, first, "light load")
        _check(later, later_answers, later_first, "light load, second turns")
    finally:
        batch.shutdown()
    return batch


@pytest.mark.parametrize("seed, max_batch, budget, itl, reprefill", [
    (0, 3, 64, None, True), (1, 8, 256, None, False), (2, 12, 64, None, False), (3, 12, 256, None, True),
    (4, 8, 256, 2.0, False)])
def test_a_random_workload_over_the_prefix_cache_gives_each_prompts_target_only_output(long_engine, seed, max_batch,
                                                                                       budget, itl, reprefill,
                                                                                       monkeypatch):
    """Max_batch 3 (no ragged-rows graph: plain calls), 8 (the graph's rows) and 12 (slots past its rows: a window,
    stashes above it); budgets of one chunk and of four, and one bounded by the running requests' ITL (steps priced
    20 + n, so ~20-30 prompt tokens a step in 16-token granules). Bursts and staggered arrivals, then later turns,
    then a light load on a fresh engine (`_light_load_cycle`). With `reprefill`, kept replies are re-prefilled
    whenever the engine is idle even for a moment (batch_idle.py), between and under every arrival pattern."""
    monkeypatch.setattr(batch_idle, "IDLE_BEFORE_REPREFILL", 0.0)
    rng = np.random.default_rng(seed)
    prompts, cancelled = _first_turn(rng)
    first_jobs = [Job(p, _config(rng)) for p in prompts]
    # cancelled after 1 and 3 iterations (by cancel() or a closed iterator), at once, and mid-prefill
    first_jobs += [Job(p, _config(rng, LONG_TOKENS), cancel_after=after, close=close)
                   for p, after, close in zip(cancelled, (1, 3, 0, MID_PREFILL), (False, True, False, False))]
    answers, first = _references(long_engine, [j.prompt for j in first_jobs],
                                 [j.config.max_new_tokens for j in first_jobs])
    later = _second_turn(rng, long_engine, prompts, answers, cancelled[-1])
    later_jobs = [Job(p, _config(rng)) for p in later]
    later_answers, later_first = _references(long_engine, later, [NEW_TOKENS] * len(later))

    batch = BatchEngine(long_engine, max_batch=max_batch, kv_capacity=POSITIONS, prefill_budget=budget,
                        prefill_itl_factor=itl, reprefill_when_idle=reprefill)
    if itl is not None:
        batch.calls.ragged_costs.seconds = lambda n: 20 + n
        batch.calls._observe_idle_step = lambda seconds: None  # the table is the base too
    streams: dict = {}
    held = _cancelling_mid_prefill(batch, streams, first_jobs)
    try:
        _run_wave(batch, rng, first_jobs, streams)
        _check(first_jobs, answers, first, "first wave")
        _run_wave(batch, rng, later_jobs[:len(later_jobs) // 2], streams)
        for job in later_jobs[len(later_jobs) // 2:]:  # a light load: one at a time, the others' slots free
            _consume(batch, job)
        _check(later_jobs, later_answers, later_first, "later")
        assert batch.alive
    finally:
        batch.shutdown()
    assert len(held) == 1  # the long prompt was cancelled with part of it prefilled
    # not vacuous: much of what was asked came from the cache, copied from other slots too
    assert batch.prefix_tokens_reused > 0.3 * batch.prefix_tokens_queried, \
        (batch.prefix_tokens_reused, batch.prefix_tokens_queried)
    assert batch.arena.prefix_copies > 0
    assert (batch.reprefilled_tokens > 0) == reprefill
    cycle = _light_load_cycle(long_engine, rng, max_batch, budget)
    assert cycle.prefix_tokens_reused > 0.5 * cycle.prefix_tokens_queried / 2  # the second turns: most of each
    if max_batch > long_engine.target.spec.ragged_rows:
        assert cycle.arena.prefix_stashes > 0 and cycle.arena.prefix_copies > 0

def _last_rows(queries: list[tuple[int, int]], tokens: int) -> list[int]:
    """Return, per position, how the query that computed it computes it (batch_chunks.last_row of the query's rows
    for its last position, AMONG for the others)."""
    kinds = [AMONG] * tokens
    for start, end in queries:
        kinds[end - 1] = last_row(end - start)
    return kinds


def test_every_query_of_a_prefill_from_a_reused_prefix_computes_each_position_as_a_fresh_prefill_does():
    """For prompts of 1 to 300 tokens, any reusable prefix and budget: a ragged row (prefill_end's cuts) or a plain
    call (its aligned pieces) ends where a query's last row rounds otherwise (a lone row, or the tail of 32m + 1
    rows) only where a fresh prefill's own calls make the same kind of row. Found by the stress test above: a query
    of 33 rows computes its last row otherwise, and reuse made one where a fresh prefill had none (or none where it
    had one); so did a ragged row of 65 tokens where the plain calls feed the 65th alone."""
    assert [prefill_start(r, n) for r, n in ((16, 33), (95, 200), (80, 97), (35, 68), (64, 97), (96, 200))] == \
        [0, 94, 64, 35, 64, 96]
    assert prefill_end(0, 65, 256) == 64 and prefill_end(64, 65, 256) == 65 and prefill_end(0, 97, 256) == 97
    assert prefill_end(35, 68, 256) == 64  # not one row of 33 to the end: the fresh last chunk has 4
    assert prefill_end(0, 65, 256, lone_rows_differ=False) == 65
    for tokens in range(1, 301):
        fresh = _last_rows(chunk_pieces(0, tokens), tokens)
        for reusable in range(tokens + 1):
            start = prefill_start(reusable, tokens)
            for budget in (1, 64, 100, 256, 1000):
                rows, at = [], start
                while at < tokens:
                    end = prefill_end(at, tokens, budget)
                    rows.append((at, end if end > at else chunk_end(at, tokens)))
                    at = rows[-1][1]
                pieces = [piece for row in rows for piece in chunk_pieces(*row)]
                for queries in (rows, pieces):
                    assert _last_rows(queries, tokens)[start:] == fresh[start:], (tokens, reusable, budget, queries)


def test_every_granule_cut_of_an_itl_bound_step_computes_each_position_as_a_fresh_prefill_does():
    """The same for granule_end's cuts (a step bounded by its running requests' ITL cuts chunks at multiples of 16),
    from any start a reuse leaves, at budgets under and over a chunk; each step feeds something."""
    for tokens in range(1, 301):
        fresh = _last_rows(chunk_pieces(0, tokens), tokens)
        for reusable in range(tokens + 1):
            start = prefill_start(reusable, tokens)
            for budget in (1, 8, 16, 22, 40, 64, 300):
                rows, at = [], start
                while at < tokens:
                    end = granule_end(at, tokens, budget)
                    assert end > at
                    rows.append((at, end))
                    at = end
                pieces = [piece for row in rows for piece in chunk_pieces(*row)]
                for queries in (rows, pieces):
                    assert _last_rows(queries, tokens)[start:] == fresh[start:], (tokens, reusable, budget, queries)


def _running_beside(batch: BatchEngine, rng: np.random.Generator):
    """Return a stream that decodes while the test runs (its first token read): prompt chunks ride its ragged step."""
    stream = batch.stream(_tokens(rng, 9), GenerationConfig(max_new_tokens=300, drafter="none"))
    next(iter(stream))
    return stream


@pytest.mark.parametrize("source, shared, tokens, reused", [
    (21, 16, 33, 0),  # a fresh prefill's one chunk of 33 rows: reusing 16 would feed 17
    (120, 95, 200, 94),  # the query [95, 128) would be 33 rows
    (97, 97, 200, 96),  # the strict prefix computed position 96 as a 33-row chunk's tail: not reused
    (90, 80, 97, 64),  # the fresh last chunk [64, 97) has 33 rows: so has the reused prefill's
    (40, 35, 68, 35)])  # a ragged row [35, 68) would be 33 rows where the fresh [64, 68) has 4
def test_a_prompt_reusing_a_prefix_up_to_a_query_of_32m_plus_1_rows_gets_the_fresh_logprobs(long_engine, source,
                                                                                            shared, tokens, reused):
    """A prompt reuses the prefix `source` (its first `shared` tokens) left in a slot, in the plain graph's calls
    (nothing runs) and riding a decoding request's ragged step (budgets 256 and 64); its first token's logprobs are
    those of its prefill alone without the prefix cache, bit for bit. Before the fix each case differed (~1e-7)."""
    rng = np.random.default_rng(tokens)
    prompt = _tokens(rng, tokens)
    before = prompt[:shared] + _tokens(rng, source - shared)
    expected = _alone(long_engine, [prompt])[0]
    for max_batch, budget, beside in ((3, 256, False), (8, 256, True), (8, 64, True)):
        batch = BatchEngine(long_engine, max_batch=max_batch, kv_capacity=POSITIONS, prefill_budget=budget)
        try:
            for _ in range(max_batch):  # every slot keeps a prompt: the prompt reuses its prefix's, never an empty one
                batch.generate(_tokens(rng, 20), GenerationConfig(max_new_tokens=1, drafter="none"))
            running = _running_beside(batch, rng) if beside else None
            batch.generate(before, GenerationConfig(max_new_tokens=1, drafter="none"))
            start = batch.prefix_tokens_reused
            got = _first_logprobs(batch, prompt)
            assert batch.prefix_tokens_reused - start == reused, (max_batch, budget)
            if running is not None:
                running.cancel()
        finally:
            batch.shutdown()
        assert np.array_equal(got.top_values, expected.top_values), (max_batch, budget)


@pytest.mark.parametrize("tokens", [65, 129, 97])
def test_a_fresh_prompt_in_a_ragged_row_gets_the_logprobs_of_its_plain_calls(long_engine, tokens):
    """Without the prefix cache, a prompt of 64m + 1 tokens prefilled in ragged rows (a burst's shared call, or riding
    a decoding request's step) gets the first-token logprobs of its plain calls, which feed its last token alone:
    its row stops before it (one query of 65 rows computed it as a block's tail: ~1e-6 apart)."""
    rng = np.random.default_rng(tokens)
    prompt = _tokens(rng, tokens)
    expected = _alone(long_engine, [prompt])[0]
    for beside in (False, True):
        batch = BatchEngine(long_engine, max_batch=8, kv_capacity=POSITIONS, prefix_cache=False, prefill_budget=256)
        try:
            running = _running_beside(batch, rng) if beside else None
            iterations = []
            with batch._wake:  # one admission takes both: a ragged call of their own, or riding the step
                streams = [batch.stream(prompt, GenerationConfig(max_new_tokens=1, drafter="none", logprobs=2),
                                        on_iteration=iterations.append),
                           batch.stream(_tokens(rng, 40), GenerationConfig(max_new_tokens=1, drafter="none"))]
            for stream in streams:
                for _ in stream:
                    pass
            if running is not None:
                running.cancel()
            assert batch.ragged_prefills + batch.ragged_calls > 0  # not vacuous: ragged rows prefilled it
        finally:
            batch.shutdown()
        assert np.array_equal(iterations[0].logprobs.top_values, expected.top_values), beside


def _reprefilled(batch: BatchEngine, seconds: float = 30.0) -> None:
    """Wait until the idle engine has no kept reply left to re-prefill (batch_idle.py)."""
    deadline = time.monotonic() + seconds
    while batch.arena.reply_to_reprefill() is not None:
        assert time.monotonic() < deadline, "the idle engine left a kept reply unreusable"
        time.sleep(0.01)


def test_reprefill_pieces_cover_what_is_not_exact_in_queries_whose_every_row_is_among_others():
    """From any exact frontier of any kept sequence, the pieces cover every position past it (taking one exact
    position again at most), each a query of 2 to 16 rows: none ends in a lone row or a 32m + 1 rows' tail."""
    assert [reprefill_piece(e, k) for e, k in ((40, 100), (96, 100), (99, 100), (100, 100), (0, 1), (0, 2))] == \
        [(40, 56), (96, 100), (98, 100), None, None, (0, 2)]
    for kept in range(2, 70):
        for exact in range(kept + 1):
            computed, frontier = set(), exact
            while (piece := reprefill_piece(frontier, kept)) is not None:
                start, end = piece
                assert 2 <= end - start <= 16 and last_row(end - start) == AMONG and start >= frontier - 1
                computed.update(range(start, end))
                frontier = end
            assert frontier == kept and computed >= set(range(exact, kept)), (exact, kept)


@pytest.mark.parametrize("max_batch", [3, 8])
def test_an_idle_engine_reprefills_a_reply_of_1_token_steps_so_the_next_turn_reuses_it(long_engine, max_batch):
    """A target-only reply (1-token steps, not reusable as decoded) is computed again while the engine is idle;
    the chat's next turn then reuses it, and gets the first-token logprobs of its prefill alone, bit for bit (a lone
    row rounds otherwise on SmolLM2, not on the tiny model: tests/runtime/test_smollm2.py). Without
    reprefill_when_idle only the prompt is reused."""
    rng = np.random.default_rng(11)
    config = GenerationConfig(max_new_tokens=24, drafter="none")
    prompt = next(p for p in (_tokens(rng, 45) for _ in range(20))
                  if long_engine.generate(p, config).finish_reason == "length")
    for reprefill in (True, False):
        batch = BatchEngine(long_engine, max_batch=max_batch, kv_capacity=POSITIONS, reprefill_when_idle=reprefill)
        try:
            reply = _reply(batch.generate(prompt, config).token_ids, long_engine)
            if reprefill:
                _reprefilled(batch)
            else:
                time.sleep(2 * batch_idle.IDLE_BEFORE_REPREFILL)
            frontier = _exact_frontier(batch, prompt)
            turn = prompt + reply + _tokens(rng, 5)
            start = batch.prefix_tokens_reused
            got = _first_logprobs(batch, turn)
            reused = batch.prefix_tokens_reused - start
            reprefilled = batch.reprefilled_tokens
        finally:
            batch.shutdown()
        kept = len(prompt) + len(reply) - 1  # the last reply token was never fed
        if reprefill:
            assert frontier == kept and reused >= kept - 1 and reprefilled >= len(reply) - 1, (frontier, reused)
        else:
            assert frontier <= len(prompt) and reused <= len(prompt) and reprefilled == 0, (frontier, reused)
        expected = _alone(long_engine, [turn])[0]
        assert np.array_equal(got.top_values, expected.top_values), reprefill


def test_the_prefix_cache_reuses_a_prompt_only_for_requests_of_the_same_cache_salt(long_engine):
    """cache_salt namespaces the prefix cache (vLLM's field): a prompt a request of salt "a" left in a slot, or is
    still running, is reused by "a" and by nobody else (another salt, or none); the output never changes."""
    rng = np.random.default_rng(5)
    prompt = _tokens(rng, 80)
    batch = BatchEngine(long_engine, max_batch=4, kv_capacity=POSITIONS)
    try:
        def run(salt, tokens=prompt):
            start = batch.prefix_tokens_reused
            result = batch.generate(tokens, GenerationConfig(max_new_tokens=4, drafter="none", cache_salt=salt))
            return batch.prefix_tokens_reused - start, result.token_ids

        first, expected = run("a")
        others = [run(salt) for salt in ("b", None, "b")]
        again = run("a")
        running = batch.stream(prompt + _tokens(rng, 3), GenerationConfig(max_new_tokens=200, drafter="none",
                                                                        cache_salt="c"))
        next(iter(running))  # "c" holds its prompt while it runs: a copy source for "c" only
        beside = [run(salt, prompt + _tokens(rng, 2)) for salt in ("d", "c")]
        running.cancel()
    finally:
        batch.shutdown()
    assert first == 0 and [r for r, _ in others] == [0, 0, 78] and again[0] >= 78, (first, others, again)
    assert all(tokens == expected for _, tokens in [*others, again])
    assert beside[0][0] == 0 and beside[1][0] >= 78, beside


def _exact_frontier(batch: BatchEngine, prompt: list[int]) -> int:
    """Return how many leading positions the slot that ran `prompt` keeps for reuse (SlotCache.exact)."""
    caches = [c for c in batch.arena._caches if tuple(c.kept_ids[:len(prompt)]) == tuple(prompt)]
    assert len(caches) == 1
    return caches[0].exact


@pytest.mark.parametrize("max_batch, beside", [(3, False), (8, True)])
def test_a_second_turn_reuses_a_reply_decoded_with_drafts_and_gets_the_fresh_logprobs(long_engine, max_batch, beside,
                                                                                       monkeypatch):
    """A reply whose every step verified drafts (2+ query rows: computed as a prefill computes them) is reused on the
    chat's next turn, in batch-1 verify calls (max_batch 3) and in ragged rows beside a running request; so is one
    whose steps without drafts verified a guess instead (reply_reuse_share: guess_rows.py). The second turn's
    first-token logprobs are those of its prefill alone without the prefix cache, bit for bit. A reply of 1-token
    steps is not reused (a lone query row rounds otherwise; not on the tiny model, whose rows are too short to
    show it, but on SmolLM2: tests/runtime/test_smollm2.py)."""
    rng = np.random.default_rng(7)
    # Every token but EOS once: prompt lookup finds the last token at every step (K fixed: every step drafts); an
    # order the target decodes to the end.
    vocab = [t for t in range(long_engine.target.spec.vocab_size) if t not in long_engine.eos_token_ids]
    prompt = next(p for p in ([int(t) for t in rng.permutation(vocab)] for _ in range(20)) if long_engine.generate(
        p, GenerationConfig(max_new_tokens=24, drafter="none")).finish_reason == "length")
    drafting = GenerationConfig(max_new_tokens=24, drafter="ngram", num_draft_tokens=3, ngram_min=1)
    auto = GenerationConfig(max_new_tokens=24, drafter="ngram")  # K 0 where drafts do not pay: guesses there
    target_only = GenerationConfig(max_new_tokens=24, drafter="none")  # never guesses: it asked for no drafts
    # Every lone row gets its guess: on the tiny model a step takes well under a millisecond, so the measured-cost
    # gate (guesses_within, tested on its own) would let timing noise decide (it refused one in a full-suite run).
    monkeypatch.setattr(batch_step, "guesses_within", lambda lone, step_seconds, share: lone)
    for config, share, reaches_reply in ((drafting, 0.0, True), (auto, 1.0, True), (target_only, 1.0, False)):
        batch = BatchEngine(long_engine, max_batch=max_batch, kv_capacity=POSITIONS, reply_reuse_share=share)
        try:
            running = _running_beside(batch, rng) if beside else None
            answer = batch.generate(prompt, config)
            reply = _reply(answer.token_ids, long_engine)
            assert answer.finish_reason == "length" and len(reply) == 24
            frontier = _exact_frontier(batch, prompt)
            turn = prompt + reply + _tokens(rng, 5)
            start = batch.prefix_tokens_reused
            got = _first_logprobs(batch, turn)
            reused = batch.prefix_tokens_reused - start
            if running is not None:
                running.cancel()
        finally:
            batch.shutdown()
        if reaches_reply:  # all but the last reply token (it was never fed) and at most one row's tail
            assert frontier >= len(prompt) + len(reply) - 2 and reused >= len(prompt) + len(reply) - 3, \
                (frontier, reused)
        else:
            assert frontier <= len(prompt) and reused <= len(prompt), (frontier, reused)
        expected = _alone(long_engine, [turn])[0]
        assert got.top_ids[0].tolist() == expected.top_ids[0].tolist()
        assert np.array_equal(got.top_values, expected.top_values), (config.drafter, share, max_batch)
