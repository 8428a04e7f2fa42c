"""Structured outputs and tool calls: what a request's fields ask of the grammar, how tools reach the prompt,
and how an answer becomes `tool_calls`.

Accepted grammar fields (one per request): OpenAI's `response_format` (`json_object`, `json_schema`) and
vLLM's `structured_outputs` (`json`, `regex`, `choice`, `grammar`, `json_object`) or its older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`. Each becomes a GrammarSpec
(specdec/runtime/grammar.py), enforced on every row under speculation.

Tools: the chat template renders them where it knows `tools`; otherwise a system message lists them
(vLLM and llama.cpp leave this to the template; small models' templates often have no tool section).
A call is JSON, `{"name": ..., "arguments": {...}}`, or a list of them when parallel calls are allowed
(OpenAI's default). Under `tool_choice` "required" or a named function the answer is constrained to
that shape by a JSON schema built from the tools' parameters, so it always parses; under "auto" the
answer is free and parsed afterwards (a call, or `<tool_call>...</tool_call>` blocks, else text).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from specdec.runtime.grammar import GrammarSpec
from specdec.serve.protocol import APIError

MAX_TOOLS = 128  # OpenAI's limit
GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_OUTPUTS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
TOOL_BLOCK = ("<tool_call>", "</tool_call>")  # Hermes' tags, which several templates ask models to write


def grammar_of(body: Any) -> GrammarSpec | None:
    """Return the GrammarSpec a request's fields ask for (None: free text); raise APIError (400, naming the
    field) for an unknown format, a malformed value or two grammar fields at once."""
    asked: list[tuple[str, GrammarSpec]] = []
    response_format = body.response_format
    if response_format is not None:
        asked += _response_format(response_format)
    for field, kind in GUIDED.items():
        value = getattr(body, field, None)
        if value is not None:
            asked.append((field, _spec(kind, value, field)))
    if body.structured_outputs is not None:
        asked.append(("structured_outputs", _structured_outputs(body.structured_outputs)))
    if len(asked) > 1:
        raise APIError(400, f"ask for one output format at a time, got {' and '.join(f for f, _ in asked)}",
                       param=asked[1][0])
    return asked[0][1] if asked else None


def _response_format(value: Any) -> list[tuple[str, GrammarSpec]]:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise APIError(400, "response_format must be an object with a type", param="response_format")
    kind = value["type"]
    if kind == "text":
        return []
    if kind == "json_object":
        return [("response_format", GrammarSpec.of("json_object"))]
    if kind == "json_schema":
        inner = value.get("json_schema")
        if not isinstance(inner, dict) or not isinstance(inner.get("schema", {}), dict):
            raise APIError(400, "response_format.json_schema must be an object whose schema is a JSON schema",
                           param="response_format.json_schema")
        return [("response_format", GrammarSpec.of("json_schema", inner.get("schema", {})))]
    raise APIError(400, f"response_format type '{kind}' is not supported (use text, json_object or json_schema)",
                   param="response_format.type")


def _structured_outputs(value: Any) -> GrammarSpec:
    if not isinstance(value, dict):
        raise APIError(400, "structured_outputs must be an object", param="structured_outputs")
    if value.get("json_object"):
        return GrammarSpec.of("json_object")
    given = [key for key in STRUCTURED_OUTPUTS if value.get(key) is not None]
    if len(given) != 1:
        raise APIError(400, f"structured_outputs takes one of {', '.join(STRUCTURED_OUTPUTS)} or json_object",
                       param="structured_outputs")
    key = given[0]
    return _spec(STRUCTURED_OUTPUTS[key], value[key], f"structured_outputs.{key}")


def _spec(kind: str, value: Any, field: str) -> GrammarSpec:
    if kind == "json_schema" and isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as err:
            raise APIError(400, f"{field} is not valid JSON: {err}", param=field) from None
    expected = {"json_schema": dict, "regex": str, "grammar": str, "choice": list}[kind]
    if not isinstance(value, expected):
        raise APIError(400, f"{field} must be a {expected.__name__.replace('dict', 'JSON schema object')}",
                       param=field)
    return GrammarSpec.of(kind, value)


@dataclass(frozen=True)
class FunctionTool:
    """One tool of a request: a function's name, description and JSON-schema parameters."""

    name: str
    description: str
    parameters: dict

    def as_openai(self) -> dict[str, Any]:
        """Return the tool as OpenAI's request shape (what chat templates read)."""
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        if not self.description:
            del function["description"]
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolPlan:
    """What a request's `tools`, `tool_choice` and `parallel_tool_calls` ask."""

    tools: tuple[FunctionTool, ...]
    choice: str  # "auto", "required", or the name of the one function to call
    parallel: bool  # several calls in one answer (OpenAI's default)

    @property
    def constrained(self) -> bool:
        """Return True when the answer must be a call ("required" or a named function)."""
        return self.choice != "auto"

    def grammar(self) -> GrammarSpec | None:
        """Return the JSON schema of an answer that is a call (None under "auto": the answer is free)."""
        if not self.constrained:
            return None
        tools = [t for t in self.tools if self.choice in ("required", t.name)]
        calls = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                  "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
        call = calls[0] if len(calls) == 1 else {"anyOf": calls}
        schema = {"type": "array", "items": call, "minItems": 1} if self.parallel else call
        return GrammarSpec.of("json_schema", schema)

    def instructions(self) -> str:
        """Return the system text that lists the tools where the chat template cannot."""
        listed = json.dumps([t.as_openai()["function"] for t in self.tools], ensure_ascii=False, separators=(",", ":"))
        shape = '[{"name": NAME, "arguments": {...}}, ...]' if self.parallel else '{"name": NAME, "arguments": {...}}'
        must = "You must call one." if self.constrained else "Call one only when it helps."
        return f"Functions: {listed}\n{must} To call, answer with only {shape}."


def tool_plan(body: Any) -> ToolPlan | None:
    """Return the ToolPlan of a chat request (None: no tools, or tool_choice "none"); raise APIError for bad tools."""
    tools, choice = body.tools, body.tool_choice
    if not tools:
        if choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise APIError(400, f"tools must be a list of at most {MAX_TOOLS} functions", param="tools")
    parsed = tuple(_tool(tool, i) for i, tool in enumerate(tools))
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise APIError(400, "tools must have distinct names", param="tools")
    if choice in (None, "auto"):
        name = "auto"
    elif choice == "none":
        return None
    elif choice == "required":
        name = "required"
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict) and choice["function"].get("name"):
        name = choice["function"]["name"]
        if name not in names:
            raise APIError(400, f"tool_choice names '{name}', which is not among the tools", param="tool_choice")
    else:
        raise APIError(400, "tool_choice is none, auto, required or {\"type\": \"function\", \"function\": "
                            "{\"name\": ...}}", param="tool_choice")
    parallel = body.parallel_tool_calls is not False and name in ("auto", "required")
    return ToolPlan(parsed, name, parallel)


def _tool(tool: Any, index: int) -> FunctionTool:
    param = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(
            tool.get("function"), dict):
        raise APIError(400, f"{param} must be {{\"type\": \"function\", \"function\": {{...}}}}", param=param)
    function = tool["function"]
    name, parameters = function.get("name"), function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(name, str) or not name or len(name) > 64:
        raise APIError(400, f"{param}.function.name must be a name of 1 to 64 characters", param=f"{param}.function.name")
    if not isinstance(parameters, dict):
        raise APIError(400, f"{param}.function.parameters must be a JSON schema object",
                       param=f"{param}.function.parameters")
    return FunctionTool(name, str(function.get("description") or ""), parameters)


def chat_messages_with_tools(messages: list[dict[str, Any]], plan: ToolPlan | None,
                             template_knows_tools: bool) -> list[dict[str, Any]]:
    """Return the messages the chat template renders: earlier tool calls and tool results as text where the
    template has no tool section, and the tools listed in a system message where it cannot list them."""
    out = []
    for message in messages:
        message = dict(message)
        calls = message.get("tool_calls")
        if calls and not template_knows_tools:
            message["content"] = (message.get("content") or "") + json.dumps(
                [{"name": c["function"]["name"], "arguments": _arguments(c["function"].get("arguments"))}
                 for c in calls], ensure_ascii=False)
            message.pop("tool_calls")
        if message["role"] == "tool" and not template_knows_tools:
            message = {"role": "user", "content": f"Result of call {message.get('tool_call_id') or ''}: "
                                                  f"{message.get('content') or ''}"}
        out.append(message)
    if plan is not None and not template_knows_tools:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{plan.instructions()}"}
        else:
            out.insert(0, {"role": "system", "content": plan.instructions()})
    return out


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


@dataclass(frozen=True)
class ToolCall:
    """One call an answer makes: the function and its arguments as JSON text."""

    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        """Return the call in OpenAI's shape (with `index` in a stream's delta)."""
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def parse_calls(text: str, plan: ToolPlan) -> list[ToolCall] | None:
    """Return the calls an answer makes (None: it is text, not calls): a call object, a list of them, or
    `<tool_call>` blocks each holding one; names must be among the plan's tools."""
    stripped = text.strip()
    if stripped.startswith(TOOL_BLOCK[0]):
        blocks = [part.split(TOOL_BLOCK[1])[0] for part in stripped.split(TOOL_BLOCK[0])[1:]]
        values = [_json(block) for block in blocks]
    else:
        value = _json(stripped)
        values = value if isinstance(value, list) else [value]
    names = {t.name for t in plan.tools}
    calls = []
    for value in values:
        if not isinstance(value, dict) or value.get("name") not in names or not isinstance(
                value.get("arguments", {}), dict):
            return None
        calls.append(ToolCall(value["name"], json.dumps(value.get("arguments", {}), ensure_ascii=False),
                              f"call_{uuid.uuid4().hex[:24]}"))
    return calls or None


def begun_calls(text: str) -> list[ToolCall] | None:
    """Return the calls a constrained answer cut short (by max_tokens) has begun, each with its arguments text
    as far as it went (None: not even a name): what a streamed reply has sent of them by its finish."""
    calls = [ToolCall(name, arguments, f"call_{uuid.uuid4().hex[:24]}") for name, arguments in scan_calls(text)]
    return calls or None


# A constrained call's text up to its arguments, after the comma that separates it from the call before in a list:
# `{"name": "NAME", "arguments": ` (the grammar fixes the key order).
CALL_HEAD = re.compile(r'\s*,?\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def scan_calls(text: str) -> list[tuple[str, str]]:
    """Return (name, arguments text so far) of each call a constrained answer's text has begun, in order.

    For an answer the tool grammar constrains (a call, or a list of them): a call counts once its name and
    the "arguments" key are whole; its arguments grow with the text until their closing brace.

    >>> scan_calls('[{"name": "f", "arguments": {"a": "}"}}, {"name": "g", "argu')
    [('f', '{"a": "}"}')]
    """
    scanner = CallScanner()
    scanner.feed(text)
    return scanner.calls()


@dataclass
class CallScanner:
    """Reads a constrained tool-call answer as it grows, each character once (an answer's arguments may be long)."""

    names: list[str] = field(default_factory=list)  # of the calls begun
    spans: list[tuple[int, int]] = field(default_factory=list)  # each call's arguments: [start, end) so far
    text: str = ""
    _position: int = -1  # where reading goes on (-1: before the answer's first character)
    _reading: bool = False  # inside a call's arguments
    _closing: bool = False  # past a call's arguments, before its own closing brace
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False

    def feed(self, text: str) -> None:
        """Read `text`, the answer so far (what was fed before, and more)."""
        self.text = text
        if self._position < 0:
            stripped = len(text) - len(text.lstrip())
            if stripped == len(text):
                return
            self._position = stripped + (text[stripped] == "[")
        while self._position < len(text):
            if self._reading:
                self._read_arguments()
                self._closing = not self._reading
                continue
            if self._closing:
                if text[self._position].isspace():
                    self._position += 1
                elif text[self._position] == "}":
                    self._position, self._closing = self._position + 1, False
                else:
                    return
                continue
            head = CALL_HEAD.match(text, self._position)
            if head is None:
                return
            first = head.end()
            if first >= len(text):  # the arguments' opening brace has not come yet
                return
            self.names.append(json.loads(f'"{head.group(1)}"'))
            self.spans.append((first, first))
            self._position, self._reading = first, True

    def _read_arguments(self) -> None:
        """Follow the current call's arguments to the text's end or their closing brace."""
        text, index = self.text, self._position
        while index < len(text):
            char = text[index]
            index += 1
            if self._in_string:
                self._escaped, self._in_string = (False, True) if self._escaped else (char == "\\", char != '"')
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._reading = False
                    break
        self.spans[-1] = (self.spans[-1][0], index)
        self._position = index

    def calls(self) -> list[tuple[str, str]]:
        """Return (name, arguments text so far) of each call begun."""
        return [(name, self.text[start:end]) for name, (start, end) in zip(self.names, self.spans)]


@dataclass
class CallStream:
    """Turns a constrained tool-call answer's growing text into OpenAI's streamed `delta.tool_calls`: a call's
    first delta carries its index, id, type and name (arguments ""), the next ones its arguments' new text."""

    scanner: CallScanner = field(default_factory=CallScanner)
    ids: list[str] = field(default_factory=list)  # of the calls announced so far
    sent: list[int] = field(default_factory=list)  # argument characters sent per call

    def deltas(self, text: str) -> list[dict[str, Any]]:
        """Return the deltas that bring a client from what was sent to `text` (the answer so far)."""
        self.scanner.feed(text)
        out = []
        for index, (name, (start, end)) in enumerate(zip(self.scanner.names, self.scanner.spans)):
            if index == len(self.ids):
                self.ids.append(f"call_{uuid.uuid4().hex[:24]}")
                self.sent.append(0)
                out.append({"index": index, "id": self.ids[index], "type": "function",
                            "function": {"name": name, "arguments": ""}})
            if end - start > self.sent[index]:
                out.append({"index": index, "function": {"arguments": text[start + self.sent[index]:end]}})
                self.sent[index] = end - start
        return out

    @property
    def started(self) -> bool:
        """Return whether a call was announced."""
        return bool(self.ids)


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def may_be_calls(text: str) -> bool:
    """Return whether streamed text could still turn out to be calls (held back under "auto" until it is clear)."""
    stripped = text.lstrip()
    return not stripped or stripped[0] in "{[" or TOOL_BLOCK[0].startswith(stripped[:len(TOOL_BLOCK[0])])
