"""Logit bias, repetition penalty and min-p: the same as transformers' processors, and speculation stays exact."""

from __future__ import annotations

import numpy as np
import pytest

from specdec.models.errors import GenerationError
from specdec.runtime.engine import Engine, GenerationConfig
from specdec.runtime.sampling import SamplingConfig, process_logits, seen_before_rows

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _transformers_probs(logits_row: np.ndarray, seen: list[int], config: SamplingConfig) -> np.ndarray:
    """Probabilities from transformers' own processors, in the order process_logits documents."""
    from transformers.generation import logits_process as lp

    processors = []
    if config.logit_bias:
        processors.append(lp.SequenceBiasLogitsProcessor({(token,): bias for token, bias in config.logit_bias}))
    if config.repetition_penalty != 1.0:
        processors.append(lp.RepetitionPenaltyLogitsProcessor(config.repetition_penalty))
    processors.append(lp.TemperatureLogitsWarper(config.temperature))
    if config.top_k:
        processors.append(lp.TopKLogitsWarper(config.top_k))
    if config.top_p < 1.0:
        processors.append(lp.TopPLogitsWarper(config.top_p))
    if config.min_p:
        processors.append(lp.MinPLogitsWarper(config.min_p))
    scores = torch.tensor(logits_row[None, :], dtype=torch.float64)
    input_ids = torch.tensor([seen], dtype=torch.long)
    for processor in processors:
        scores = processor(input_ids, scores)
    return torch.softmax(scores, dim=-1)[0].numpy()


@pytest.mark.parametrize("settings", [
    dict(temperature=0.9, repetition_penalty=1.4),
    dict(temperature=1.1, min_p=0.08),
    dict(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.2, logit_bias=((3, 5.0), (7, -100.0))),
])
def test_processing_equals_transformers(settings):
    rng = np.random.default_rng(0)
    config = SamplingConfig(**settings)
    config.validate()
    logits = rng.normal(0, 3, size=(4, 60)).astype(np.float32)
    context, drafts = [1, 5, 9, 9, 3], [12, 5, 40]
    seen = seen_before_rows(context, drafts, 4)
    ours = process_logits(logits, config, seen)
    for row in range(4):
        np.testing.assert_allclose(ours[row], _transformers_probs(logits[row], seen[row], config), atol=1e-9)


def test_the_penalty_sees_each_rows_own_drafts():
    """Row r of a verify call follows drafts[:r]: a token drafted before it is penalised there, not before."""
    config = SamplingConfig(temperature=1.0, repetition_penalty=2.0)
    logits = np.full((3, 8), 1.0, dtype=np.float32)
    probs = process_logits(logits, config, seen_before_rows([0], [5, 6], 3))
    assert probs[0, 5] == probs[0, 4] and probs[1, 5] < probs[1, 4] and probs[2, 6] < probs[2, 4]


def _openai_penalties(logits_row: np.ndarray, output: list[int], presence: float, frequency: float) -> np.ndarray:
    """OpenAI's formula as its docs write it: mu[j] - c[j] * frequency - (c[j] > 0) * presence, c over the output."""
    out = logits_row.astype(np.float64).copy()
    for token in set(output):
        out[token] -= output.count(token) * frequency + presence
    return out


def test_presence_and_frequency_penalties_equal_openais_formula_over_the_output_only():
    rng = np.random.default_rng(1)
    prompt, drafts = [4, 4, 9, 2], [7, 9, 7]
    config = SamplingConfig(temperature=0.8, presence_penalty=0.6, frequency_penalty=-0.4, output_start=len(prompt))
    config.validate()
    context = prompt + [9, 3, 3]  # the output so far: 9 3 3
    logits = rng.normal(0, 2, size=(4, 12)).astype(np.float32)
    seen = seen_before_rows(context, drafts, 4)
    ours = process_logits(logits, config, seen)
    for row in range(4):
        output = seen[row][len(prompt):]  # the prompt's 4 4 2 are not counted
        reference = _openai_penalties(logits[row], output, 0.6, -0.4) / 0.8
        expected = np.exp(reference - reference.max())
        np.testing.assert_allclose(ours[row], expected / expected.sum(), atol=1e-12)


def test_bad_settings_are_refused():
    for settings, message in [(dict(min_p=1.5), "min_p"), (dict(repetition_penalty=0.0), "repetition_penalty"),
                              (dict(logit_bias=((3, 101.0),)), "logit_bias"), (dict(logit_bias=((-1, 1.0),)), "logit_bias"),
                              (dict(presence_penalty=2.5), "presence_penalty"),
                              (dict(frequency_penalty=float("nan")), "frequency_penalty")]:
        with pytest.raises(GenerationError, match=message):
            SamplingConfig(temperature=1.0, **settings).validate()


@pytest.fixture(scope="module")
def engine(tiny_artifacts):
    return Engine.load(tiny_artifacts["llama"], provider="cpu", threads=1)


def _torch_greedy(source, ids: list[int], new_tokens: int, **processing) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(source)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                             eos_token_id=None, **processing)
    return out[0, len(ids):].tolist()


def test_greedy_with_a_repetition_penalty_equals_transformers_generate(engine, tiny_sources):
    engine.eos_token_ids, saved = set(), engine.eos_token_ids
    try:
        ids = engine.prompt_ids("one two three one two three one two")
        plain = engine.generate(ids, GenerationConfig(max_new_tokens=32, drafter="none", repetition_penalty=1.5))
        assert plain.token_ids == _torch_greedy(tiny_sources["llama"][0], ids, 32, repetition_penalty=1.5)
        assert plain.token_ids != engine.generate(ids, GenerationConfig(max_new_tokens=32, drafter="none")).token_ids
    finally:
        engine.eos_token_ids = saved


@pytest.mark.parametrize("drafter, penalties", [
    ("model", dict(repetition_penalty=1.3)), ("ngram", dict(repetition_penalty=1.3)),
    ("model", dict(presence_penalty=0.8, frequency_penalty=0.5)), ("ngram", dict(presence_penalty=0.4))])
def test_speculative_greedy_with_penalty_and_bias_equals_target_only(engine, drafter, penalties):
    ids = engine.prompt_ids("one two three one two three one two")
    if drafter == "ngram":  # a context that repeats the target's own text gives prompt lookup matches
        ids = (ids + engine.generate(ids, GenerationConfig(max_new_tokens=24, drafter="none")).token_ids) * 3
    settings = dict(max_new_tokens=40, logit_bias=((11, 2.0), (12, -3.0)), **penalties)
    plain = engine.generate(ids, GenerationConfig(drafter="none", **settings))
    speculative = engine.generate(ids, GenerationConfig(drafter=drafter, num_draft_tokens=3, ngram_min=1, **settings))
    assert speculative.token_ids == plain.token_ids
    assert speculative.stats.drafted > 0


def test_stop_token_ids_end_the_answer_and_a_forced_token_is_chosen(engine):
    ids = engine.prompt_ids("Hello world")
    forced = engine.generate(ids, GenerationConfig(max_new_tokens=6, drafter="none", logit_bias=((17, 100.0),)))
    assert forced.token_ids == [17] * 6
    stopped = engine.generate(ids, GenerationConfig(max_new_tokens=6, drafter="none", logit_bias=((17, 100.0),),
                                                    stop_token_ids=(17,)))
    assert stopped.token_ids == [17] and stopped.finish_reason == "eos"
    with pytest.raises(GenerationError, match="vocabulary"):
        engine.generate(ids, GenerationConfig(stop_token_ids=(10 ** 6,)))
