"""Structured outputs under speculation: greedy text is the constrained target-only text with any drafter, alone
and under load; sampled text has the masked target distribution, with drafts that are accepted; forced tokens
ride as drafts; a bad grammar is refused before anything runs."""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest

from specdec.models.errors import GenerationError
from specdec.runtime.batch import BatchEngine
from specdec.runtime.engine import Engine, GenerationConfig
from specdec.runtime.grammar import GrammarSpec
from specdec.runtime.loop import FORCED
from specdec.runtime.sampling import SamplingConfig

from tests.runtime.test_batch import PROMPT_SET, _results_in_batch
from tests.runtime.test_exactness import _assert_fits, _sampled_joint, _target_joint

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "city": {"enum": ["Paris", "Oslo", "Lima"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}
SCHEMA = GrammarSpec.of("json_schema", PERSON)
DRAFTERS = [dict(drafter="ngram", num_draft_tokens=4, ngram_min=1), dict(drafter="model", num_draft_tokens=3),
            dict(drafter="ngram+model", num_draft_tokens="auto")]


@pytest.fixture(scope="module")
def engine(tiny_close_artifacts, tiny_target_only_artifact):
    return Engine.load(tiny_close_artifacts["llama"], provider="cpu", threads=1)


def _valid(text: str) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, PERSON)
    return value


@pytest.mark.parametrize("prompt", PROMPT_SET[:4])
def test_greedy_constrained_text_is_the_same_with_every_drafter_and_validates(engine, prompt):
    plain = engine.generate(prompt, GenerationConfig(max_new_tokens=60, drafter="none", grammar=SCHEMA))
    _valid(plain.text)
    assert plain.finish_reason == "eos"
    for settings in DRAFTERS:
        result = engine.generate(prompt, GenerationConfig(max_new_tokens=60, grammar=SCHEMA, **settings))
        assert result.token_ids == plain.token_ids, settings
        forced = result.stats.by_situation[FORCED]
        # keys, quotes and braces ride as drafts and are all accepted (the mask leaves the target no other choice)
        assert forced["drafted"] >= 8 and forced["accepted"] == forced["drafted"], forced
    free = engine.generate(prompt, GenerationConfig(max_new_tokens=60, drafter="none"))
    assert free.text != plain.text  # the grammar changed the answer


def test_every_kind_of_grammar_is_obeyed_greedy_and_sampled(engine):
    for spec, check in [(GrammarSpec.of("json_object"), lambda t: isinstance(json.loads(t), dict)),
                        (GrammarSpec.of("choice", ["yes", "no", "maybe"]), lambda t: t in ("yes", "no", "maybe")),
                        (GrammarSpec.of("regex", "[a-z]{2,5}-[0-9]{2}"), lambda t: len(t.split("-")[1]) == 2)]:
        for temperature in (0.0, 1.0):
            result = engine.generate("Hello", GenerationConfig(max_new_tokens=40, grammar=spec, seed=1,
                                                               temperature=temperature, drafter="model",
                                                               num_draft_tokens=2))
            assert check(result.text), (spec, result.text)


def test_a_bad_grammar_is_refused_before_anything_runs(engine):
    with pytest.raises(GenerationError, match="not valid JSON"):
        engine.generate("Hello", GenerationConfig(grammar=GrammarSpec("json_schema", "{nope")))
    with pytest.raises(GenerationError, match="GrammarSpec"):
        engine.generate("Hello", GenerationConfig(grammar={"type": "object"}))


def _masked_joint(engine, prompt_ids, sampling, spec, depth):
    """Exact joint distribution of the first `depth` tokens of constrained target-only sampling."""
    compiled = engine.grammar(spec)

    def mask_of(prefix):
        state = compiled.start(engine.target.vocab_limit)
        state.advance(prefix)
        return state.allowed([])[1]

    return _target_joint(engine, prompt_ids, sampling, depth, mask_of)


@pytest.mark.parametrize("drafter, spec", [
    ("model", GrammarSpec.of("regex", "[a-z ]+")),  # q sampled under the same mask as p
    ("ngram", GrammarSpec.of("regex", "[a-z, ]+")),  # one-hot lookup drafts, cut where the grammar refuses them
])
def test_sampled_constrained_speculation_has_the_masked_target_distribution(near_engine, drafter, spec):
    engine = near_engine
    settings = dict(temperature=1.3, top_k=3)
    prompt_ids = engine.prompt_ids("one, two, three, one, two, three, one, two,")
    sampling = dataclasses.replace(SamplingConfig(**settings), output_start=len(prompt_ids), needs_logits=True)
    exact = _masked_joint(engine, prompt_ids, sampling, spec, depth=4)
    runs = 2000
    counts, totals = _sampled_joint(engine, prompt_ids, runs, drafter=drafter, num_draft_tokens=3, ngram_min=1,
                                    grammar=spec, **settings)
    assert totals["accepted"] >= runs // 5 and totals["rejections"] >= runs // 20, totals
    _assert_fits(counts, exact, totals)  # a sequence the masked target gives zero probability fails it


@pytest.fixture(scope="module")
def near_engine(tiny_near_draft_artifact):
    return Engine.load(tiny_near_draft_artifact, provider="cpu", threads=1)


def test_greedy_constrained_text_under_8_clients_equals_each_prompts_own(engine):
    prompts = PROMPT_SET[:8]
    reference = [engine.generate(p, GenerationConfig(max_new_tokens=60, drafter="none", grammar=SCHEMA)).token_ids
                 for p in prompts]
    kinds = [dict(drafter="none")] + DRAFTERS
    configs = [GenerationConfig(max_new_tokens=60, grammar=SCHEMA, **kinds[i % len(kinds)]) for i in range(8)]
    steps = []
    results, batch = _results_in_batch(engine, prompts, configs, max_batch=8, kv_capacity=160, on_step=steps.append)
    assert [r.token_ids for r in results] == reference
    assert max(steps) >= 2
    for result in results:
        _valid(result.text)
    assert sum(r.stats.by_situation.get(FORCED, {}).get("accepted", 0) for r in results) > 0


def test_mask_time_is_counted_per_iteration_and_only_under_a_grammar(engine):
    constrained = engine.generate("Hello", GenerationConfig(max_new_tokens=30, grammar=SCHEMA, drafter="ngram"))
    free = engine.generate("Hello", GenerationConfig(max_new_tokens=30, drafter="ngram"))
    assert 0 < constrained.stats.mask_seconds < constrained.stats.total_seconds
    assert free.stats.mask_seconds == 0.0
