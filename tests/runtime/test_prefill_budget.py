"""Prefill under a per-step token budget, and exact prefix reuse: prompts are prefilled in chunks aligned to
absolute positions, oldest first, riding the running requests' step; a prompt that starts as a slot's context did
skips only positions a fresh prefill computes bit for bit alike, so its logits and text are those without reuse."""

import time

import numpy as np
import pytest
from click.testing import CliRunner

from specdec.models.errors import GenerationError, SpecdecError
from specdec.runtime import batch_admission, loop
from specdec.runtime.batch import DEFAULT_PREFILL_BUDGET, BatchEngine
from specdec.runtime.batch_chunks import PREFILL_CHUNK, chunk_end, chunk_pieces, prefill_end, prefill_start
from specdec.runtime.engine import Engine, GenerationConfig
from specdec.runtime.prefill_budget import PrefillBudget, itl_bounded_tokens

from tests.runtime.test_batch import PROMPT_SET, _burst, _consumed

PLAIN = GenerationConfig(max_new_tokens=8, drafter="none")


@pytest.fixture(scope="module")
def engine(tiny_close_artifacts):
    return Engine.load(tiny_close_artifacts["llama"], provider="cpu", threads=1)


@pytest.fixture(scope="module")
def exact_steps_engine(export_tiny_llama):
    """A target whose attention never runs on one query row (--exact-steps): its 1-token steps compute a position
    as a prefill does."""
    return Engine.load(export_tiny_llama("exact-steps", exact_steps=True), provider="cpu", threads=1)


def _ids(seed: int, n: int) -> list[int]:
    """Return n token ids of the tiny vocabulary (no special ones), seeded."""
    return [int(t) for t in np.random.default_rng(seed).integers(20, 390, n)]


def _decoding_to_the_end(engine, prompts: list[list[int]], count: int, tokens: int) -> list[list[int]]:
    """Return the first `count` prompts whose target-only output runs `tokens` tokens (no EOS before)."""
    config = GenerationConfig(max_new_tokens=tokens, drafter="none")
    return [p for p in prompts if engine.generate(p, config).finish_reason == "length"][:count]


def _rounds(batch) -> list[list[tuple[int, int, int]]]:
    """Return a list that gets, every scheduler round, the chunks planned: (request's prompt length, first
    position, tokens) each, oldest first."""
    rounds, plan = [], batch._plan_chunks

    def recorded():
        planned = plan()
        rounds.append([(len(r.prompt_ids), r.cache.length, len(r.chunk)) for r in planned])
        return planned

    batch._plan_chunks = recorded
    return rounds


def _steps(batch) -> list[tuple[list[int], int]]:
    """Return a list that gets, every step, (the prompt lengths of the requests it advances, prompt tokens riding)."""
    steps, step = [], batch._step

    def recorded(riding=()):
        steps.append(([len(r.prompt_ids) for r in batch._running], sum(len(r.chunk) for r in riding)))
        return step(riding)

    batch._step = recorded
    return steps


def _first_tokens(batch) -> list[int]:
    """Return a list that gets the prompt length of every request as it starts (its first token), in order."""
    started, join = [], batch._join_running
    batch._join_running = lambda request, first: (started.append(len(request.prompt_ids)), join(request, first))[1]
    return started


def _first_logits(monkeypatch) -> dict[tuple[int, ...], list[np.ndarray]]:
    """Return a dict that gets, per prompt, the logits row every first token was sampled from."""
    seen: dict[tuple[int, ...], list[np.ndarray]] = {}

    def recording(original):
        def first_token(state, logits, states, seconds):
            seen.setdefault(tuple(state.request.prompt_ids), []).append(np.array(logits, copy=True))
            return original(state, logits, states, seconds)
        return first_token

    monkeypatch.setattr(batch_admission, "first_token", recording(batch_admission.first_token))
    monkeypatch.setattr(loop, "first_token", recording(loop.first_token))  # the single loop's prefill
    return seen


def test_chunk_boundaries_are_multiples_of_the_chunk_and_a_reuse_never_makes_a_lone_first_row():
    assert PREFILL_CHUNK == 64
    assert [chunk_end(s, 100) for s in (0, 38, 63, 64)] == [64, 64, 64, 100]
    assert [prefill_end(0, 400, b) for b in (1, 63, 64, 100, 256, 400)] == [0, 0, 64, 64, 256, 400]
    assert prefill_end(38, 400, 20) == 38 and prefill_end(38, 400, 26) == 64 and prefill_end(256, 400, 256) == 400
    assert chunk_pieces(38, 200) == [(38, 64), (64, 128), (128, 192), (192, 200)] and chunk_pieces(5, 5) == []
    # the last token rides with the one before it, unless a fresh prefill computes it alone too (65 = 64 + 1)
    assert [prefill_start(r, n) for r, n in ((39, 40), (63, 100), (64, 65), (62, 100), (500, 40), (0, 9))] == \
        [38, 62, 64, 62, 38, 0]
    assert prefill_start(39, 40, lone_rows_differ=False) == 39  # int4 / --exact-steps: no lone row rounds apart


@pytest.mark.parametrize("budget, chunks", [(64, [(0, 64), (64, 64), (128, 64), (192, 64), (256, 44)]),
                                            (512, [(0, 300)])])
def test_a_long_prompt_rides_the_running_requests_steps_in_aligned_chunks(engine, budget, chunks):
    """A 300-token prompt arriving while 3 requests decode is prefilled 64 tokens a step under a budget of 64: the
    running requests get a token in each of those 5 steps (ITL: one step, never a stalled prefill). Under a budget
    of 512 it takes one step. Every text is its prompt's target-only one."""
    long_prompt = _ids(1, 300)
    running = [GenerationConfig(max_new_tokens=40, drafter="none")] * 3
    reference = [engine.generate(p, c).token_ids for p, c in zip(PROMPT_SET[:3] + [long_prompt], running + [PLAIN])]
    batch = BatchEngine(engine, max_batch=8, kv_capacity=512, prefill_budget=budget)
    try:
        streams = [batch.stream(p, c) for p, c in zip(PROMPT_SET[:3], running)]
        for stream in streams:
            next(iter(stream))  # all three decode
        rounds, steps = _rounds(batch), _steps(batch)
        results = _consumed(streams + [batch.stream(long_prompt, PLAIN)])
    finally:
        batch.shutdown()
    assert [r.token_ids for r in results] == reference
    assert [chunk for planned in rounds for chunk in planned] == [(300,) + c for c in chunks]
    during = [advanced for advanced, riding in steps if riding]  # the steps the long prompt rode
    assert [riding for _, riding in steps if riding] == [n for _, n in chunks]
    assert len(during) == len(chunks) and all(len(advanced) == 3 for advanced in during)


@pytest.mark.parametrize("load", [0, 2])
def test_a_burst_gets_its_first_tokens_first_come_first_served_a_budget_at_a_time(engine, load):
    """8 (or 6 beside 2 decoding) prompts of 40 tokens arrive at once; a budget of 100 takes two a step, the oldest
    first: first tokens come in arrival order, two a step, and the decoding requests get a token every step."""
    burst = [_ids(10 + i, 40 + i) for i in range(8 - load)]  # lengths tell them apart
    decoding = _decoding_to_the_end(engine, [_ids(50 + i, 11 + 2 * i) for i in range(9)], load, tokens=40)
    assert len(decoding) == load
    reference = [engine.generate(p, PLAIN).token_ids for p in burst]
    batch = BatchEngine(engine, max_batch=8, kv_capacity=256, prefill_budget=100)
    try:
        streams = [batch.stream(p, GenerationConfig(max_new_tokens=40, drafter="none")) for p in decoding]
        for stream in streams:
            next(iter(stream))
        rounds, steps, started = _rounds(batch), _steps(batch), _first_tokens(batch)
        results = _burst(batch, burst, [PLAIN] * len(burst))
        _consumed(streams)
    finally:
        batch.shutdown()
    assert [r.token_ids for r in results] == reference
    assert started == [len(p) for p in burst]  # first come, first served
    assert [[n for n, _, _ in planned] for planned in rounds if planned] == [
        [len(p) for p in burst[i:i + 2]] for i in range(0, len(burst), 2)]
    assert all(riding <= 100 for _, riding in steps)
    # every step of the burst advanced the decoding requests: none went a step without a token
    assert all({len(p) for p in decoding} <= set(advanced) for advanced, riding in steps if riding)
    # the first pair of an idle engine's burst is prefilled in a call of its own; the others ride a step
    assert len([riding for _, riding in steps if riding]) == len(burst) // 2 - (0 if load else 1)


def test_each_request_records_where_its_first_token_waited_and_the_parts_add_up(engine):
    """A burst of 6 under a budget of 100 (two prompts a step): each stream's timeline splits submission to first
    token into parts that add up; the later pairs waited for chunks (older prompts took the budget), the first did
    not, and nobody waited for a slot (8 free)."""
    burst = [_ids(10 + i, 40 + i) for i in range(6)]
    batch = BatchEngine(engine, max_batch=8, kv_capacity=256, prefill_budget=100)
    try:
        with batch._wake:  # held off: one admission takes them all
            streams = [batch.stream(p, PLAIN) for p in burst]
        assert all(s.timeline.parts() is None for s in streams)  # no first token yet
        _consumed(streams)
    finally:
        batch.shutdown()
    parts = [s.timeline.parts() for s in streams]
    for timeline, split in zip((s.timeline for s in streams), parts):
        assert sum(split.values()) == pytest.approx(timeline.first_token - timeline.submitted, abs=1e-9)
        assert split["prefill"] > 0
    chunk_waits = [split["chunk_wait"] for split in parts]
    assert chunk_waits[0] < 0.01 and chunk_waits[1] < 0.01  # the first pair's chunks were planned at admission
    assert min(chunk_waits[2:]) > max(chunk_waits[:2])  # the later ones waited a step or more for the budget
    assert chunk_waits[4] > chunk_waits[2]
    assert max(split["slot_wait"] for split in parts) < 0.01


def test_the_itl_bound_takes_the_most_prompt_tokens_that_keep_a_step_within_its_factor():
    def linear(n):  # 20 ms a step + 1 ms a token (in ms: exact)
        return 20 + n

    assert itl_bounded_tokens(2, linear, 2.0, 512) == 16  # 22 fit; counted in 16s past 15
    assert itl_bounded_tokens(8, linear, 3.0, 512) == 48  # 56 fit
    assert itl_bounded_tokens(8, linear, 2.0, 10) == 10  # the cap first
    assert itl_bounded_tokens(8, linear, 100.0, 40) == 40
    assert itl_bounded_tokens(8, lambda n: 1 if n <= 8 else 5, 2.0, 512) == 0  # not even one token fits
    assert itl_bounded_tokens(2, lambda n: 20 + n if n <= 100 else 0, 2.0, 512) == 16  # a dip further on: not read
    assert PrefillBudget(300, 2.0).for_step(0, linear) == 300  # nothing runs: the cap alone
    assert PrefillBudget(300, None).for_step(8, linear) == 300
    assert PrefillBudget(300, 2.0).for_step(2, linear) == 16
    assert PrefillBudget(300, 2.0).for_step(2, linear, idle_step=10) == 10  # a measured step is the base
    assert itl_bounded_tokens(8, linear, 3.0, 512, idle_step=14) == 16
    for bad in ((0, 2.0), (64, 1.0), (64, 0.5), (True, 2.0)):
        with pytest.raises(ValueError):
            PrefillBudget(*bad)


def test_the_itl_bound_is_based_on_measured_steps_that_carried_no_prompt_tokens(engine):
    batch = BatchEngine(engine, max_batch=8, kv_capacity=256, prefill_itl_factor=2.0)
    batch.shutdown()
    calls = batch.calls
    calls.idle_step = None
    calls._ragged_shapes.add(5)
    now = time.perf_counter()
    calls.observe_ragged(5, now - 0.5)
    assert calls.idle_step == pytest.approx(0.5, abs=0.01)
    calls.observe_ragged(5, now - 2.0, prompt_tokens=3)  # a step that prefilled: not what running requests idle at
    assert calls.idle_step == pytest.approx(0.5, abs=0.01)
    calls.observe_batched(2, time.perf_counter() - 0.1)
    assert calls.idle_step == pytest.approx(0.5 + 0.2 * (0.1 - 0.5), abs=0.01)


def test_under_the_itl_bound_a_burst_onto_running_requests_rides_in_granules_and_onto_none_all_at_once(engine):
    """Step costs of 20 ms + 1 ms a token, factor 2: beside 2 decoding requests a step may add 22 prompt tokens, so each
    40-token prompt of the burst rides three steps in 16-token granules, oldest first; on an idle engine the whole
    burst is prefilled at once under the cap. Texts stay each prompt's own."""
    burst = [_ids(10 + i, 40 + i) for i in range(4)]
    decoding = _decoding_to_the_end(engine, [_ids(50 + i, 11 + 2 * i) for i in range(9)], 2, tokens=40)
    reference = [engine.generate(p, PLAIN).token_ids for p in burst]
    for load in (decoding, []):
        batch = BatchEngine(engine, max_batch=8, kv_capacity=256, prefill_budget=512, prefill_itl_factor=2.0)
        batch.calls.ragged_costs.seconds = lambda n: 20 + n  # ms
        batch.calls._observe_idle_step = lambda seconds: None  # the table is the base too
        try:
            streams = [batch.stream(p, GenerationConfig(max_new_tokens=40, drafter="none")) for p in load]
            for stream in streams:
                next(iter(stream))
            rounds = _rounds(batch)
            results = _burst(batch, burst, [PLAIN] * len(burst))
            _consumed(streams)
        finally:
            batch.shutdown()
        assert [r.token_ids for r in results] == reference
        planned = [chunks for chunks in rounds if chunks]
        if load:  # 22 prompt tokens a step at most, in 16-token granules, first come first served
            assert all(sum(tokens for _, _, tokens in chunks) <= 22 for chunks in planned)
            pieces = [(n, start, tokens) for chunks in planned for n, start, tokens in chunks]
            assert [n for n, _, _ in pieces] == sorted(n for n, _, _ in pieces)
            for prompt in burst:
                mine = [(start, tokens) for n, start, tokens in pieces if n == len(prompt)]
                assert mine == [(0, 16), (16, 16), (32, len(prompt) - 32)]
        else:
            assert [n for n, _, _ in planned[0]] == [len(p) for p in burst]  # idle: all of them in the first step


def test_prompts_that_start_with_one_document_prefill_it_once_chunk_by_chunk(engine):
    """Three prompts arriving at once start with one 200-token document: the oldest prefills it (4 steps of 64
    under a budget of 64); the others wait and copy each chunk it computed, then prefill with it the last one,
    where only 8 document tokens were left (waiting a step for fewer than MIN_PREFIX would cost more)."""
    document = _ids(2, 200)
    prompts = [document + _ids(20 + i, 6) for i in range(3)]
    reference = [engine.generate(p, PLAIN).token_ids for p in prompts]
    batch = BatchEngine(engine, max_batch=8, kv_capacity=512, prefill_budget=64)
    rounds = _rounds(batch)
    try:
        results = _burst(batch, prompts, [PLAIN] * 3)
    finally:
        batch.shutdown()
    assert [r.token_ids for r in results] == reference
    copied = 3 * PREFILL_CHUNK
    assert [[n for _, _, n in planned] for planned in rounds if planned] == [[64], [64], [64], [14, 14, 14]]
    assert [[start for _, start, _ in planned] for planned in rounds if planned][-1] == [copied] * 3
    assert batch.arena.prefix_copies == 2 * 3 and batch.prefix_tokens_reused == 2 * copied


SHARED = [16, 40, 63, 64, 65, 100, 127, 128, 129, 200, 300, 400]


def test_a_reused_prefix_gives_the_logits_and_text_of_a_fresh_prefill_bit_for_bit_under_load(engine, monkeypatch):
    """For shared prefixes of 16 to 400 tokens (the tiny model has 512 positions), a prompt reusing the prefix that
    another left in a slot gets the first-token logits, every token's logprobs and the greedy text it gets without
    the prefix cache, bit for bit, while other requests decode and draft beside it (other riders each time)."""
    document = _ids(3, max(SHARED))
    config = GenerationConfig(max_new_tokens=10, drafter="none", logprobs=3)  # logprobs: the fp32 LM head
    load = GenerationConfig(max_new_tokens=400, drafter="ngram", num_draft_tokens="auto", ngram_min=1)
    logits = _first_logits(monkeypatch)
    runs = {}
    for reuse in (False, True):
        batch = BatchEngine(engine, max_batch=8, kv_capacity=512, prefix_cache=reuse, prefill_budget=128)
        background = [batch.stream(_ids(30 + i, 20 + 7 * i), load) for i in range(3 + reuse)]
        pieces = [iter(s) for s in background]
        for piece in pieces:
            next(piece)
        try:
            for shared in SHARED:
                first, second = document[:shared] + _ids(4, 7), document[:shared] + _ids(5, 9)
                if reuse:
                    batch.generate(first, config)  # leaves the prefix in its slot
                before = batch.prefix_tokens_reused
                iterations = []
                stream = batch.stream(second, config, on_iteration=iterations.append)
                text = "".join(stream)
                runs[reuse, shared] = (text, stream.result.token_ids, [repr(i.logprobs) for i in iterations])
                assert batch.prefix_tokens_reused - before == (prefill_start(shared, len(second)) if reuse else 0)
            for stream in background:
                stream.cancel()
        finally:
            batch.shutdown()
    for shared in SHARED:
        second = tuple(document[:shared] + _ids(5, 9))
        fresh, reused = logits[second]
        assert np.array_equal(fresh, reused), (shared, float(np.abs(fresh - reused).max()))
        assert runs[False, shared] == runs[True, shared], shared


def test_a_lone_last_row_would_round_otherwise_so_the_same_prompt_again_feeds_two_tokens(engine, monkeypatch):
    """The same prompt again reuses all but its last two positions: the last token alone would take attention's
    1-row kernel and its logits differ from the fresh prefill's (here by ~1e-6); fed with the one before it they
    are bit for bit the same. (What makes the test above able to fail.)"""
    prompt = _ids(6, 40)
    logits = _first_logits(monkeypatch)
    for lone in (False, True):
        if lone:
            monkeypatch.setattr("specdec.runtime.slots.prefill_start",
                                lambda reusable, tokens, lone_rows_differ=True: min(reusable, tokens - 1))
        batch = BatchEngine(engine, max_batch=2, kv_capacity=128)
        try:
            batch.generate(prompt, PLAIN)
            batch.generate(prompt, PLAIN)
        finally:
            batch.shutdown()
        assert batch.prefix_tokens_reused == len(prompt) - (1 if lone else 2)
        fresh, reused = logits.pop(tuple(prompt))
        assert np.array_equal(fresh, reused) != lone, float(np.abs(fresh - reused).max())


@pytest.mark.parametrize("exact_steps", [False, True])
def test_a_chats_second_turn_prefills_what_the_first_did_not_compute_alike(engine, exact_steps_engine, exact_steps):
    """Turn 2 = turn 1's prompt + its reply + a new message. With --exact-steps (1-token steps compute a position
    as a prefill does) it reuses all but the reply's last token, which turn 1 never fed: it prefills only its new
    tokens and that one. Where a lone step rounds otherwise (the default export) the reply's positions are not
    reused: turn 1's prompt is. Either way the text is turn 2's target-only text."""
    target = exact_steps_engine if exact_steps else engine
    turn_1 = _ids(7, 70)
    batch = BatchEngine(target, max_batch=8, kv_capacity=256)
    try:
        reply = batch.generate(turn_1, GenerationConfig(max_new_tokens=20, drafter="none")).token_ids
        turn_2 = turn_1 + reply + _ids(8, 12)
        before = batch.prefix_tokens_reused
        second = batch.generate(turn_2, PLAIN).token_ids
        reused = batch.prefix_tokens_reused - before
    finally:
        batch.shutdown()
    assert second == target.generate(turn_2, PLAIN).token_ids
    assert reused == (len(turn_1) + len(reply) - 1 if exact_steps else len(turn_1))
    assert len(turn_2) - reused == (12 + 1 if exact_steps else len(reply) + 12)


def test_the_prefix_cache_is_on_by_default_and_serve_maps_its_flags(engine, tiny_artifacts, monkeypatch):
    from specdec.cli import serve as serve_cli
    from specdec.cli.main import main
    from specdec.serve.config import ServeConfig

    batch = BatchEngine(engine, max_batch=2, kv_capacity=64)
    batch.shutdown()
    assert batch.prefix_cache and batch.prefill_budget == DEFAULT_PREFILL_BUDGET
    for bad in (0, -1, 1.5, True):
        with pytest.raises(GenerationError, match="prefill_budget must be an integer >= 1"):
            BatchEngine(engine, max_batch=2, kv_capacity=64, prefill_budget=bad)
    config = ServeConfig(artifact="a")
    assert config.prefix_cache and config.prefill_budget == DEFAULT_PREFILL_BUDGET
    with pytest.raises(SpecdecError, match="prefill_budget must be >= 1"):
        ServeConfig(artifact="a", prefill_budget=0).validate()

    started = []
    monkeypatch.setattr(serve_cli, "_serve_one_process", lambda config, *args: started.append(config))
    artifact = str(tiny_artifacts["llama"])
    for flags, cache, budget, factor in (([], True, DEFAULT_PREFILL_BUDGET, 0.0),
                                         (["--no-prefix-cache"], False, DEFAULT_PREFILL_BUDGET, 0.0),
                                         (["--prefill-budget", "64", "--prefix-cache"], True, 64, 0.0),
                                         (["--prefill-itl-factor", "2.5"], True, DEFAULT_PREFILL_BUDGET, 2.5)):
        result = CliRunner().invoke(main, ["serve", artifact, "--port", "0"] + flags)
        assert result.exit_code == 0, result.output
        config = started.pop()
        assert (config.prefix_cache, config.prefill_budget, config.prefill_itl_factor) == (cache, budget, factor)
    result = CliRunner().invoke(main, ["serve", artifact, "--prefill-budget", "0"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    with pytest.raises(SpecdecError, match="prefill_itl_factor must be > 1"):
        ServeConfig(artifact="a", prefill_itl_factor=1.0).validate()
    with pytest.raises(GenerationError, match="ITL factor must be > 1"):
        BatchEngine(engine, max_batch=2, kv_capacity=64, prefill_itl_factor=0.9)
    result = CliRunner().invoke(main, ["serve", artifact, "--prefill-itl-factor", "0.5"])
    assert result.exit_code != 0 and "prefill_itl_factor must be > 1" in result.output and "Traceback" not in result.output


def test_a_burst_over_more_slots_than_the_ragged_graph_has_rows_runs_every_request(engine):
    """16 slots over an 8-row ragged graph, 16 short prompts at once, five a round under the budget: the round that
    plans slots 5-9 prefills 8 and 9 (past the graph's rows) in plain calls, and they join the running ones; then a
    chunk rides a step only while every running request sits in the graph's rows (slots 5-7 once rode a ragged call
    with slots 8 and 9 running in it: every request of the step failed)."""
    rows = engine.target.spec.ragged_rows
    prompts = [_ids(seed, 24 + seed % 3) for seed in range(2 * rows)]
    reference = [engine.generate(p, PLAIN).token_ids for p in prompts]
    batch = BatchEngine(engine, max_batch=2 * rows, kv_capacity=256, prefill_budget=128)
    try:
        results = _burst(batch, prompts, [PLAIN] * len(prompts))
    finally:
        batch.shutdown()
    assert [r.token_ids for r in results] == reference
