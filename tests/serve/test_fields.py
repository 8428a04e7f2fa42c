"""Every OpenAI (and common vLLM) field is implemented, refused with a 400 naming it, or documented as ignored."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from specdec.serve import protocol
from tests.serve.conftest import MODEL

DOCS = Path(__file__).resolve().parents[2] / "docs" / "SERVE.md"


def _complete(server, **fields):
    return httpx.post(server.url + "/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": "Hello world", "max_tokens": 6, "temperature": 0, **fields})


def test_logit_bias_and_stop_token_ids_are_honoured(server, serve_engine):
    forced = _complete(server, logit_bias={"17": 100})
    assert forced.status_code == 200, forced.text
    assert serve_engine.codec.encode(forced.json()["choices"][0]["text"], add_special_tokens=False) != []
    stopped = _complete(server, logit_bias={"17": 100}, stop_token_ids=[17])
    body = stopped.json()
    assert body["usage"]["completion_tokens"] == 1 and body["choices"][0]["finish_reason"] == "stop"
    assert forced.json()["usage"]["completion_tokens"] == 6


def test_penalty_and_min_p_change_or_keep_the_answer_as_they_should(server):
    prompt = "one two three one two three one two"
    plain = _complete(server, prompt=prompt, max_tokens=24).json()["choices"][0]["text"]
    penalised = _complete(server, prompt=prompt, max_tokens=24, repetition_penalty=1.8).json()["choices"][0]["text"]
    assert penalised != plain
    # min_p never drops the most likely token: greedy output is unchanged
    assert _complete(server, prompt=prompt, max_tokens=24, min_p=0.5).json()["choices"][0]["text"] == plain
    seeded = [_complete(server, prompt=prompt, max_tokens=16, temperature=1.0, seed=7, min_p=0.05,
                        repetition_penalty=1.2).json()["choices"][0]["text"] for _ in range(2)]
    assert seeded[0] == seeded[1]


@pytest.mark.parametrize("fields, param", [
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"3": 500}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, None), ({"stop_token_ids": [10 ** 9]}, None),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 2}, "min_p"), ({"seed": -1}, "seed"),
    ({"ignore_eos": True}, "ignore_eos"), ({"min_tokens": 3}, "min_tokens"), ({"guided_json": "{x"}, "guided_json"),
    ({"audio": {}}, "audio"), ({"modalities": ["text", "audio"]}, "modalities"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
])
def test_fields_it_cannot_honour_get_a_400_naming_them(server, fields, param):
    answer = _complete(server, **fields)
    assert answer.status_code == 400, answer.text
    if param:
        assert answer.json()["error"]["param"] == param


def test_ignored_fields_are_accepted_and_documented(server):
    ignored = {"user": "u1", "metadata": {"a": "b"}, "store": False, "service_tier": "auto",
               "prompt_cache_key": "k", "safety_identifier": "s",
               "reasoning_effort": "low", "verbosity": "low"}
    assert set(ignored) == set(protocol.IGNORED_FIELDS)
    assert _complete(server, **ignored).status_code == 200
    documented = DOCS.read_text()
    section = documented[documented.index("Accepted and ignored"):]
    assert all(re.search(rf"`{name}`", section) for name in protocol.IGNORED_FIELDS)


def test_one_model_by_id(server):
    card = httpx.get(server.url + f"/v1/models/{MODEL}", timeout=10)
    assert card.status_code == 200 and card.json()["id"] == MODEL and card.json()["object"] == "model"
    missing = httpx.get(server.url + "/v1/models/gpt-4o", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
