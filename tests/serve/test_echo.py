"""Completions with `echo`, a list of prompts and prompt logprobs: what lm-evaluation-harness's loglikelihood
tasks send (`local-completions`: token-id prompts in a batch, echo, max_tokens 1, logprobs 1, temperature 0)."""

from __future__ import annotations

import json
import math

import httpx

from tests.serve.conftest import MODEL

CONTEXT = "The quick brown fox jumps over the lazy dog. The quick"
CONTINUATIONS = [" brown fox", " red cat sat"]


def _post(server, **body):
    reply = httpx.post(server.url + "/v1/completions", json={"model": MODEL, **body}, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_a_harness_batch_scores_each_continuation_from_the_prompt_logprobs(server, serve_engine):
    """Two token-id prompts (context + continuation) in one request: choice i is prompt i echoed, then one
    generated token; token_logprobs[ctxlen:-1] are the engine's prompt logprobs of the continuation, which
    lm-evaluation-harness sums, and its greedy check reads top_logprobs."""
    context = serve_engine.codec.encode(CONTEXT)
    prompts = [context + serve_engine.codec.encode(c, add_special_tokens=False) for c in CONTINUATIONS]
    body = _post(server, prompt=prompts, echo=True, max_tokens=1, logprobs=1, temperature=0, seed=1234)
    choices = sorted(body["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1]
    assert body["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
    for prompt, choice in zip(prompts, choices):
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(prompt) + 1  # the prompt's tokens, then the generated one
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert choice["text"].startswith(serve_engine.codec.decode(prompt))
        offsets = logprobs["text_offset"]
        assert offsets[0] == 0 and offsets == sorted(offsets)
        expected = serve_engine.prompt_logprobs(prompt, top=1)
        continuation = logprobs["token_logprobs"][len(context):-1]
        assert len(continuation) == len(prompt) - len(context)
        assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(continuation, expected.chosen[len(context) - 1:]))
        greedy = all(token == max(top.values()) for token, top in
                     zip(continuation, logprobs["top_logprobs"][len(context):-1]))
        picked = [serve_engine.codec.decode([int(t)]) for t in expected.top_ids[len(context) - 1:, 0]]
        assert greedy == (picked == logprobs["tokens"][len(context):-1])


def test_echo_puts_the_prompt_as_sent_ahead_of_the_answer_streamed_or_not(server):
    settings = dict(prompt=CONTEXT, echo=True, max_tokens=6, temperature=0, logprobs=2)
    whole = _post(server, **settings)["choices"][0]
    plain = _post(server, prompt=CONTEXT, max_tokens=6, temperature=0, logprobs=2)["choices"][0]
    assert whole["text"] == CONTEXT + plain["text"]
    answer = whole["logprobs"]["tokens"][-6:]
    assert answer == plain["logprobs"]["tokens"]
    assert whole["logprobs"]["text_offset"][-6] == len(CONTEXT)  # the answer's offsets follow the prompt's text
    text, tokens = "", []
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"model": MODEL, "stream": True, **settings}) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    text += choice["text"]
                    tokens += (choice["logprobs"] or {}).get("tokens", [])
    assert text == whole["text"] and tokens == whole["logprobs"]["tokens"]
    without_logprobs = _post(server, prompt=CONTEXT, echo=True, max_tokens=6, temperature=0)["choices"][0]
    assert without_logprobs["text"] == whole["text"] and without_logprobs["logprobs"] is None


def test_a_harness_generation_batch_gets_each_prompts_answer_cut_at_any_of_its_stops(server, serve_engine):
    """lm-evaluation-harness's generate_until: several prompts in one request, a task's stop strings and EOS's
    (more than OpenAI's 4), greedy; choice i answers prompt i as the engine does alone."""
    from specdec.runtime import GenerationConfig

    prompts = ["one, two, three, one, two,", "Hello world! Hello"]
    stops = ["\n\n", "Question:", "</s>", "<|im_end|>", "<|endoftext|>", "zzzz"]
    body = _post(server, prompt=prompts, max_tokens=12, temperature=0, stop=stops, seed=1234)
    texts = [c["text"] for c in sorted(body["choices"], key=lambda c: c["index"])]
    expected = [serve_engine.generate(p, GenerationConfig(max_new_tokens=12, stop_strings=tuple(stops))).text
                for p in prompts]
    assert texts == expected
    assert body["usage"]["prompt_tokens"] == sum(len(serve_engine.codec.encode(p)) for p in prompts)


def test_a_sampled_batch_answers_each_prompt_as_it_would_alone_so_the_batch_size_changes_nothing(server,
                                                                                                  serve_engine):
    from specdec.runtime import GenerationConfig

    prompts = ["one, two, three, one, two,", "Hello world! Hello", "def add(a, b):"]
    settings = dict(max_tokens=10, temperature=0.8, seed=5, num_draft_tokens=2)
    batch = _post(server, prompt=prompts, **settings)
    texts = [c["text"] for c in sorted(batch["choices"], key=lambda c: c["index"])]
    alone = [_post(server, prompt=p, **settings)["choices"][0]["text"] for p in prompts]
    assert texts == alone == [serve_engine.generate(p, GenerationConfig(max_new_tokens=10, temperature=0.8, seed=5,
                                                                         num_draft_tokens=2)).text for p in prompts]


def test_max_tokens_0_with_echo_scores_the_prompts_and_generates_nothing(server, serve_engine):
    """A scoring client's request (perplexity, reward): the prompts come back with their logprobs, finish_reason
    "length", no completion tokens; streamed the same. Without echo, or on chat, max_tokens 0 is a 400."""
    prompts = [CONTEXT, "Hello world!"]
    body = _post(server, prompt=prompts, echo=True, max_tokens=0, logprobs=1)
    assert body["usage"]["completion_tokens"] == 0
    for prompt, choice in zip(prompts, sorted(body["choices"], key=lambda c: c["index"])):
        ids = serve_engine.codec.encode(prompt)
        assert choice["text"] == prompt and choice["finish_reason"] == "length"
        assert choice["logprobs"]["token_logprobs"][0] is None
        expected = serve_engine.prompt_logprobs(ids, top=1).chosen
        assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(choice["logprobs"]["token_logprobs"][1:], expected))
        assert len(choice["logprobs"]["tokens"]) == len(ids)
    texts = ["", ""]
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": prompts, "echo": True, "max_tokens": 0, "stream": True}) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    texts[choice["index"]] += choice["text"]
    assert texts == prompts
    for path, request in (("/v1/completions", {"prompt": "a", "max_tokens": 0}),
                          ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_tokens": 0})):
        reply = httpx.post(server.url + path, json={"model": MODEL, **request}, timeout=30)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "max_tokens"
