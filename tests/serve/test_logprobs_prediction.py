"""logprobs, penalties and predicted outputs through the server, read back by the official openai client."""

from __future__ import annotations

import json
import math

import httpx
import pytest

from specdec.runtime import GenerationConfig
from tests.serve.conftest import MODEL

openai = pytest.importorskip("openai")

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown"


def _client(server) -> "openai.OpenAI":
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_chat_logprobs_streamed_and_not_agree_and_top_1_is_the_greedy_token(server):
    client = _client(server)
    messages = [{"role": "user", "content": PROMPT}]
    settings = dict(model=MODEL, messages=messages, max_tokens=20, temperature=0, logprobs=True, top_logprobs=3)
    whole = client.chat.completions.create(**settings)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    assert all(entry.top_logprobs[0].token == entry.token for entry in content)
    assert all(len(entry.top_logprobs) == 3 and entry.logprob <= 0 for entry in content)
    assert all(abs(entry.logprob - entry.top_logprobs[0].logprob) < 1e-9 for entry in content)
    chunks = list(client.chat.completions.create(**settings, stream=True))
    streamed = [entry for c in chunks if c.choices and c.choices[0].logprobs for entry in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(math.isclose(a.logprob, b.logprob, abs_tol=1e-6) for a, b in zip(streamed, content))
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == whole.choices[0].message.content


def test_completion_logprobs_in_the_legacy_shape(server):
    body = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 2}).json()
    logprobs = body["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == body["usage"]["completion_tokens"]
    assert all(len(top) <= 2 for top in logprobs["top_logprobs"]) and logprobs["text_offset"][0] == 0


def test_a_prediction_leaves_greedy_text_unchanged_and_its_tokens_are_reported(server, serve_engine):
    client = _client(server)
    plain = serve_engine.generate(PROMPT, GenerationConfig(max_new_tokens=24, drafter="none"))
    for prediction in (plain.text, plain.text[: len(plain.text) // 2] + " something new", "unrelated"):
        reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                          extra_body={"prediction": {"type": "content", "content": prediction}})
        assert reply.choices[0].text == plain.text
        details = reply.usage.completion_tokens_details
        assert details.accepted_prediction_tokens >= 0 and details.rejected_prediction_tokens >= 0
        if prediction == plain.text:  # the exact answer (the tiny tokenizer re-encodes some of its bytes otherwise)
            assert details.accepted_prediction_tokens > 0, details
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=12,
                                          temperature=0, prediction={"type": "content", "content": "Hi there"})
    assert chat.usage.completion_tokens_details is not None


def test_presence_and_frequency_penalties_are_applied(server):
    prompt = "one two three one two three one two"

    def text(**fields):
        return httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, **fields}).json()["choices"][0]["text"]

    plain = text()
    assert text(frequency_penalty=1.5) != plain and text(presence_penalty=1.5) != plain
    assert text(presence_penalty=0.0, frequency_penalty=0.0) == plain


def test_each_streamed_chunk_carries_the_logprobs_of_its_own_tokens(server):
    """OpenAI's shape per chunk, also where one target call commits several tokens (a prediction of the answer
    itself): before, a call's logprobs all rode its first text chunk. A token that is half of a character rides
    the chunk that completes it (its entry reads U+FFFD)."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "logprobs": 1}
    answer = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    body.update(stream=True, prediction={"type": "content", "content": answer}, specdec_stats=True)
    chunks, stats = [], None
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                stats = event.get("specdec", stats)
                if event["choices"] and event["choices"][0]["text"]:
                    chunks.append((event["choices"][0]["text"], event["choices"][0]["logprobs"]["tokens"]))
    assert stats["accepted"] > 0  # some calls committed several tokens
    assert sum(len(tokens) for _, tokens in chunks) == stats["new_tokens"]
    whole = [(text, tokens) for text, tokens in chunks if "\ufffd" not in "".join(tokens)]
    assert len(whole) >= len(chunks) // 2 and all("".join(tokens) == text for text, tokens in whole), chunks


def test_a_streamed_chunk_carries_no_logprobs_of_text_held_back_for_a_stop_string(server):
    """Text that could begin a stop string is held back until the next piece shows it does not: the entries of
    its tokens ride the chunk that sends it. Before, they rode the chunk before (every token committed so far)."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "logprobs": 1}
    choice = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    answer, tokens = choice["text"], choice["logprobs"]["tokens"]
    # a character some token ends with, not the last: held back there until the next token shows no stop string
    letter = next(t[-1] for t in tokens[:-1] if t.strip() and "\ufffd" not in t)
    body.update(stream=True, stop=[letter + "\u0001"])
    chunks = []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if event["choices"] and event["choices"][0]["text"]:
                    chunks.append((event["choices"][0]["text"], event["choices"][0]["logprobs"]["tokens"]))
    assert "".join(text for text, _ in chunks) == answer
    assert sum(len(entries) for _, entries in chunks) == len(tokens)  # every token's entry, once
    text_so_far = entries_so_far = ""
    for text, entries in chunks:  # the entries never run ahead of the text sent (byte tokens read U+FFFD apart)
        text_so_far = text_so_far + text.replace("\ufffd", "")
        entries_so_far = entries_so_far + "".join(entries).replace("\ufffd", "")
        assert len(entries_so_far) <= len(text_so_far), chunks
    assert any(not entries for _, entries in chunks)  # not vacuous: a chunk's last token waited for the next
