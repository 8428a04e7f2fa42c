"""Structured outputs and tool calls through the server: outputs parse and validate, required calls always parse,
greedy text is the same with and without drafts, and bad formats or tools get a 400 naming the field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from specdec.serve import structured
from tests.serve.conftest import MODEL, assembled_chat_stream

openai = pytest.importorskip("openai")

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 130}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 6},
                                                "unit": {"enum": ["C", "F"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 4}}, "required": ["zone"]}}}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]  # the tiny model has 512 positions


def _client(server) -> "openai.OpenAI":
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _schema_format(schema=PERSON):
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def test_json_schema_output_validates_and_is_the_same_with_and_without_drafts(server):
    client = _client(server)
    texts = {}
    for drafter in ("none", "ngram", "model"):
        reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=80, temperature=0,
                                               response_format=_schema_format(), extra_body={"drafter": drafter})
        texts[drafter] = reply.choices[0].message.content
        jsonschema.validate(json.loads(texts[drafter]), PERSON)
    assert len(set(texts.values())) == 1, texts
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=80, temperature=0, response_format=_schema_format(), stream=True)
        if c.choices)
    assert streamed == texts["none"]
    sampled = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=80, temperature=1.0, seed=3,
                                             response_format={"type": "json_object"})
    content = sampled.choices[0].message.content
    assert content.startswith("{")  # the tiny model's free keys may outrun max_tokens: then it is cut, as OpenAI's
    if sampled.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)


@pytest.mark.parametrize("fields, check", [
    ({"guided_json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ({"structured_outputs": {"json": PERSON}}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
    ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}, lambda t: len(t) == 6 and t[3] == "-"),
    ({"guided_grammar": 'start: "ab" | "cd"'}, lambda t: t in ("ab", "cd")),
])
def test_vllms_fields_constrain_completions(server, fields, check):
    body = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "Answer:", "max_tokens": 60, "temperature": 0.8, "seed": 1, **fields}).json()
    assert check(body["choices"][0]["text"]), body


def test_a_required_tool_call_parses_and_validates_streamed_and_not(server):
    client = _client(server)
    # (parallel calls are a list the tiny model may not close within its positions: checked in the schema test)
    for choice, parallel in [("required", False), ({"type": "function", "function": {"name": "get_time"}}, True)]:
        reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=72, temperature=0,
                                               tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=parallel)
        choice_ = reply.choices[0]
        assert choice_.finish_reason == "tool_calls" and choice_.message.content is None
        calls = choice_.message.tool_calls
        assert calls and (parallel or len(calls) == 1)
        for call in calls:
            tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
            assert call.id.startswith("call_") and call.type == "function"
        if isinstance(choice, dict):
            assert {c.function.name for c in calls} == {"get_time"}
    with client.chat.completions.stream(model=MODEL, messages=MESSAGES, max_tokens=72, temperature=0,
                                        tools=[WEATHER], tool_choice="required") as stream:
        final = stream.get_final_completion()
    streamed_call = final.choices[0].message.tool_calls[0]
    assert streamed_call.function.name == "get_weather" and final.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(streamed_call.function.arguments), WEATHER["function"]["parameters"])


def test_call_stream_announces_each_call_then_streams_its_arguments_text():
    text = '[{"name": "get_weather", "arguments": {"city": "P\\"a}", "unit": "C"}}, {"name": "get_time", "arguments": {}}]'
    stream, deltas = structured.CallStream(), []
    for end in range(len(text) + 1):  # one character at a time, as pieces may cut anywhere
        deltas += stream.deltas(text[:end])
    heads = [d for d in deltas if "id" in d]
    assert [(d["index"], d["function"]["name"], d["function"]["arguments"]) for d in heads] == [
        (0, "get_weather", ""), (1, "get_time", "")]
    assert all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in deltas if "id" not in d)
    arguments = ["".join(d["function"]["arguments"] for d in deltas if d["index"] == i) for i in (0, 1)]
    assert [json.loads(a) for a in arguments] == [{"city": 'P"a}', "unit": "C"}, {}]
    assert stream.deltas(text) == []  # nothing new: nothing sent twice
    assert structured.scan_calls('{"name": "get_weather", "argum') == []  # no call before its name and key are whole
    spaced = ' [ {"name": "f", "arguments": { "a" : [1] } } ,\n {"name" : "g","arguments":{}} ]'
    assert structured.scan_calls(spaced) == [("f", '{ "a" : [1] }'), ("g", "{}")]


def test_a_required_call_streams_its_name_first_then_its_arguments_in_pieces(server):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 72, "temperature": 0, "stream": True,
            "tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}
    deltas, finish = [], None
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    deltas += choice["delta"].get("tool_calls") or []
                    finish = choice["finish_reason"] or finish
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""} and deltas[0]["id"].startswith("call_")
    pieces = [d["function"]["arguments"] for d in deltas[1:]]
    assert len(pieces) >= 2 and all("name" not in d["function"] for d in deltas[1:])  # streamed, not held back whole
    whole = _client(server).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=72, temperature=0,
                                                   tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    assert finish == "tool_calls"
    assert json.loads("".join(pieces)) == json.loads(whole.choices[0].message.tool_calls[0].function.arguments)


def test_a_tool_result_is_accepted_in_the_next_turn_and_auto_answers(server):
    client = _client(server)
    first = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=72, temperature=0,
                                           tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    messages = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                           {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                           tools=[WEATHER], tool_choice="auto")
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert (message.tool_calls is not None) == (reply.choices[0].finish_reason == "tool_calls")
    none = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0,
                                          tools=[WEATHER], tool_choice="none")
    assert none.choices[0].message.tool_calls is None


@pytest.mark.parametrize("max_tokens, begun", [(14, False), (26, False), (38, True)])
def test_a_required_call_cut_by_max_tokens_reads_the_same_streamed_or_not(server, max_tokens, begun):
    """A call whose name is whole comes back as a call as far as it went (not as raw JSON in `content` in the
    whole reply while the stream sent a call: found under load); before that, both carry the text."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0,
            "tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}
    whole = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as reply:
        text, calls, finish, _ = assembled_chat_stream(reply.iter_lines())
    assert whole["finish_reason"] == finish == "length"
    assert (whole["message"]["content"] or "") == text
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole["message"].get("tool_calls") or []] == \
        calls
    assert bool(calls) == begun and (not begun or calls[0][0] == "get_weather" and not text)


def test_parallel_calls_are_constrained_to_a_list_of_calls():
    from specdec.serve.structured import FunctionTool, ToolPlan, parse_calls

    plan = ToolPlan((FunctionTool("f", "", {"type": "object", "properties": {"x": {"type": "integer"}}}),
                     FunctionTool("g", "", {"type": "object"})), "required", parallel=True)
    schema = json.loads(plan.grammar().payload)
    jsonschema.validate([{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "h", "arguments": {}}], schema)
    calls = parse_calls('[{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]', plan)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1}), ("g", {})]
    assert parse_calls('<tool_call>{"name": "g", "arguments": {}}</tool_call>', plan)[0].name == "g"
    assert parse_calls("It is sunny.", plan) is None and parse_calls('{"name": "h", "arguments": {}}', plan) is None
