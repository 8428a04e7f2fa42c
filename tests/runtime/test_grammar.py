"""Grammar state (structured outputs): masks, drafts, advance/rollback, limits, and sampled outputs that parse."""

import json
import re

import jsonschema
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from specdec.exporter.tiny_models import CORPUS, SPECIAL_TOKENS
from specdec.runtime.grammar import (MAX_SCHEMA_DEPTH, MAX_SPEC_BYTES, GrammarError, GrammarSpec, allowed_many,
                                     apply_mask, compile_grammar, grammar_tokenizer, mask_probs)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{3}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "role": {"enum": ["admin", "user"]},
    },
    "required": ["name", "age", "ok", "address", "tags", "role"],
    "additionalProperties": False,
}
VALID = {"name": "Bob", "age": 42, "ok": True, "address": {"city": "Paris", "zip": "750"}, "tags": ["a", "bc"],
         "role": "user"}


def _tiny_tokenizer() -> tuple[Tokenizer, int]:
    """Return the tiny models' byte-level BPE (400 tokens, built here without transformers) and its EOS id."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator([CORPUS] * 4, trainer=trainer)
    return tokenizer, tokenizer.token_to_id("<|im_end|>")


@pytest.fixture(scope="module")
def tiny():
    tokenizer, eos = _tiny_tokenizer()
    return tokenizer, eos, grammar_tokenizer(tokenizer, [eos])


@pytest.fixture(scope="module")
def smollm2(smollm2_folder):
    """SmolLM2's tokenizer.json as the exporter writes it (from the GGUF: a Sequence decoder)."""
    tokenizer = Tokenizer.from_file(str(smollm2_folder / "tokenizer.json"))
    eos = tokenizer.token_to_id("<|im_end|>")
    return tokenizer, eos, grammar_tokenizer(tokenizer, [eos])


def _encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def _state(adapter, spec=None, pad=0):
    compiled = compile_grammar(spec or GrammarSpec.of("json_schema", PERSON), adapter)
    return compiled.start(adapter.vocab_size + pad)


def _snapshot(state) -> tuple:
    return state.consumed, state.done, state.accepting, state.forced(100), state.allowed([])[1].tobytes()


# -- forced tokens ---------------------------------------------------------------------------------------------

def _check_forced_key(tokenizer, adapter):
    state = _state(adapter)
    text = tokenizer.decode(state.forced(50))
    assert text and ('{"name'.startswith(text) or text.startswith('{"name')), text
    assert len(state.forced(1)) == 1 and state.forced(0) == []
    state.advance(_encode(tokenizer, '{"'))  # after `{"` the first key is forced
    assert tokenizer.decode(state.forced(50)).startswith("name")
    # after the first value, `, "age": ` is forced
    state.advance(_encode(tokenizer, 'name": "Bob"'))
    assert tokenizer.decode(state.forced(50)).startswith(', "age')


def test_forced_tokens_are_what_the_schema_forces(tiny):
    tokenizer, _, adapter = tiny
    _check_forced_key(tokenizer, adapter)


# -- allowed: drafts cut at the first invalid one, rows match one-by-one masks, state unchanged --------------

def _reference_rows(adapter, drafts, n, vocab_size):
    """Row j computed the slow way: a fresh state advanced over drafts[:j], its next-token mask."""
    rows = []
    for j in range(n + 1):
        state = _state(adapter, pad=vocab_size - adapter.vocab_size)
        state.advance(drafts[:j])
        rows.append(state.allowed([])[1][0])
    return np.stack(rows)


def _check_allowed_cuts(tokenizer, adapter, pad):
    valid = _encode(tokenizer, json.dumps(VALID))
    cut = 6
    bad = next(t for t in range(adapter.vocab_size) if t != valid[cut]
               and _state(adapter).allowed(valid[:cut])[1][cut, t] == 0)
    drafts = valid[:cut] + [bad] + valid[cut + 1:cut + 4]
    state = _state(adapter, pad=pad)
    state.advance(valid[:2])
    before = _snapshot(state)
    n, mask = state.allowed(drafts[2:])
    assert n == cut - 2
    assert mask.shape == (n + 1, adapter.vocab_size + pad) and mask.dtype == bool
    assert not mask[:, adapter.vocab_size:].any()  # padding ids are never allowed
    assert all(mask[j, drafts[2 + j]] for j in range(n)) and not mask[n, bad]
    again_n, again = state.allowed(drafts[2:])
    assert again_n == n and np.array_equal(again, mask)
    assert _snapshot(state) == before
    ref = _reference_rows(adapter, drafts, cut, adapter.vocab_size + pad)[2:]
    assert np.array_equal(mask, ref)
    full_n, full = state.allowed(valid[2:])  # all valid: every row, and the state still where it was
    assert full_n == len(valid) - 2 and full.shape[0] == full_n + 1
    assert _snapshot(state) == before


def _fresh(tiny):
    """Return (EOS id, adapter, VALID's tokens, a fresh state of PERSON) for a tokenizer fixture."""
    tokenizer, eos, adapter = tiny
    return eos, adapter, _encode(tokenizer, json.dumps(VALID)), _state(adapter)


@pytest.mark.parametrize("pad", [0, 64])
def test_allowed_cuts_at_the_invalid_draft_and_leaves_the_state(tiny, pad):
    tokenizer, _, adapter = tiny
    _check_allowed_cuts(tokenizer, adapter, pad)


def test_allowed_with_no_drafts_and_an_eos_draft(tiny):
    eos, adapter, valid, state = _fresh(tiny)
    n, mask = state.allowed([])
    assert n == 0 and mask.shape == (1, adapter.vocab_size) and not mask[0, eos]
    state.advance(valid[:-1])
    before = _snapshot(state)
    n, mask = state.allowed([valid[-1], eos, valid[0]])  # `}` then EOS; nothing is verified past an EOS
    assert n == 2 and mask.shape == (3, adapter.vocab_size)
    assert mask[1, eos] and mask[1].sum() == 1 and mask[2, eos] and mask[2].sum() == 1
    n, mask = state.allowed([eos])  # EOS before the object is closed
    assert n == 0 and not mask[0, eos]
    assert _snapshot(state) == before


def test_allowed_many_equals_one_state_at_a_time(tiny):
    tokenizer, _, adapter = tiny
    valid = _encode(tokenizer, json.dumps(VALID))
    a, b, c = _state(adapter), _state(adapter), _state(adapter, GrammarSpec("json_object"))
    b.advance(valid[:5])
    drafts = [valid[:4], valid[5:9], []]
    together = allowed_many([a, b, c], drafts)
    for state, ds, (n, mask) in zip((a, b, c), drafts, together):
        alone_n, alone = state.allowed(ds)
        assert n == alone_n and np.array_equal(mask, alone)


# -- advance and rollback ---------------------------------------------------------------------------------------

def _check_round_trips(tokenizer, eos, adapter):
    valid = _encode(tokenizer, json.dumps(VALID)) + [eos]
    state = _state(adapter)
    snapshots = [_snapshot(state)]
    for i, token in enumerate(valid):
        state.advance([token])
        snapshots.append(_snapshot(state))
    assert state.done and state.accepting and state.consumed == len(valid)
    for back in (1, 2, 5, len(valid)):
        state.rollback(back)
        assert _snapshot(state) == snapshots[len(valid) - back]
        state.advance(valid[len(valid) - back:])
        assert _snapshot(state) == snapshots[-1]
    state.rollback(len(valid))
    with pytest.raises(GrammarError, match="cannot roll back 1 tokens: 0 were advanced"):
        state.rollback(1)


def test_advance_and_rollback_round_trip(tiny):
    tokenizer, eos, adapter = tiny
    _check_round_trips(tokenizer, eos, adapter)


def test_advance_refuses_what_the_grammar_refuses_and_keeps_the_state(tiny):
    eos, adapter, valid, state = _fresh(tiny)
    state.advance(valid[:3])
    before = _snapshot(state)
    bad = next(t for t in range(adapter.vocab_size) if not state.allowed([])[1][0, t])
    with pytest.raises(GrammarError, match=f"refuses token {bad} at position 1"):
        state.advance([valid[3], bad])
    with pytest.raises(GrammarError, match="before the grammar is complete"):
        state.advance([valid[3], eos])
    with pytest.raises(GrammarError, match="after EOS"):
        state.advance(valid[3:] + [eos, valid[0]])
    assert _snapshot(state) == before
    state.advance(valid[3:] + [eos])
    with pytest.raises(GrammarError, match="after EOS"):
        state.advance([valid[0]])


# -- limits and malformed specs ---------------------------------------------------------------------------------

def _nested(depth: int) -> dict:
    schema = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("spec, message", [
    (GrammarSpec("json_schema", '{"type": "object", "properties": '), "json_schema is not valid JSON"),
    (GrammarSpec.of("json_schema", {"type": "sausage"}), "invalid json_schema: .*sausage"),
    (GrammarSpec.of("json_schema", {"type": "string", "format": "shoe-size"}), "invalid json_schema: .*shoe-size"),
    (GrammarSpec.of("json_schema", ["not", "an", "object"]), "json_schema must be a JSON object, got list"),
    (GrammarSpec.of("json_schema", _nested(17)), f"nests objects and arrays 33 deep, over the limit of {MAX_SCHEMA_DEPTH}"),
    (GrammarSpec("json_schema", "[" * 5000 + "]" * 5000), f"arrays deeper than the limit of {MAX_SCHEMA_DEPTH}"),
    (GrammarSpec.of("json_schema", {"type": "string", "description": "x" * MAX_SPEC_BYTES}),
     rf"json_schema is \d+ bytes, over the limit of {MAX_SPEC_BYTES}"),
    (GrammarSpec("regex", "(ab"), "invalid regex: .*unclosed group"),
    (GrammarSpec("grammar", "start: missing_rule"), "invalid grammar: .*missing_rule"),
    (GrammarSpec.of("choice", []), "choice must be a non-empty JSON list"),
])
def test_bad_specs_raise_one_line_grammar_errors(tiny, spec, message):
    with pytest.raises(GrammarError, match=message) as caught:
        compile_grammar(spec, tiny[2])
    assert "\n" not in str(caught.value)


def test_a_schema_at_the_depth_limit_compiles(tiny):
    # _nested(d) nests d - 1 schema objects, each holding a "properties" object: depth 2d - 1
    assert MAX_SCHEMA_DEPTH == 32
    compile_grammar(GrammarSpec.of("json_schema", _nested(16)), tiny[2])


def test_spec_kind_and_eos_are_checked():
    with pytest.raises(GrammarError, match="grammar kind must be one of"):
        GrammarSpec("yaml", "")
    with pytest.raises(GrammarError, match="EOS token ids"):
        grammar_tokenizer(_tiny_tokenizer()[0], [])


def test_compiled_grammars_and_adapters_are_cached(tiny):
    tokenizer, eos, adapter = tiny
    assert grammar_tokenizer(tokenizer, [eos]) is adapter
    spec = GrammarSpec.of("json_schema", PERSON)
    assert compile_grammar(spec, adapter) is compile_grammar(GrammarSpec.of("json_schema", PERSON), adapter)
    other = grammar_tokenizer(_tiny_tokenizer()[0], [eos])  # another artifact's tokenizer: its own compile
    assert other is not adapter and compile_grammar(spec, other) is not compile_grammar(spec, adapter)


# -- sampled outputs ----------------------------------------------------------------------------------------------

def _sample(tokenizer, eos, adapter, spec, seed, use_probs, limit=400) -> str:
    """Return text sampled token by token under the mask from random logits, up to EOS."""
    rng = np.random.default_rng(seed)
    state = _state(adapter, spec, pad=16)
    out = []
    for _ in range(limit):
        logits = rng.normal(0, 3, size=(1, state.vocab_size)).astype(np.float32)
        _, mask = state.allowed([])
        if use_probs:  # a draft's q row
            probs = np.exp(logits - logits.max())
            probs = mask_probs(probs / probs.sum(), mask)[0]
        else:  # a target's p row
            masked = apply_mask(logits, mask)[0]
            probs = np.exp(masked - masked.max())
            probs /= probs.sum()
        token = int(rng.choice(state.vocab_size, p=probs))
        state.advance([token])
        if token == eos:
            assert state.done
            return tokenizer.decode(out)
        out.append(token)
    raise AssertionError(f"no EOS in {limit} tokens: {tokenizer.decode(out)!r}")


def _check_sampled_json(tokenizer, eos, adapter, seeds):
    for seed in seeds:
        text = _sample(tokenizer, eos, adapter, GrammarSpec.of("json_schema", PERSON), seed, use_probs=seed % 2 == 1)
        jsonschema.validate(json.loads(text), PERSON)


def test_sampled_outputs_parse_and_validate(tiny):
    tokenizer, eos, adapter = tiny
    _check_sampled_json(tokenizer, eos, adapter, seeds=range(6))


def test_json_object_allows_objects_only(tiny):
    tokenizer, eos, adapter = tiny
    state = _state(adapter, GrammarSpec("json_object"))
    assert state.allowed(_encode(tokenizer, "[1]"))[0] == 0
    text = _encode(tokenizer, '{"a": [1, {"b": null}], "c": "d"}')
    assert state.allowed(text + [eos])[0] == len(text) + 1
    state.advance(text)
    assert state.accepting


@pytest.mark.parametrize("spec, check", [
    (GrammarSpec("regex", "[0-9]{3}-[a-z]{2,4}"), lambda s: re.fullmatch("[0-9]{3}-[a-z]{2,4}", s)),
    (GrammarSpec.of("choice", ["Paris", "London", "Tokyo"]), lambda s: s in ("Paris", "London", "Tokyo")),
    (GrammarSpec("grammar", 'start: "add(" NUM ", " NUM ")"\nNUM: /[1-9][0-9]?/'),
     lambda s: re.fullmatch(r"add\([1-9][0-9]?, [1-9][0-9]?\)", s)),
])
def test_other_kinds_sample_what_they_describe(tiny, spec, check):
    tokenizer, eos, adapter = tiny
    for seed in range(3):
        text = _sample(tokenizer, eos, adapter, spec, seed, use_probs=False)
        assert check(text), text


# -- the numpy helpers --------------------------------------------------------------------------------------------

def test_apply_mask_sets_disallowed_to_minus_infinity_in_a_copy():
    logits = np.array([[1.0, 2.0, 3.0], [0.5, -1.0, 0.0]], dtype=np.float32)
    mask = np.array([[True, False, True], [False, True, False]])
    out = apply_mask(logits, mask)
    assert out.dtype == np.float32 and logits[0, 1] == 2.0
    assert np.array_equal(out, np.array([[1.0, -np.inf, 3.0], [-np.inf, -1.0, -np.inf]], dtype=np.float32))


def test_mask_probs_renormalizes_and_falls_back_to_uniform():
    probs = np.array([[0.5, 0.25, 0.25], [1.0, 0.0, 0.0]])
    mask = np.array([[False, True, True], [False, True, True]])
    assert np.allclose(mask_probs(probs, mask), [[0.0, 0.5, 0.5], [0.0, 0.5, 0.5]])


def test_helpers_check_shapes_and_empty_rows():
    with pytest.raises(ValueError, match="one 2-D shape"):
        apply_mask(np.zeros((2, 3)), np.ones((2, 4), dtype=bool))
    with pytest.raises(ValueError, match="one 2-D shape"):
        mask_probs(np.zeros(3), np.ones(3, dtype=bool))
    with pytest.raises(ValueError, match="mask must be bool"):
        apply_mask(np.zeros((1, 3)), np.ones((1, 3)))
    with pytest.raises(GrammarError, match="mask row 1 allows no token"):
        apply_mask(np.zeros((2, 3)), np.array([[True, False, False], [False, False, False]]))


# -- SmolLM2's own tokenizer (49,152 tokens, the GGUF's Sequence decoder) --------------------------------------

@pytest.mark.slow
def test_smollm2_forced_allowed_rollback_and_sampling(smollm2):
    tokenizer, eos, adapter = smollm2
    assert adapter.vocab_size == 49152
    _check_forced_key(tokenizer, adapter)
    _check_allowed_cuts(tokenizer, adapter, pad=64)
    _check_round_trips(tokenizer, eos, adapter)
    _check_sampled_json(tokenizer, eos, adapter, seeds=range(3))
