"""Predicted outputs: the cursor follows the answer through edits; the output is the target's whatever is predicted."""

from __future__ import annotations

import pytest

from specdec.runtime.drafters import NgramDrafter
from specdec.runtime.engine import Engine, GenerationConfig
from specdec.runtime.ngram import SEEN_ONCE
from specdec.runtime.prediction import PREDICTION, PREDICTION_1_TOKEN, PredictionDrafter, PredictionIndex


def test_realign_prefers_the_longest_suffix_then_the_first_place_after_the_cursor():
    index = PredictionIndex([1, 2, 3, 4, 1, 2, 5, 6])
    assert index.realign([9, 1, 2], last=0) == 2  # "1 2" ends at 2 and 6: the first at or after 0
    assert index.realign([9, 1, 2], last=3) == 6
    assert index.realign([2, 5], last=0) == 7
    assert index.realign([7, 8], last=0) is None
    long = PredictionIndex(list(range(100)))
    assert long.realign([200, 60], last=0) is None  # a 1-token match far from the cursor does not count
    assert long.realign([200, 60], last=30) == 61


def _drafter(prediction, prompt):
    drafter = PredictionDrafter(prediction, NgramDrafter(2, 4))
    drafter.begin(prompt)
    return drafter


def test_the_drafter_copies_from_its_cursor_and_realigns_after_an_insertion_and_a_deletion():
    prompt = [100, 101]
    prediction = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    drafter = _drafter(prediction, prompt)
    context = prompt + [10]
    assert drafter.situation(context) == PREDICTION
    assert drafter.propose(context, 3).tokens == [11, 12, 13]
    context += [11, 12, 50, 51]  # an insertion after 12: lost
    drafter.accept(context)
    assert drafter.propose(context, 2).tokens == []  # nothing to copy (and no 2-token match in the context)
    context += [13, 14]  # back on the prediction: "13 14" realigns the cursor
    drafter.accept(context)
    assert drafter.propose(context, 3).tokens == [15, 16, 17]
    context += [15, 18]  # 16 and 17 deleted: the 1-token match "18" is near the cursor
    drafter.accept(context)
    assert drafter.propose(context, 3).tokens == [19]


def test_prompt_lookup_wins_over_a_cursor_placed_by_one_token_when_it_matches_longer():
    prompt = [100, 101]
    prediction = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    drafter = _drafter(prediction, prompt)
    context = prompt + [10, 11, 50, 13]  # "13" alone places the cursor (1-token realignment)
    assert drafter.situation(context) == PREDICTION_1_TOKEN
    assert drafter.propose(context, 2).tokens == [14, 15]
    context += [50, 13]  # the answer loops: "50 13" recurs, a 2-token match in the context
    drafter.accept(context)
    assert drafter.situation(context) == SEEN_ONCE
    assert drafter.propose(context, 3).tokens == [50, 13, 50]
    context += [14, 15]  # back on the prediction: two agreeing tokens outrank a 1-token lookup match
    drafter.accept(context)
    assert drafter.situation(context) == PREDICTION
    assert drafter.propose(context, 2).tokens == [16, 17]


def test_prediction_tokens_count_every_prediction_situation_and_no_other():
    from specdec.runtime.stats import GenerationStats
    stats = GenerationStats(by_situation={
        PREDICTION: {"iterations": 3, "drafted": 20, "accepted": 15, "acceptance_tests": 16},
        PREDICTION_1_TOKEN: {"iterations": 2, "drafted": 4, "accepted": 1, "acceptance_tests": 2},
        SEEN_ONCE: {"iterations": 1, "drafted": 5, "accepted": 5, "acceptance_tests": 5},
        "predictionless": {"iterations": 1, "drafted": 3, "accepted": 0, "acceptance_tests": 1}})
    assert stats.prediction_tokens() == (16, 8)
    assert GenerationStats().prediction_tokens() == (0, 0)


@pytest.fixture(scope="module")
def engine(tiny_artifacts):
    return Engine.load(tiny_artifacts["llama"], provider="cpu", threads=1)


def test_greedy_output_is_the_same_with_any_prediction_and_counts_follow_openai(engine):
    ids = engine.prompt_ids("one two three")
    plain = engine.generate(ids, GenerationConfig(max_new_tokens=40, drafter="none"))
    answer = plain.token_ids
    right = tuple(answer)  # token ids: the tiny tokenizer's byte pieces do not survive a decode and encode
    edited = tuple(answer[:10] + [answer[10] + 1, answer[10] + 2] + answer[13:])
    for prediction in (right, edited, "something else entirely", engine.codec.decode(answer), ""):
        result = engine.generate(ids, GenerationConfig(max_new_tokens=40, prediction=prediction or None,
                                                       num_draft_tokens="auto"))
        assert result.token_ids == answer, prediction
    result = engine.generate(ids, GenerationConfig(max_new_tokens=40, prediction=right, num_draft_tokens=8))
    accepted, rejected = result.stats.prediction_tokens()
    assert accepted >= len(answer) * 3 // 4 and result.stats.target_calls <= len(answer) // 4
    assert (accepted, rejected) == (result.stats.by_situation[PREDICTION]["accepted"],
                                    result.stats.by_situation[PREDICTION]["drafted"] - accepted)
    edited_result = engine.generate(ids, GenerationConfig(max_new_tokens=40, prediction=edited, num_draft_tokens=8))
    assert edited_result.stats.prediction_tokens()[1] > 0  # the edited span's drafts were rejected...
    assert edited_result.stats.prediction_tokens()[0] > 20  # ...and drafting went on after it


def test_auto_caps_k_at_32_for_a_prediction_and_16_otherwise_unless_the_request_sets_a_cap(engine):
    ids = engine.prompt_ids("one two three")

    def cap(**fields):
        return engine.open_request(ids, GenerationConfig(num_draft_tokens="auto", **fields)).state.policy.max_k

    assert cap() == 16 and cap(prediction="one two") == 32
    assert cap(prediction="one two", max_draft_tokens_auto=8) == 8 and cap(max_draft_tokens_auto=20) == 20


def test_a_predictions_lookup_fallback_takes_the_phrase_table_as_plain_lookup_does(engine, monkeypatch):
    from specdec.runtime.phrases import PhraseTable, PhraseTableConfig
    table = PhraseTable.count([[10, 11, 12, 13]] * 2, PhraseTableConfig(max_n=2))
    monkeypatch.setattr(engine, "phrases", table)
    ids = engine.prompt_ids("one two three")

    def fallback_phrases(**fields):
        drafter = engine.open_request(ids, GenerationConfig(num_draft_tokens="auto", prediction="one", **fields))
        return drafter.state.drafter.fallback.phrases

    assert fallback_phrases() is table and fallback_phrases(phrases=False) is None


def test_seeded_sampling_with_a_prediction_reproduces(engine):
    ids = engine.prompt_ids("one two three")
    prediction = engine.codec.decode(engine.generate(ids, GenerationConfig(max_new_tokens=30, drafter="none")).token_ids)
    config = GenerationConfig(max_new_tokens=30, temperature=0.8, seed=5, prediction=prediction, num_draft_tokens=4)
    assert engine.generate(ids, config).token_ids == engine.generate(ids, config).token_ids


def test_greedy_text_with_predictions_under_8_clients_equals_each_prompts_own(tiny_close_artifacts):
    from specdec.runtime.batch import BatchEngine
    from tests.runtime.test_batch import PROMPT_SET, _results_in_batch

    engine = Engine.load(tiny_close_artifacts["llama"], provider="cpu", threads=1)
    prompts = PROMPT_SET[:8]
    reference = [engine.generate(p, GenerationConfig(max_new_tokens=32, drafter="none")).token_ids for p in prompts]
    # half exact, half with an edited span; K auto and fixed
    predictions = [tuple(ids) if i % 2 else tuple(ids[:8] + [ids[8] + 1] + ids[10:]) for i, ids in enumerate(reference)]
    configs = [GenerationConfig(max_new_tokens=32, prediction=predictions[i],
                                num_draft_tokens="auto" if i % 4 < 2 else 6) for i in range(8)]
    results, batch = _results_in_batch(engine, prompts, configs, max_batch=8, kv_capacity=128)
    assert [r.token_ids for r in results] == reference
    assert sum(r.stats.prediction_tokens()[0] for r in results) > 8 * 10  # most of each answer came as drafts
    assert all(r.stats.target_calls < len(r.token_ids) for r in results)
