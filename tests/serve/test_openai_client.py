"""The official openai client against the live server: chat and completions, streamed and not."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from click.testing import CliRunner

from specdec.cli.main import main
from specdec.runtime import GenerationConfig
from tests.serve.conftest import MODEL

openai = pytest.importorskip("openai")

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown"


def _client(server) -> "openai.OpenAI":
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_and_health(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert [m.id for m in _client(server).models.list()] == [MODEL]


def test_greedy_chat_equals_specdec_generate(server, serve_artifact):
    reply = _client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=24, temperature=0)
    cli = CliRunner().invoke(main, ["generate", str(serve_artifact), PROMPT, "--chat", "--max-new-tokens", "24",
                                    "--provider", "cpu", "--json"])
    assert cli.exit_code == 0, cli.output
    expected = json.loads(cli.stdout)
    assert reply.choices[0].message.content == expected["text"]
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage.completion_tokens == len(expected["token_ids"])
    assert reply.choices[0].finish_reason == {"eos": "stop", "length": "length"}[expected["finish_reason"]]


def test_streamed_chat_matches_non_streamed(server):
    client = _client(server)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_completions_streamed_and_not_equal_the_engine(server, serve_engine):
    client = _client(server)
    expected = serve_engine.generate(PROMPT, GenerationConfig(max_new_tokens=20)).text
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, stream=True))
    assert whole.choices[0].text == streamed == expected
    assert whole.object == "text_completion"


@pytest.mark.parametrize("knobs", [{"drafter": "none"}, {"drafter": "model", "num_draft_tokens": 3},
                                   {"drafter": "ngram", "num_draft_tokens": "auto"}])
def test_greedy_output_is_the_same_under_every_drafter_and_stats_come_back(server, serve_engine, knobs):
    reply = _client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0,
                                               extra_body={**knobs, "specdec_stats": True})
    assert reply.choices[0].text == serve_engine.generate(PROMPT, GenerationConfig(max_new_tokens=32)).text
    stats = reply.model_extra["specdec"]
    assert stats["drafter"] == knobs["drafter"] and stats["new_tokens"] == reply.usage.completion_tokens
    if knobs["drafter"] == "model":
        assert stats["drafted"] > 0 and stats["num_draft_tokens"] == "3"


def test_sampling_with_a_seed_repeats_and_stop_strings_cut(server, serve_engine):
    client = _client(server)
    runs = [client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0.9, top_p=0.95,
                                      seed=7, extra_body={"num_draft_tokens": 3}).choices[0].text for _ in range(2)]
    assert runs[0] == runs[1]
    expected = serve_engine.generate(PROMPT, GenerationConfig(max_new_tokens=24, temperature=0.9, top_p=0.95,
                                                              seed=7, num_draft_tokens=3)).text
    assert runs[0] == expected
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    stop = full.strip()[:3]
    assert stop, full
    cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[:full.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_n_choices_are_seed_plus_i_samples_streamed_or_not_with_the_prompt_counted_once(server, serve_engine):
    """n=3 with seed 7 on a server of 2 concurrent generations: choice i is the engine's answer at seed 7 + i (the
    third takes the place the first gives back when its generation ends, though the response is not sent yet); the
    stream carries the same texts by index, a finish each, and the same usage once."""
    client = _client(server)
    settings = dict(max_tokens=16, temperature=0.9, top_p=0.95, seed=7, n=3)
    whole = client.completions.create(model=MODEL, prompt=PROMPT, extra_body={"num_draft_tokens": 3}, **settings)
    texts = [choice.text for choice in sorted(whole.choices, key=lambda c: c.index)]
    assert [c.index for c in whole.choices] == [0, 1, 2]
    expected = [serve_engine.generate(PROMPT, GenerationConfig(max_new_tokens=16, temperature=0.9, top_p=0.95,
                                                               seed=7 + i, num_draft_tokens=3))
                for i in range(3)]
    assert texts == [r.text for r in expected] and len(set(texts)) > 1
    prompt_tokens = len(serve_engine.codec.encode(PROMPT))
    assert whole.usage.prompt_tokens == prompt_tokens
    assert whole.usage.completion_tokens == sum(len(r.token_ids) for r in expected)

    streamed, finishes, usages = ["", "", ""], [[], [], []], []
    for chunk in client.completions.create(model=MODEL, prompt=PROMPT, stream=True,
                                           stream_options={"include_usage": True},
                                           extra_body={"num_draft_tokens": 3}, **settings):
        if chunk.usage is not None:
            usages.append(chunk.usage)
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
            if choice.finish_reason:
                finishes[choice.index].append(choice.finish_reason)
    assert streamed == texts and all(len(f) == 1 for f in finishes)
    assert len(usages) == 1 and usages[0].completion_tokens == whole.usage.completion_tokens
    deadline = time.monotonic() + 5  # the last place goes back on the loop just after the generation's end
    while server.state.admission.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.state.admission.running == 0
    with pytest.raises(openai.BadRequestError, match="5 prompts x n=16 make more than 64 choices"):
        client.completions.create(model=MODEL, prompt=[PROMPT] * 5, **{**settings, "n": 16})


def test_greedy_n_choices_are_each_the_greedy_answer(server):
    client = _client(server)
    messages = [{"role": "user", "content": PROMPT}]
    one = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    two = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0, n=2,
                                         logprobs=True)
    assert [c.message.content for c in two.choices] == [one.choices[0].message.content] * 2
    assert all("".join(t.token for t in c.logprobs.content) == c.message.content for c in two.choices)
    assert two.usage.completion_tokens == 2 * one.usage.completion_tokens


def test_speculative_counters_move_under_vllm_and_llamacpp_names(server):
    before = {n: server.metric(n) for n in ("vllm:spec_decode_num_drafts_total",
                                            "vllm:spec_decode_num_draft_tokens_total",
                                            "vllm:spec_decode_num_accepted_tokens_total",
                                            "llamacpp:spec_decode_num_draft_tokens")}
    reply = _client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0,
                                               extra_body={"drafter": "model", "num_draft_tokens": 3,
                                                           "specdec_stats": True})
    stats = reply.model_extra["specdec"]
    delta = {n: server.metric(n) - v for n, v in before.items()}
    assert delta["vllm:spec_decode_num_draft_tokens_total"] == stats["drafted"] > 0
    assert delta["llamacpp:spec_decode_num_draft_tokens"] == stats["drafted"]
    assert delta["vllm:spec_decode_num_accepted_tokens_total"] == stats["accepted"]
    assert delta["vllm:spec_decode_num_drafts_total"] == sum(n for k, n in stats["draft_lengths"].items() if k != "0")
    per_pos = [server.metric("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p))
               for p in range(3)]
    assert per_pos == sorted(per_pos, reverse=True)  # accepting position p needs positions < p accepted
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:inter_token_latency_seconds_count"):
        assert server.metric(name) > 0, name


def test_streamed_completion_with_stop_and_usage_equals_the_non_streamed_one(server):
    client = _client(server)
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    stop = full.strip()[2:5]
    assert stop, full
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text == full[:full.index(stop)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    # without include_usage no chunk carries usage
    plain = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True))
    assert all(c.usage is None for c in plain) and plain[-1].choices[0].finish_reason == "length"


def test_stats_in_response_is_a_server_default_a_request_can_turn_off(serve_engine, serve_artifact):
    from tests.serve.conftest import live_server

    with live_server(serve_engine, serve_artifact, stats_in_response=True) as live:
        client = _client(live)
        with_stats = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
        assert with_stats.model_extra["specdec"]["new_tokens"] == with_stats.usage.completion_tokens
        without = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                            extra_body={"specdec_stats": False})
        assert "specdec" not in without.model_extra
