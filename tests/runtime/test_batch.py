"""The batch engine: every request's output is its own under any load (greedy token for token, sampled in
distribution and seed for seed), its slots are reused, and an old artifact is refused in one line."""

import dataclasses
import shutil
import threading
from collections import Counter

import numpy as np
import onnx
import pytest

from specdec.models.errors import GenerationError
from specdec.runtime import batch_step
from specdec.runtime.batch import BatchEngine
from specdec.runtime.batch_chunks import PREFILL_CHUNK
from specdec.runtime.batch_plan import (BatchCallCosts, DraftCandidate, DraftRecord, ShadowDraft,
                                        choose_draft_lengths_ragged, choose_speculating, drafts_cannot_pay)
from specdec.runtime.config import DEFAULT_DRAFT_TOKENS
from specdec.runtime.drafters import Proposal
from specdec.runtime.engine import Engine, GenerationConfig
from specdec.runtime.guess_rows import GUESS
from specdec.runtime.sampling import SamplingConfig

from tests.runtime.helpers import flat_call_costs
from tests.runtime.test_exactness import PROMPTS, _chi_square, _target_joint

PROMPT_SET = PROMPTS + ["Hello world!", "a b c d e f", "1 2 3 4 1 2 3 4 1 2", "The cat sat on", "x = [1, 2,",
                        "once upon a time", "def f(x):", "red green blue red green", "zz", "q", "Paris is",
                        "the the the the", "import numpy as"]


@pytest.fixture(scope="module")
def engine(tiny_close_artifacts, tiny_target_only_artifact):
    # The old-artifact test's export comes first: once a test made onnxruntime's process-wide thread pool
    # (serve's batching), the exporter's own sessions are refused.
    return Engine.load(tiny_close_artifacts["llama"], provider="cpu", threads=1)


def _results_in_batch(engine, prompts, configs, run=None, **options):
    """Return (each prompt's GenerationResult, the batch engine) of `run(batch, prompts, configs)` (default:
    all submitted at once, each consumed on its own thread) in a BatchEngine(engine, **options), shut down after."""
    batch = BatchEngine(engine, **options)
    try:
        return (run or _concurrently)(batch, prompts, configs), batch
    finally:
        batch.shutdown()


def _concurrently(batch, prompts, configs):
    """Return the GenerationResults of all prompts submitted at once, each consumed on its own thread."""
    return _consumed([batch.stream(p, c) for p, c in zip(prompts, configs)])


def _record_feeds(monkeypatch, session):
    """Return a list that gets the token count of every `session.forward` call from now on (prefills, mostly)."""
    fed = []
    forward = session.forward
    monkeypatch.setattr(session, "forward", lambda cache, ids, **options: fed.append(len(ids)) or forward(cache, ids,
                                                                                                          **options))
    return fed


def _consumed(streams):
    """Return each stream's GenerationResult, the streams consumed on threads of their own."""
    results = [None] * len(streams)

    def consume(i):
        for _ in streams[i]:
            pass
        results[i] = streams[i].result

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(streams))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.mark.parametrize("clients, max_batch", [(4, 4), (8, 8), (16, 8)])
def test_greedy_under_load_equals_each_prompts_own_target_only_output(engine, clients, max_batch):
    """Plain, n-gram auto, fixed-K model and n-gram+model requests mixed in one batch: each text is the
    target-only greedy text of its prompt (16 clients on 8 slots also queue)."""
    prompts = (PROMPT_SET * 2)[:clients]
    reference = [engine.generate(p, GenerationConfig(max_new_tokens=24, drafter="none")).token_ids for p in prompts]
    kinds = [dict(drafter="none"), dict(drafter="ngram", num_draft_tokens="auto", ngram_min=1),
             dict(drafter="model", num_draft_tokens=3), dict(drafter="ngram+model", num_draft_tokens="auto")]
    configs = [GenerationConfig(max_new_tokens=24, **kinds[i % len(kinds)]) for i in range(clients)]
    steps = []
    results, batch = _results_in_batch(engine, prompts, configs, max_batch=max_batch, kv_capacity=128, on_step=steps.append)
    assert [r.token_ids for r in results] == reference
    assert max(steps) >= 2, steps  # requests really shared calls
    assert sum(r.stats.accepted for r in results) > 0  # and some speculated
    # 8 slots match the artifact's ragged-rows graphs: verify rows shared the batched call, and the draft
    # model's calls of several requests one draft call; 4 slots verify and draft alone
    assert (batch.ragged_calls > 0) == (max_batch == engine.target.spec.ragged_rows), batch.ragged_calls
    assert (batch.draft_ragged_calls > 0) == (max_batch == engine.draft.spec.ragged_rows), batch.draft_ragged_calls


@pytest.mark.parametrize("max_batch", [8, 4])
def test_seeded_sampled_requests_reproduce_under_load(engine, max_batch):
    """A seeded request's tokens do not depend on what runs beside it (its own generator; fixed K or none).
    4 slots: each request's draft calls run alone in its draft slot, as where the export left the draft's ragged
    graph out (an AVX2-only CPU), and half the requests queue."""
    configs = [GenerationConfig(max_new_tokens=16, seed=s, temperature=1.2, top_k=8, drafter=d, num_draft_tokens=k)
               for s, (d, k) in enumerate([("none", None), ("model", 2), ("none", None), ("model", 3)] * 2)]
    prompts = PROMPT_SET[:len(configs)]
    alone = [engine.generate(p, c).token_ids for p, c in zip(prompts, configs)]
    results, batch = _results_in_batch(engine, prompts, configs, max_batch=max_batch, kv_capacity=128)
    assert [r.token_ids for r in results] == alone
    assert sum(r.stats.drafted for r in results) > 0
    if max_batch == 8:
        assert batch.ragged_calls > 0 and batch.draft_ragged_calls > 0  # verify rows and draft calls both shared
    else:
        assert batch.draft_ragged_calls == 0 and batch.draft_arena is not None


def test_a_reproducible_request_under_auto_k_keeps_its_text_whatever_the_timings_and_the_load(engine, monkeypatch):
    """OpenAI's seed under `-k auto`: K follows the request's own tokens (lookup's over the calibrated costs, a
    draft model's the artifact's fixed K), so live call times and the batch plan leave its text alone. The same
    requests without `reproducible` change their K under the skewed times: the test can tell."""
    prompts = ["the the the the", "red green blue red green", "one, two, three, one, two,", "a b a b a b"] * 2
    configs = [GenerationConfig(max_new_tokens=24, seed=s, temperature=1.1, top_k=8, num_draft_tokens="auto",
                                drafter=("ngram" if s % 4 else "model"), ngram_min=1, reproducible=True)
               for s in range(len(prompts))]
    loose = [dataclasses.replace(c, reproducible=False) for c in configs]
    assert not dataclasses.replace(configs[0], temperature=0).k_follows_tokens  # greedy: any K gives the same text
    engine.time_call_costs()
    alone = [engine.generate(p, c) for p, c in zip(prompts, configs)]
    loose_alone = [engine.generate(p, c).stats.draft_lengths for p, c in zip(prompts, loose)]
    monkeypatch.setattr(engine, "target_call_costs", flat_call_costs(engine))
    assert [engine.generate(p, c).stats.draft_lengths for p, c in zip(prompts, loose)] != loose_alone
    others = [GenerationConfig(max_new_tokens=24, drafter="ngram", num_draft_tokens="auto")] * 4
    results, _ = _results_in_batch(engine, prompts + PROMPT_SET[:4], configs + others, max_batch=8,
                                   kv_capacity=128)
    assert [r.token_ids for r in results[:len(prompts)]] == [r.token_ids for r in alone]
    assert [r.stats.draft_lengths for r in results[:len(prompts)]] == [r.stats.draft_lengths for r in alone]
    assert all(r.stats.num_draft_tokens == ("auto" if s % 4 else str(DEFAULT_DRAFT_TOKENS))
               for s, r in enumerate(alone)) and sum(r.stats.accepted for r in alone) > 0


def test_sampled_distribution_under_batching_is_the_targets(engine):
    """Chi-square of the first four tokens' joint distribution, plain and speculating requests mixed 8 at a time:
    tokens 2-4 come from batched calls (plain rows) and verify calls with rejections and bonus tokens."""
    settings = dict(temperature=1.3, top_k=3)
    prompt_ids = engine.prompt_ids("one, two, three, one, two, three, one, two,")
    exact = _target_joint(engine, prompt_ids, SamplingConfig(**settings), depth=4)
    runs = 1500
    counts = {"none": Counter(), "model": Counter()}
    steps = []
    batch = BatchEngine(engine, max_batch=8, kv_capacity=64, on_step=steps.append)
    try:
        for start in range(0, 2 * runs, 64):
            streams = [(d, batch.stream(prompt_ids, GenerationConfig(max_new_tokens=4, seed=s, drafter=d,
                                                                      num_draft_tokens=None if d == "none" else 2,
                                                                      **settings)))
                       for s in range(start, start + 64) for d in ["none" if s % 2 else "model"]]
            for drafter, stream in streams:
                for _ in stream:
                    pass
                counts[drafter][tuple(stream.result.token_ids[:4])] += 1
    finally:
        batch.shutdown()
    assert max(steps) >= 4 and batch.ragged_calls > 0 and batch.draft_ragged_calls > 0
    for drafter, observed in counts.items():
        assert set(observed) <= set(exact), "sampled a sequence the target gives zero probability"
        chi2, critical = _chi_square(observed, exact, sum(observed.values()))
        assert chi2 < critical, (drafter, chi2, critical)


def test_sampled_requests_verifying_guess_rows_keep_the_targets_distribution(engine, monkeypatch):
    """Chi-square of the first four tokens' joint distribution of prompt-lookup requests that verify a 1-token guess
    wherever they would decode one token alone (reply_reuse_share 1: guess_rows.py), 8 at a time: a guess is a
    one-hot draft, accepted by the target's test or replaced from the residual, so the text is the target's.
    The tiny target's text repeats nothing lookup could guess: the guesses here are its most likely next token
    (from the exact joint), so both the test's outcomes happen often."""
    settings = dict(temperature=1.3, top_k=3)
    prompt_ids = engine.prompt_ids("one, two, three, one, two, three, one, two,")
    exact = _target_joint(engine, prompt_ids, SamplingConfig(**settings), depth=4)
    likely: dict[tuple[int, ...], Counter] = {}
    for sequence, probability in exact.items():
        for n in range(4):
            likely.setdefault(sequence[:n], Counter())[sequence[n]] += probability
    monkeypatch.setattr(batch_step, "guess", lambda context, lookup: Proposal(
        [likely[tuple(context[len(prompt_ids):])].most_common(1)[0][0]], None))
    observed, guesses = Counter(), Counter()

    def seen(iteration):
        if iteration.situation == GUESS:
            guesses["accepted" if iteration.num_accepted else "rejected"] += 1

    batch = BatchEngine(engine, max_batch=8, kv_capacity=64, reply_reuse_share=1.0)
    try:
        for start in range(0, 1200, 64):
            streams = [batch.stream(prompt_ids, GenerationConfig(max_new_tokens=4, seed=s, drafter="ngram", **settings),
                                    on_iteration=seen) for s in range(start, start + 64)]
            for stream in streams:
                for _ in stream:
                    pass
                observed[tuple(stream.result.token_ids[:4])] += 1
    finally:
        batch.shutdown()
    assert guesses["accepted"] > 50 and guesses["rejected"] > 50, guesses  # not vacuous: guesses both ways
    assert set(observed) <= set(exact), "sampled a sequence the target gives zero probability"
    chi2, critical = _chi_square(observed, exact, sum(observed.values()))
    assert chi2 < critical, (chi2, critical)


def test_cancelled_and_finished_requests_free_their_slots(engine):
    batch = BatchEngine(engine, max_batch=2, kv_capacity=128)
    try:
        stream = batch.stream(PROMPTS[0], GenerationConfig(max_new_tokens=100, drafter="none"))
        next(iter(stream))
        iter(stream).close()  # the consumer leaves: the request is cancelled at the next step
        for _ in range(3):  # more requests than slots, one after the other: slots come back
            assert batch.generate(PROMPTS[1], GenerationConfig(max_new_tokens=8, drafter="none")).token_ids
        assert batch.arena.used == 0 and batch.num_running == 0
    finally:
        batch.shutdown()


def test_a_request_cancelled_while_it_waits_is_never_prefilled_and_ends_cancelled(engine, monkeypatch):
    batch = BatchEngine(engine, max_batch=2, kv_capacity=128)
    started = []
    try:
        holders = [batch.stream(p, GenerationConfig(max_new_tokens=60, drafter="none"),
                                on_start=lambda p=p: started.append(p)) for p in PROMPTS[:2]]
        for holder in holders:
            next(iter(holder))  # both slots are taken
        fed = _record_feeds(monkeypatch, engine.target)
        waiting = batch.stream(PROMPTS[2], GenerationConfig(max_new_tokens=8, drafter="none"),
                               on_start=lambda: started.append("waiting"))
        assert batch.num_waiting == 1
        waiting.cancel()  # from this thread, while its consumer has not even begun
        assert list(waiting) == [] and waiting.result.finish_reason == "cancelled"
        assert batch.num_waiting == 0
        for holder in holders:
            holder.cancel()
            list(holder)
            assert holder.result.finish_reason == "cancelled" and len(holder.result.token_ids) < 60
        assert sorted(started) == sorted(PROMPTS[:2])  # the cancelled one never took a slot
        assert all(n <= 1 for n in fed)  # nor was prefilled (a prefill feeds the whole prompt)
        batch.generate(PROMPT_SET[3], GenerationConfig(max_new_tokens=2, drafter="none"))  # a step after the cancels
        assert batch.arena.used == 0
    finally:
        batch.shutdown()


def test_a_cancelled_stream_of_the_single_engine_ends_after_its_iteration(engine):
    started = []
    stream = engine.stream(PROMPTS[0], GenerationConfig(max_new_tokens=60, drafter="none"),
                           on_start=lambda: started.append(True))
    assert started == [True]  # no queue: it starts at once
    pieces = iter(stream)
    next(pieces)
    stream.cancel()
    list(pieces)
    assert stream.result.finish_reason == "cancelled" and len(stream.result.token_ids) < 60


def test_a_request_that_does_not_fit_a_slot_is_refused_in_one_line(engine):
    batch = BatchEngine(engine, max_batch=2, kv_capacity=32)
    try:
        with pytest.raises(GenerationError, match="do not fit a KV slot of 32 positions"):
            batch.stream(PROMPTS[0], GenerationConfig(max_new_tokens=64))
    finally:
        batch.shutdown()


def test_an_artifact_exported_before_batching_is_refused_naming_the_re_export(tiny_target_only_artifact, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(tiny_target_only_artifact, old)
    graph_file = old / Engine.load(old, provider="cpu").manifest.target.graph_file
    model = onnx.load(graph_file)
    seqlens = next(i for i in model.graph.input if i.name == "seqlens_k")
    seqlens.type.tensor_type.shape.dim[0].dim_value = 1  # what graphs declared before the batch engine
    onnx.save(model, graph_file)
    engine = Engine.load(old, provider="cpu", check_files=False)
    assert engine.generate(PROMPTS[0], GenerationConfig(max_new_tokens=4)).token_ids  # still runs at batch 1
    with pytest.raises(GenerationError, match="re-export it with `specdec export`"):
        BatchEngine(engine, max_batch=2)


def test_a_lone_request_speculates_exactly_when_theorem_3_8_pays():
    """Alone, moving the request out of the batch pays iff E(k) t(1) > t(k+1)."""
    t = {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3}
    for alpha, k in [(0.1, 3), (0.6, 3), (0.9, 1), (0.2, 1)]:
        expected = (1 - alpha ** (k + 1)) / (1 - alpha) * t[1] > t[k + 1]
        assert choose_speculating([DraftCandidate(k, alpha)], 0, lambda n: n * 1.0 if n else 0.0,
                                  t.__getitem__) == [expected]


def test_a_batch_speculates_only_where_a_verify_call_gives_more_than_the_rows_it_leaves():
    """Eight rows share a call costing 1.4 one-row calls and a verify call costs a whole one: at eight rows
    nothing pays, even at alpha 0.97; at three rows alpha 0.97 pays and 0.3 does not."""
    batch = {n: 1.0 + 0.057 * (n - 1) for n in range(1, 9)}
    batch[0] = 0.0
    verify = lambda n: 1.0 + 0.1 * (n - 1)  # noqa: E731
    low = [DraftCandidate(3, 0.3)] * 4
    assert choose_speculating(low, 4, batch.__getitem__, verify) == [False] * 4
    high = [DraftCandidate(4, 0.97)] + [DraftCandidate(4, 0.3)] * 3
    assert choose_speculating(high, 4, batch.__getitem__, verify) == [False] * 4
    assert choose_speculating([DraftCandidate(3, 0.3), DraftCandidate(4, 0.97)], 1, batch.__getitem__,
                              verify) == [False, True]
    fixed = [DraftCandidate(3, 0.3, adjustable=False)]
    assert choose_speculating(fixed, 7, batch.__getitem__, verify) == [True]  # a K the user fixed is kept


def test_with_ragged_rows_drafts_pay_by_the_tokens_they_add_to_the_one_call():
    """SmolLM2's measured shape (CPU, 2 threads): a ragged call ~24 ms + 1.3 ms per token, the batched decode
    call ~29 ms at 8 rows (3.6 ms a token). A draft pays where its chance of being kept, alpha^j, beats
    about 1.3 / 3.6: all eight rows at alpha 0.9 draft; at alpha 0.2 none does; two good rows among six poor
    ones draft alone; a middling alpha drafts fewer than its policy's K."""
    plain = lambda n: 0.0 if n == 0 else 0.0185 + 0.00135 * n  # noqa: E731
    ragged = lambda tokens: 0.0245 + 0.0013 * tokens  # noqa: E731
    assert choose_draft_lengths_ragged([DraftCandidate(4, 0.9)] * 8, 0, plain, ragged) == [4] * 8
    assert choose_draft_lengths_ragged([DraftCandidate(4, 0.2)] * 8, 0, plain, ragged) == [0] * 8
    mixed = [DraftCandidate(4, 0.95)] * 2 + [DraftCandidate(4, 0.1)] * 6
    assert choose_draft_lengths_ragged(mixed, 0, plain, ragged) == [4] * 2 + [0] * 6
    middling = choose_draft_lengths_ragged([DraftCandidate(6, 0.7)] * 8, 0, plain, ragged)
    assert 0 < middling[0] < 6 and len(set(middling)) <= 2, middling
    # a K the user fixed is kept even where it costs
    assert choose_draft_lengths_ragged([DraftCandidate(2, 0.05, adjustable=False)], 7, plain, ragged) == [2]


def test_planning_is_skipped_exactly_where_no_request_would_speculate_even_with_every_draft_accepted():
    """The bound against the chooser itself, over random cost lines: where it holds, no request at acceptance 1
    and any K up to max_k leaves the batch; where it fails, one such request does."""
    rng = np.random.default_rng(7)
    held = failed = 0
    for _ in range(400):
        base, per_row = rng.uniform(0.005, 0.03), rng.uniform(0.0005, 0.005)
        verify_base, per_token = rng.uniform(0.002, 0.03), rng.uniform(0.0002, 0.004)
        batch = lambda n: 0.0 if n <= 0 else base + per_row * n  # noqa: E731
        verify = lambda n: verify_base + per_token * n  # noqa: E731
        rows, max_k = int(rng.integers(2, 17)), int(rng.integers(1, 9))
        sure = [[DraftCandidate(k, 1.0)] * rows for k in range(1, max_k + 1)]
        moved = any(any(choose_speculating(candidates, 0, batch, verify)) for candidates in sure)
        bound = drafts_cannot_pay(rows, max_k, batch, verify)
        assert bound is not moved, (rows, max_k, base, per_row, verify_base, per_token)
        held, failed = held + bound, failed + (not bound)
    assert held > 40 and failed > 40  # both sides of the bound were tried


def test_a_full_batch_skips_planning_only_where_verify_calls_cannot_pay(engine, monkeypatch):
    """Beyond the ragged rows, each draft needs a verify call of its own. Priced at a second, no step plans or
    asks prompt lookup (not one `plan` call with every slot running); nearly free, every step plans; a K the
    request set is asked for whatever the cost. Every text stays its prompt's target-only text."""
    from specdec.runtime import batch_step as batch_module

    rows = engine.target.spec.ragged_rows
    prompts = (PROMPT_SET * 2)[:2 * rows]
    reference = [engine.generate(p, GenerationConfig(max_new_tokens=12, drafter="none")).token_ids for p in prompts]
    plans, skipped = [], []
    planned = batch_module.plan
    monkeypatch.setattr(batch_module, "plan", lambda state: plans.append(1) or planned(state))

    def run(verify_seconds, fixed_k=None):
        del plans[:], skipped[:]
        configs = [GenerationConfig(max_new_tokens=12, drafter="ngram", ngram_min=1,
                                    num_draft_tokens="auto" if i % 2 else None) for i in range(2 * rows)]
        if fixed_k:
            configs[-1] = GenerationConfig(max_new_tokens=12, drafter="ngram", ngram_min=1, num_draft_tokens=fixed_k)
        batch = BatchEngine(engine, max_batch=2 * rows, kv_capacity=128)
        batch.calls.verify_seconds = lambda: verify_seconds
        bound = batch._drafts_cannot_pay
        batch._drafts_cannot_pay = lambda running: (skipped.append((len(running), bound(running))),
                                                    skipped[-1][1])[1]
        try:
            results = _burst(batch, prompts, configs)
        finally:
            batch.shutdown()
        assert [r.token_ids for r in results] == reference
        return [n for n, skip in skipped if skip], sum(n for n, skip in skipped if not skip)

    skipping, asked = run(lambda n: 1.0)
    assert 2 * rows in skipping and len(plans) == asked
    skipping, asked = run(lambda n: 1e-9)
    assert skipping == [] and len(plans) == asked > 0
    skipping, asked = run(lambda n: 1.0, fixed_k=2)
    assert skipping == [] and len(plans) == asked > 0


def test_batch_call_costs_interpolate_between_timed_row_counts():
    costs = BatchCallCosts()
    costs.observe(1, 0.02)
    costs.observe(4, 0.05)
    assert costs.seconds(0) == 0.0
    assert np.isclose(costs.seconds(2), 0.03) and np.isclose(costs.seconds(8), 0.09)


def test_only_a_k_the_request_set_itself_is_kept_under_load(engine):
    """auto's K and the artifact's default K give way in a batch; an explicit K is kept (and reproduces)."""
    from specdec.runtime.batch_request import draft_candidate as _candidate

    for k, adjustable in [("auto", True), (None, True), (3, False)]:
        opened = engine.open_request([1, 2, 3], GenerationConfig(drafter="ngram", num_draft_tokens=k))
        assert _candidate(opened, "any", 2).adjustable is adjustable, k


def test_the_prefix_cache_skips_what_a_finished_request_left_in_its_slot(engine, monkeypatch):
    """The same prompt again: its prefill feeds two tokens (a lone last one would take attention's 1-row kernel,
    which rounds otherwise), on the slot the first run left; a prompt that shares nothing takes a fresh slot; the
    text stays the target-only one here (tiny model, no near-tie)."""
    prompt = engine.prompt_ids("one, two, three, one, two, three, one, two, three, four")
    config = GenerationConfig(max_new_tokens=12, drafter="none")
    reference = engine.generate(prompt, config).token_ids
    fed = _record_feeds(monkeypatch, engine.target)
    batch = BatchEngine(engine, max_batch=2, kv_capacity=128, prefix_cache=True)
    try:
        assert batch.generate(prompt, config).token_ids == reference
        assert fed[0] == len(prompt) and batch.prefix_tokens_reused == 0
        fed.clear()
        assert batch.generate(prompt, config).token_ids == reference
        assert fed[0] == 2 and batch.prefix_tokens_reused == len(prompt) - 2
        other = engine.prompt_ids("zz top")
        fed.clear()
        batch.generate(other, config)
        assert fed[0] == len(other)
        fed.clear()  # the other prompt took the empty slot: the first prompt's prefix is still there
        assert batch.generate(prompt, config).token_ids == reference and fed[0] == 2
        # a prompt sharing 16+ tokens, under half of it, with the first: no empty slot left, it reuses them
        longer = prompt[:16] + engine.prompt_ids(" and then something else entirely, at some length" * 2)
        fed.clear()
        batch.generate(longer, config)
        assert fed[:2] == [PREFILL_CHUNK - 16, len(longer) - PREFILL_CHUNK]  # the rest, in aligned chunks
    finally:
        batch.shutdown()


def test_the_draft_model_reuses_its_slots_prefix_too(engine, monkeypatch):
    """With the prefix cache, the draft's slot keeps what its last request left: the same prompt again feeds the
    draft only its last token (and the first generated one), and the text is still the target-only one."""
    prompt = engine.prompt_ids("one, two, three, one, two, three, one, two, three, four")
    config = GenerationConfig(max_new_tokens=12, drafter="model", num_draft_tokens=2)
    reference = engine.generate(prompt, GenerationConfig(max_new_tokens=12, drafter="none")).token_ids
    fed = _record_feeds(monkeypatch, engine.draft)
    for keep in (False, True):
        batch = BatchEngine(engine, max_batch=2, kv_capacity=128, prefix_cache=keep)
        try:
            assert batch.generate(prompt, config).token_ids == reference
            fed.clear()
            assert batch.generate(prompt, config).token_ids == reference
        finally:
            batch.shutdown()
        # the draft's first call catches up on the prompt and the first token: all of them, or the last two
        assert fed[0] == (2 if keep else len(prompt) + 1), (keep, fed)


def test_under_load_a_draft_model_never_catches_up_on_a_whole_context(engine, monkeypatch):
    """A request whose draft model has not read its context (admitted beside others: the draft has no prefill)
    gets K = 0 while others run, unless its K is its own: a catch-up would cost a prefill, every row waiting.
    Alone, it drafts as the single loop does."""
    from specdec.runtime.draft_length import AdaptiveDraftLength
    from specdec.runtime.loop import MAX_DRAFT_ROOM

    monkeypatch.setattr("specdec.runtime.batch_step.DRAFT_MARGIN", 1e-6)  # the plan takes every draft it is offered
    # auto always asks for drafts: whether it would pay on the tiny models hangs on timings (alone it once did not)
    monkeypatch.setattr(AdaptiveDraftLength, "choose", lambda self, situation="": self.max_k)
    batch = BatchEngine(engine, max_batch=8, kv_capacity=128)
    long_feeds = []
    forward, forward_ragged = engine.draft.forward, engine.draft.forward_ragged

    def watched(cache, ids, **options):
        if len(ids) > MAX_DRAFT_ROOM and batch.num_running > 1:
            long_feeds.append(len(ids))
        return forward(cache, ids, **options)

    monkeypatch.setattr(engine.draft, "forward", watched)
    monkeypatch.setattr(engine.draft, "forward_ragged", lambda call, caches, rows, *rest: (
        long_feeds.extend(len(r) for r in rows if len(r) > MAX_DRAFT_ROOM), forward_ragged(call, caches, rows, *rest))[1])
    prompts = PROMPT_SET[:6]
    reference = [engine.generate(p, GenerationConfig(max_new_tokens=16, drafter="none")).token_ids for p in prompts]
    configs = [GenerationConfig(max_new_tokens=16, drafter="model", num_draft_tokens="auto")] * 6
    try:
        results = _concurrently(batch, prompts, configs)
        assert batch.generate(prompts[0], configs[0]).stats.drafted > 0  # alone it drafts
    finally:
        batch.shutdown()
    assert [r.token_ids for r in results] == reference
    assert long_feeds == []


def test_a_lone_request_in_a_high_slot_steps_over_its_own_row_only(engine, monkeypatch):
    """With the prefix cache a lone client's prompts sit in several slots; a step binds the rows from its lowest
    running slot to its highest, so a lone request's steps are 1-row calls wherever it sits (they were calls over
    slots 0..s, s parked rows each), and the text is still the target-only one."""
    prompts = [engine.prompt_ids(p) for p in PROMPT_SET[:4]]
    config = GenerationConfig(max_new_tokens=8, drafter="none")
    reference = engine.generate(prompts[3], config).token_ids
    batch = BatchEngine(engine, max_batch=8, kv_capacity=128, prefix_cache=True)
    windows = []
    forward_batch = engine.target.forward_batch

    def recorded(binding_for, caches, *args):
        windows.append([c.slot if c is not None else None for c in caches])
        return forward_batch(binding_for, caches, *args)

    monkeypatch.setattr(engine.target, "forward_batch", recorded)
    try:
        for prompt in prompts:  # each in a slot of its own, kept there for the prefix cache
            batch.generate(prompt, config)
        windows.clear()
        assert batch.generate(prompts[3], config).token_ids == reference  # back in the slot its prompt left
    finally:
        batch.shutdown()
    assert windows and all(len(window) == 1 for window in windows), windows
    assert windows[0][0] >= 3, windows  # not slot 0: its steps were calls over 4+ rows before


def test_a_prompt_sharing_only_a_short_prefix_takes_an_empty_slot_over_a_longer_cached_context(engine, monkeypatch):
    """A shared system prompt is not worth cutting another conversation's cache short while a slot is empty."""
    prompt = engine.prompt_ids("one, two, three, one, two, three, one, two, three, four, five, six, seven")
    longer = prompt[:16] + engine.prompt_ids(" and then something else entirely, at some length" * 2)
    config = GenerationConfig(max_new_tokens=8, drafter="none")
    fed = _record_feeds(monkeypatch, engine.target)
    batch = BatchEngine(engine, max_batch=3, kv_capacity=128, prefix_cache=True)
    try:
        batch.generate(prompt, config)
        fed.clear()
        batch.generate(longer, config)
        assert fed[:2] == [PREFILL_CHUNK, len(longer) - PREFILL_CHUNK]  # an empty slot: all of it prefilled again
        fed.clear()
        batch.generate(prompt, config)
        assert fed[0] == 2  # the first conversation's cache was left whole
    finally:
        batch.shutdown()


def test_a_prompt_copies_the_prefix_a_running_request_holds_instead_of_prefilling_it(engine, monkeypatch):
    """A document (or system prompt) several requests start with is prefilled once: a request admitted while
    another holds it in its running context copies those positions into its own slot (target and draft), and
    its text is still its target-only one."""
    from specdec.runtime import batch_admission as batch_module

    document = engine.prompt_ids("one, two, three, one, two, three, one, two, three, four, five, six, seven")
    question = document + engine.prompt_ids(" and then?")
    config = GenerationConfig(max_new_tokens=12, drafter="model", num_draft_tokens=2)
    reference = engine.generate(question, GenerationConfig(max_new_tokens=12, drafter="none")).token_ids
    held = []  # per prefill: (prompt tokens, positions its target slot already held, its draft slot held)
    prefill = batch_module.prefill

    def recorded(session, cache, state):
        held.append((len(state.request.prompt_ids), cache.length, state.drafter.cache.length))
        return prefill(session, cache, state)

    monkeypatch.setattr(batch_module, "prefill", recorded)
    for keep in (False, True):
        batch = BatchEngine(engine, max_batch=2, kv_capacity=128, prefix_cache=keep)
        held.clear()
        try:
            holder = batch.stream(document, GenerationConfig(max_new_tokens=60, drafter="model", num_draft_tokens=2))
            pieces = iter(holder)
            next(pieces)  # running, its context starting with the document
            assert batch.generate(question, config).token_ids == reference
            holder.cancel()
            list(pieces)
        finally:
            batch.shutdown()
        shared = len(document) if keep else 0
        assert held == [(len(document), 0, 0), (len(question), shared, shared)], (keep, held)
        assert batch.arena.prefix_copies == keep and batch.prefix_tokens_reused == shared


def test_under_load_the_plan_weighs_the_drafts_prompt_lookup_found_not_the_k_it_asked_for(engine, monkeypatch):
    """Prompt lookup is asked first (it costs nothing): the plan weighs the drafts it found (here never more
    than 2 of the K = 4 asked for; a request whose lookup finds none is no candidate), and the verified drafts
    are a prefix of them."""
    from specdec.runtime import batch_step as batch_module
    from specdec.runtime.drafters import NgramDrafter, Proposal

    weighed, verified = [], []
    choose = batch_module.choose_draft_lengths_ragged
    monkeypatch.setattr(batch_module, "choose_draft_lengths_ragged", lambda candidates, *args, **kwargs: (
        weighed.extend(c.k for c in candidates), choose(candidates, *args, **kwargs))[1])
    monkeypatch.setattr("specdec.runtime.batch_step.DRAFT_MARGIN", 1e-6)  # the plan takes every draft it is offered
    propose = NgramDrafter.propose
    monkeypatch.setattr(NgramDrafter, "propose", lambda self, context, k: Proposal(propose(self, context, k).tokens[:2],
                                                                                  None))
    prompts = ["a b c d a b c d a b c d a b", "one, two, three, one, two, three, one, two,"] * 4
    reference = [engine.generate(p, GenerationConfig(max_new_tokens=16, drafter="none")).token_ids for p in prompts]
    configs = [GenerationConfig(max_new_tokens=16, drafter="ngram", num_draft_tokens=4, ngram_min=1)] * 8
    batch = BatchEngine(engine, max_batch=8, kv_capacity=128)
    batch._ragged_step = (lambda original: lambda running, *rest: (
        verified.extend(len(r.row.proposal.tokens) for r in running), original(running, *rest))[1])(
        batch._ragged_step)
    try:
        results = _burst(batch, prompts, configs)
    finally:
        batch.shutdown()
    assert [r.token_ids for r in results] == reference
    assert weighed and all(1 <= k <= 2 for k in weighed), weighed
    assert max(verified) <= 2 and sum(verified) == sum(r.stats.drafted for r in results) > 0


def test_a_shadow_draft_settles_at_the_first_token_it_missed_or_when_all_matched():
    shadow = ShadowDraft((5, 6, 7))
    assert not shadow.follow([5]) and shadow.matched == 1
    assert shadow.follow([6, 9, 7]) and shadow.matched == 2  # settled at 9: the 7 after it is not a match
    assert not shadow.follow([7]) and shadow.matched == 2
    whole = ShadowDraft((5, 6))
    assert whole.follow([5, 6, 1]) and whole.matched == 2
    record = DraftRecord()
    record.observe(len(shadow.tokens), shadow.matched)
    assert record.tested[:4] == [1, 1, 1, 0] and record.passed[:4] == [1, 1, 0, 0]


@pytest.mark.parametrize("lookup", ["right", "wrong"])
def test_lookup_drafts_the_plan_leaves_unverified_still_teach_each_requests_record(engine, monkeypatch, lookup):
    """The plan verifies no draft here, yet each request's record learns how its lookup would have fared, from
    the tokens the target then commits: always right for a lookup that proposes the target's own continuation,
    never for one that proposes another token. Texts stay target-only."""
    from specdec.runtime.drafters import NgramDrafter, Proposal

    prompts = PROMPT_SET[:4]
    config = GenerationConfig(max_new_tokens=12, drafter="none")
    answers = [engine.prompt_ids(p) + engine.generate(p, config).token_ids for p in prompts]

    def propose(self, context, k):
        answer = next(a for a in answers if a[:len(context)] == context)
        tokens = answer[len(context):len(context) + k]
        return Proposal(tokens if lookup == "right" else [(t + 1) % engine.vocab_size for t in tokens], None)

    monkeypatch.setattr(NgramDrafter, "propose", propose)
    monkeypatch.setattr(BatchEngine, "_draft_lengths", lambda self, running, prompt_tokens=0: [0] * len(running))
    observed = []
    observe = DraftRecord.observe
    monkeypatch.setattr(DraftRecord, "observe", lambda self, drafted, accepted: (
        observed.append((drafted, accepted)), observe(self, drafted, accepted))[1])
    batch = BatchEngine(engine, max_batch=4, kv_capacity=128)
    try:
        results = _burst(batch, prompts, [GenerationConfig(max_new_tokens=12, drafter="ngram")] * 4)
    finally:
        batch.shutdown()
    assert [r.token_ids for r in results] == [a[len(engine.prompt_ids(p)):] for a, p in zip(answers, prompts)]
    assert sum(r.stats.drafted for r in results) == 0
    assert len(observed) > 8
    assert all(accepted == (drafted if lookup == "right" else 0) for drafted, accepted in observed), observed


def test_an_error_in_a_step_ends_that_steps_requests_and_the_scheduler_serves_on(engine, monkeypatch):
    """A drafter that raises while a step is planned and drafted ends the requests of that step with the error
    (none waits forever), and the next requests are served."""
    from specdec.runtime.drafters import NgramDrafter

    def broken(self, context, k):
        raise RuntimeError("drafter broke")

    batch = BatchEngine(engine, max_batch=8, kv_capacity=128)
    try:
        with monkeypatch.context() as patch:
            patch.setattr(NgramDrafter, "propose", broken)
            streams = [batch.stream(p, GenerationConfig(max_new_tokens=8, drafter="ngram", num_draft_tokens=2))
                       for p in PROMPT_SET[:2]]
            for stream in streams:
                with pytest.raises(RuntimeError, match="drafter broke"):
                    list(stream)
        assert batch.alive
        assert batch.generate(PROMPT_SET[2], GenerationConfig(max_new_tokens=4, drafter="ngram")).token_ids
    finally:
        batch.shutdown()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the scheduler re-raises it
def test_a_scheduler_error_while_a_request_takes_its_slot_reaches_that_request(engine, monkeypatch):
    """An error outside every step's guard (here: taking a KV slot) stops the scheduler, and the request it had
    dequeued hears of it like the waiting ones, instead of waiting forever."""
    batch = BatchEngine(engine, max_batch=8, kv_capacity=128)

    def broken(*args, **kwargs):
        raise RuntimeError("slot table broke")

    monkeypatch.setattr(batch.arena, "take", broken)
    errors = []

    def consume():
        try:
            list(batch.stream(PROMPT_SET[0], GenerationConfig(max_new_tokens=4)))
        except GenerationError as err:
            errors.append(str(err))

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    consumer.join(timeout=30)
    assert not consumer.is_alive(), "the request waits forever on a scheduler that died"
    assert errors and "the batch scheduler stopped: RuntimeError: slot table broke" in errors[0]
    batch._thread.join(timeout=10)
    assert not batch.alive
    with pytest.raises(GenerationError, match="shut down"):
        batch.stream(PROMPT_SET[1], GenerationConfig(max_new_tokens=4))


def _burst(batch, prompts, configs):
    """Return the results of streams submitted while the scheduler is held off: one admission takes them all."""
    with batch._wake:  # re-entrant: stream() takes it too
        streams = [batch.stream(p, c) for p, c in zip(prompts, configs)]
    return _consumed(streams)


@pytest.mark.parametrize("max_batch", [8, 4])
def test_a_burst_of_arrivals_is_prefilled_in_one_ragged_call_and_each_text_is_its_own(engine, max_batch):
    prompts = PROMPT_SET[:max_batch]
    reference = [engine.generate(p, GenerationConfig(max_new_tokens=12, drafter="none")).token_ids for p in prompts]
    configs = [GenerationConfig(max_new_tokens=12, drafter="ngram" if i % 2 else "none") for i in range(max_batch)]
    results, batch = _results_in_batch(engine, prompts, configs, run=_burst, max_batch=max_batch, kv_capacity=128)
    assert [r.token_ids for r in results] == reference
    # the artifact's ragged graph has 8 rows: 4 slots prefill one request at a time
    assert batch.ragged_prefills == (max_batch == engine.target.spec.ragged_rows)


def test_requests_admitted_while_others_run_are_prefilled_in_their_step_and_each_text_is_its_own(engine,
                                                                                                  monkeypatch):
    """Requests arriving while others decode take no call of their own: their prompts ride the running
    requests' next step (a ragged-rows call), and greedy, speculating and seeded sampled texts on both sides
    equal each prompt's own. A prompt longer than LONG_CALL_ROWS rides too (in aligned chunks)."""
    from specdec.runtime.session import LONG_CALL_ROWS

    running = [GenerationConfig(max_new_tokens=40, drafter="none"),
               GenerationConfig(max_new_tokens=40, drafter="ngram", num_draft_tokens="auto", ngram_min=1),
               GenerationConfig(max_new_tokens=40, seed=3, temperature=1.2, top_k=8, drafter="none")] * 2
    arriving = [GenerationConfig(max_new_tokens=12, drafter="none"),
                GenerationConfig(max_new_tokens=12, seed=5, temperature=1.2, top_k=8, drafter="model",
                                 num_draft_tokens=2),
                GenerationConfig(max_new_tokens=12, drafter="ngram", num_draft_tokens="auto", ngram_min=1)]
    long_prompt = engine.prompt_ids(" ".join(PROMPT_SET * 8))[:LONG_CALL_ROWS + 9]
    first, later = PROMPT_SET[:len(running)], PROMPT_SET[len(running):len(running) + 2] + [long_prompt]
    alone = [engine.generate(p, c).token_ids for p, c in zip(first + later, running + arriving)]
    batch = BatchEngine(engine, max_batch=8, kv_capacity=128)
    try:
        streams = [batch.stream(p, c) for p, c in zip(first, running)]
        pieces = [iter(s) for s in streams]
        for piece in pieces:
            next(piece)  # every first request has started
        prefills = batch.ragged_prefills
        fed = _record_feeds(monkeypatch, engine.target)  # a separate prefill would be a forward call
        results = _consumed(streams + [batch.stream(p, c) for p, c in zip(later, arriving)])
    finally:
        batch.shutdown()
    assert [r.token_ids for r in results] == alone
    assert batch.prefills_in_steps == 3 and batch.ragged_prefills == prefills
    assert [n for n in fed if n > LONG_CALL_ROWS] == []  # the long one: no prefill of its own


def test_in_a_burst_a_prompt_that_starts_like_another_waits_to_copy_its_prefix(engine):
    document = engine.prompt_ids("one, two, three, one, two, three, one, two, three, four, five, six, seven")
    prompts = [document + engine.prompt_ids(" and then?"), engine.prompt_ids("zz top"),
               document + engine.prompt_ids(" or else?")]
    config = GenerationConfig(max_new_tokens=12, drafter="none")
    reference = [engine.generate(p, config).token_ids for p in prompts]
    batch = BatchEngine(engine, max_batch=8, kv_capacity=128, prefix_cache=True)
    try:
        results = _burst(batch, prompts, [config] * 3)
    finally:
        batch.shutdown()
    assert [r.token_ids for r in results] == reference
    assert batch.ragged_prefills == 1 and batch.arena.prefix_copies == 1  # the first two together, the third copies
    assert batch.prefix_tokens_reused >= len(document)


def test_in_a_burst_prompts_whose_shared_head_a_slot_holds_are_prefilled_together(engine):
    """A head every prompt starts with (a chat template's system prompt) that a slot holds already is copied at
    once: the burst still shares one prefill call instead of each prompt waiting for the one before it."""
    head = engine.prompt_ids("one, two, three, one, two, three, one, two, three, four, five, six, seven")
    prompts = [head + engine.prompt_ids(tail) for tail in (" and then?", " or else?", " zz top")]
    config = GenerationConfig(max_new_tokens=12, drafter="none")
    reference = [engine.generate(p, config).token_ids for p in prompts]
    batch = BatchEngine(engine, max_batch=8, kv_capacity=128, prefix_cache=True)
    try:
        batch.generate(head + engine.prompt_ids(" first"), config)  # its slot keeps the head when it ends
        results = _burst(batch, prompts, [config] * 3)
    finally:
        batch.shutdown()
    assert [r.token_ids for r in results] == reference
    assert batch.ragged_prefills == 1  # all three in one call
    assert batch.arena.prefix_copies == 2 and batch.prefix_tokens_reused >= 3 * len(head)


def test_a_free_slots_row_takes_no_token_and_attends_over_nothing_unless_it_keeps_a_prefix(engine, monkeypatch):
    """A ragged call's rows for free slots feed no token (no MatMul row); without the prefix cache their
    attention's throwaway row goes to position 0 (over nothing), with it past the prefix the slot keeps."""
    calls = []
    forward_ragged = engine.target.forward_ragged
    monkeypatch.setattr(engine.target, "forward_ragged", lambda call, caches, rows, lengths, *rest, **options: (
        calls.append((caches, rows, lengths)), forward_ragged(call, caches, rows, lengths, *rest, **options))[1])
    prompt = PROMPT_SET[0]
    reference = engine.generate(prompt, GenerationConfig(max_new_tokens=12, drafter="none")).token_ids
    for keep in (False, True):
        batch = BatchEngine(engine, max_batch=8, kv_capacity=128, prefix_cache=keep)
        try:
            batch.generate(PROMPT_SET[1], GenerationConfig(max_new_tokens=6, drafter="none"))  # leaves slot 0
            calls.clear()
            configs = [GenerationConfig(max_new_tokens=12, drafter="ngram", num_draft_tokens=2, ngram_min=1)] * 2
            results = _concurrently(batch, [prompt, prompt], configs)
        finally:
            batch.shutdown()
        assert [r.token_ids for r in results] == [reference] * 2
        assert calls, "no ragged call"
        kept = len(batch.arena._caches[0].kept_ids)  # the first request's tokens, kept only for the prefix cache
        assert (kept > 0) == keep
        for caches, rows, lengths in calls:
            free = [s for s, c in enumerate(caches) if c is None]
            assert len(free) == 6 and all(rows[s] == [] for s in free)
            # with the prefix cache the two requests took empty slots 1 and 2, slot 0 keeping its prefix
            assert [lengths[s] for s in free] == ([kept] if keep else []) + [0] * (6 - keep), (keep, lengths)


_SHARED_POOL_SCRIPT = """
import sys, threading
from specdec.runtime.batch import BatchEngine
from specdec.runtime.engine import Engine, GenerationConfig
from specdec.runtime.guess_rows import GUESS
engine = Engine.load(sys.argv[1], provider="cpu", threads=1, shared_threads=True)
assert engine.shared_pool
prompts = sys.argv[2:]
kinds = [dict(drafter="none"), dict(drafter="ngram", num_draft_tokens=2, ngram_min=1), dict(drafter="model",
         num_draft_tokens=3)]
configs = [GenerationConfig(max_new_tokens=24, **kinds[i % 3]) for i in range(len(prompts))]
reference = [engine.generate(p, GenerationConfig(max_new_tokens=24, drafter="none")).token_ids for p in prompts]
batched_rows = []
batch = BatchEngine(engine, max_batch=8, kv_capacity=128)
batch._batched_step = (lambda original: lambda plain, *rest: (
    batched_rows.append(len(plain)), original(plain, *rest)))(batch._batched_step)
results = [None] * len(prompts)
threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, batch.generate(prompts[i], configs[i])))
           for i in range(len(prompts))]
for t in threads: t.start()
for t in threads: t.join()
batch.shutdown()
print([r.token_ids for r in results] == reference, batch.ragged_calls > 0, max(batched_rows) >= 2)
"""


def test_on_one_thread_pool_plain_steps_take_the_batched_call_and_drafts_the_ragged_one(tiny_close_artifacts):
    """As `specdec serve` runs it (one shared pool, a fresh process): steps without drafts are batched decode
    calls, steps with drafts ragged-rows calls, and every greedy text is still the target-only one."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _SHARED_POOL_SCRIPT, str(tiny_close_artifacts["llama"]),
                          *PROMPT_SET[:8]], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-3:] == ["True", "True", "True"], out.stdout


def test_with_the_prefix_cache_a_waiting_prompt_that_matches_the_freed_slot_goes_first(engine, monkeypatch):
    """One slot holding prompt A's context; B (another prompt) and then A again wait: A goes first and
    prefills one token. Without the prefix cache the queue stays first come, first served."""
    a = engine.prompt_ids("one, two, three, one, two, three, one, two, three, four, five, six")
    b = engine.prompt_ids("Paris is the capital of France, and Berlin is the capital of Germany.")
    config = GenerationConfig(max_new_tokens=6, drafter="none")
    for keep in (True, False):
        fed = _record_feeds(monkeypatch, engine.target)
        batch = BatchEngine(engine, max_batch=1, kv_capacity=128, prefix_cache=keep)
        try:
            batch.generate(a, config)  # the slot now keeps A's context
            fed.clear()
            with batch._wake:  # the scheduler waits until both are queued
                streams = [batch.stream(b, config), batch.stream(a, config)]
            results = _consumed(streams)
        finally:
            monkeypatch.undo()
            batch.shutdown()
        assert all(results)
        # fed: the prefills, in admission order. With the cache: A (two tokens: its slot kept it) before B
        assert fed[0] == (2 if keep else len(b)), (keep, fed)



def _taken_slots(batch) -> list[int]:
    """Return a list that gets the slot of every request the target arena admits from now on."""
    slots, take = [], batch.arena.take

    def recorded(*args, **kwargs):
        cache = take(*args, **kwargs)
        slots.append(cache.slot)
        return cache

    batch.arena.take = recorded
    return slots


def test_more_slots_than_ragged_rows_take_the_high_slots_only_under_more_load(engine):
    """16 slots, an 8-row ragged graph: 8 requests stay in slots 0-7, where their drafts share ragged calls (and a
    burst of them one ragged prefill); 16 at once spread over all 16 slots, which batched decode calls serve; after
    them, a small load is back in slots 0-7, though the prefix cache would pick the slot given back longest ago.
    Every text is its prompt's target-only text."""
    rows = engine.target.spec.ragged_rows
    prompts = (PROMPT_SET * 2)[:2 * rows]
    reference = [engine.generate(p, GenerationConfig(max_new_tokens=16, drafter="none")).token_ids for p in prompts]
    configs = [GenerationConfig(max_new_tokens=16, drafter="ngram" if i % 2 else "none", ngram_min=1)
               for i in range(2 * rows)]
    batch = BatchEngine(engine, max_batch=2 * rows, kv_capacity=128, prefix_cache=True)  # slots chosen by prefix
    slots = _taken_slots(batch)
    try:
        assert batch.arena.ragged and batch.arena.ragged_span == rows
        few = _burst(batch, prompts[:rows], configs[:rows])
        assert sorted(slots) == list(range(rows)) and batch.ragged_prefills == 1 and batch.ragged_calls > 0
        many = _burst(batch, prompts, configs)
        assert max(slots[rows:]) >= rows  # the high slots took part of this load
        del slots[:]
        again = _concurrently(batch, prompts[:3], configs[:3])
        assert max(slots) < rows
    finally:
        batch.shutdown()
    assert [r.token_ids for r in few] == reference[:rows]
    assert [r.token_ids for r in many] == reference
    assert [r.token_ids for r in again] == reference[:3]


def test_a_slot_window_keeps_new_requests_below_it_whatever_the_prefix_cache_prefers(engine):
    from specdec.runtime.slots import SlotArena

    arena = SlotArena(engine.target, 16, 64, keep_prefixes=True)
    caches = [arena.take() for _ in range(16)]
    for slot in (12, 3):  # slot 12 given back first: the prefix cache's eviction choice, without a window
        caches[slot].token_ids = [1, 2, 3]
        arena.give(caches[slot])
    assert arena.free_below(8) == 1 and arena.free_below(16) == 2
    assert arena.take([7, 8, 9], window=3) is None
    assert arena.take([7, 8, 9], window=8).slot == 3
    assert arena.take([7, 8, 9]).slot == 12


def test_prompts_sharing_a_system_prompt_take_the_lowest_slot_that_holds_about_as_much(engine):
    """Slots 2 and 5 keep prompts that share a 30-token system prompt with the new one, slot 5 two tokens more: the
    lowest (2) takes it, so a light load's batched calls stay narrow; a prompt that shares 20 more with slot 5's
    still lands there."""
    from specdec.runtime.slots import SlotArena

    system = list(range(100, 130))
    kept = {2: system + [7, 8, 9, 10], 5: system + [40, 41] + list(range(50, 68))}
    arena = SlotArena(engine.target, 8, 64, keep_prefixes=True)
    caches = [arena.take() for _ in range(8)]
    for slot in (5, 2):
        caches[slot].token_ids = list(kept[slot])
        caches[slot].exact = len(kept[slot])
        arena.give(caches[slot])
    first = arena.take(system + [40, 41, 60, 61, 62])
    assert first.slot == 2 and first.length > 16  # its 30 shared tokens are reused, not 32 in slot 5
    arena.give(first)
    assert arena.take(kept[5] + [70, 71]).slot == 5


def test_a_prompt_sharing_a_system_prompt_with_a_higher_slot_copies_it_into_a_lower_free_one(engine):
    """Slots 0 and 1 keep another cache_salt's prompts, slot 2 a prompt of the same salt and system prompt: the new
    prompt takes slot 0 with a copy of the system prompt's KV (slot 2 keeps its prompt), so a light load of two salts
    does not spread over the slots (target-only at 4 clients ran at half speed beside another salt's requests). A
    prompt that continues slot 2's own tokens stays there."""
    from specdec.runtime.slots import SlotArena

    rng = np.random.default_rng(2)
    system = list(range(100, 130))
    arena = SlotArena(engine.target, 3, 96, keep_prefixes=True)
    caches = [arena.take(salt=salt) for salt in ("b", "b", "a")]
    rows = {}
    for slot, ids in ((0, [7] + system[1:] + [40, 41]), (1, [8] + system[1:] + [42]), (2, system + [50, 51, 52])):
        rows[slot] = _filled(arena, caches[slot], ids, rng)
        arena.give(caches[slot])
    taken = arena.take(system + [60, 61, 62], salt="a")
    assert taken.slot == 0 and taken.length >= 16
    assert np.array_equal(arena.host_buffers[0][0, :, :taken.length], rows[2][:, :taken.length])
    assert arena._caches[2].kept_ids == tuple(system + [50, 51, 52]) and arena.prefix_copies == 1
    assert arena.take(system + [50, 51, 52, 53, 54], salt="a").slot == 2  # its own earlier turn: kept in place


def test_the_slot_window_follows_the_load_between_the_ragged_rows_and_all_slots(engine):
    rows = engine.target.spec.ragged_rows
    batch = BatchEngine(engine, max_batch=2 * rows, kv_capacity=64)
    try:
        plain = type("Request", (), {"hidden": False})  # a BatchRequest's hidden: whether a draft head reads rows
        head = type("Request", (), {"hidden": True})
        with batch._wake:
            for load, window in ((0, rows), (3, rows), (rows + 3, rows + 3), (3 * rows, 2 * rows)):
                batch._waiting.extend([plain] * load)
                assert batch._slot_window() == window, load
                batch._waiting.clear()
            batch._waiting.extend([plain] * (3 * rows) + [head])
            assert batch._slot_window() == rows  # a head's request needs the ragged rows every step
            batch._waiting.clear()
    finally:
        batch.shutdown()
    assert BatchEngine(engine, max_batch=rows, kv_capacity=64)._slot_window() == rows


def _filled(arena, cache, ids, rng):
    """Give `cache` the tokens `ids` with random KV in its positions (as a prefill would); return one buffer's
    rows of them."""
    cache.token_ids = list(ids)
    for buffer in arena.host_buffers:
        buffer[cache.slot, :, :len(ids)] = rng.standard_normal(buffer[cache.slot, :, :len(ids)].shape)
    return arena.host_buffers[0][cache.slot, :, :len(ids)].copy()


def test_a_prefix_evicted_below_the_window_is_stashed_above_it_and_copied_back(engine):
    """Under a light load new requests take slots below the window only; a cached prompt they overwrite there is
    first copied into a free slot above it (KV and tokens), from where a later prompt copies it back instead of
    prefilling it. A prefix another slot holds too is overwritten first and not stashed."""
    from specdec.runtime.slots import SlotArena

    rng = np.random.default_rng(0)
    a, b, c = ([base + i for i in range(30)] for base in (100, 200, 300))
    arena = SlotArena(engine.target, 4, 64, keep_prefixes=True)
    first = arena.take(a, window=2)
    rows_a = _filled(arena, first, a, rng)
    arena.give(first)
    second = arena.take(b, window=2)
    assert second.slot == 1  # an empty slot before the one that keeps a
    _filled(arena, second, b, rng)
    arena.give(second)
    third = arena.take(c, window=2)  # both slots below the window keep a prompt: a's, given back first, goes
    assert third.slot == 0 and arena.prefix_stashes == 1
    spare = next(s for s in (2, 3) if arena._caches[s].kept_ids)
    assert arena._caches[spare].kept_ids == tuple(a)
    assert np.array_equal(arena.host_buffers[0][spare, :, :30], rows_a)
    _filled(arena, third, c, rng)
    arena.give(third)
    again = arena.take(a, window=2)
    assert again.slot == 1 and again.length == len(a) - 1  # copied back from above the window: no prefill
    assert np.array_equal(arena.host_buffers[0][1, :, :29], rows_a[:, :29])
    assert arena.prefix_stashes == 2  # b, overwritten by it, went above the window in turn

    # Two slots keeping the same prompt: one of them is overwritten before a prompt no other slot keeps.
    arena = SlotArena(engine.target, 3, 64, keep_prefixes=True)
    caches = [arena.take() for _ in range(3)]
    for cache, ids in zip(caches, (b, a, a)):  # b given back first (the oldest), then a twice
        _filled(arena, cache, ids, rng)
        arena.give(cache)
    assert arena.take(c).slot == 1 and arena._caches[0].kept_ids == tuple(b)


def test_a_light_load_cycling_through_more_prompts_than_slots_below_the_window_reuses_stashed_prefixes(engine):
    from specdec.runtime.slots import MIN_PREFIX

    rows = engine.target.spec.ragged_rows
    prompts = [engine.prompt_ids(f"{p} " * 5) for p in PROMPT_SET[: rows + 4]]  # more prompts than the window
    reference = [engine.generate(p, GenerationConfig(max_new_tokens=6, drafter="none")).token_ids for p in prompts]
    config = GenerationConfig(max_new_tokens=6, drafter="none")
    batch = BatchEngine(engine, max_batch=2 * rows, kv_capacity=256, prefix_cache=True)
    try:
        first = [batch.generate(p, config).token_ids for p in prompts]  # one at a time: the window stays at R
        reused = batch.prefix_tokens_reused
        second = [batch.generate(p, config).token_ids for p in prompts]
    finally:
        batch.shutdown()
    assert first == reference and second == reference
    # every prompt of the second pass found its prefix (all of it but the last two tokens, which the prefill
    # feeds): in its slot, or copied back from above the window; a prompt shorter than MIN_PREFIX is prefilled anyway
    assert batch.prefix_tokens_reused - reused == sum(len(p) - 2 for p in prompts if len(p) > MIN_PREFIX)
    assert batch.arena.prefix_stashes > 0


def test_a_stash_never_overwrites_the_slot_the_new_prompt_copies_its_prefix_from(engine):
    """The free slot a prompt's prefix is copied from (above the window) is no stash spare for the slot it takes:
    stashing there first made the prompt copy another prompt's KV as its own prefix (wrong answers under load,
    found by a serving run of 48 distinct prompts at 8 clients)."""
    from specdec.runtime.slots import SlotArena

    rng = np.random.default_rng(1)
    a, b, c, d = ([base + i for i in range(30)] for base in (100, 200, 300, 400))
    arena = SlotArena(engine.target, 4, 64, keep_prefixes=True)
    caches = [arena.take() for _ in range(4)]
    rows = {}
    for slot, ids in ((3, b), (1, c), (2, d), (0, a)):  # given back in this order: b's slot is the oldest spare
        rows[slot] = _filled(arena, caches[slot], ids, rng)
        arena.give(caches[slot])
    taken = arena.take(b + [7, 8], window=1)  # slot 0, the only one below the window, keeps a: stashed first
    assert taken.slot == 0 and arena.prefix_stashes == 1
    assert taken.length >= 16 and np.array_equal(arena.host_buffers[0][0, :, :taken.length],
                                                 rows[3][:, :taken.length])  # b's own KV, copied from slot 3
    assert arena._caches[3].kept_ids == tuple(b)  # and slot 3 still keeps b
