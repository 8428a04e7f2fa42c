"""The structured-output benchmark's workloads and their validity checks (pure: no I/O beyond reading the set).

Three workloads, one JSON-lines set (specdec/data/structured-heldout.jsonl), each row {"id", "workload", ...}:
- extract: {"prompt", "response_format"}: a passage and what to pull out of it, answered under a strict JSON
  schema (OpenAI's `response_format: {"type": "json_schema", ...}`); valid when the answer parses and the
  schema validates it (`jsonschema`).
- tools: {"prompt", "tools", "tool_choice", "parallel_tool_calls" (default false)}: a request and the functions
  that can serve it; valid when every call names one of the tools and its arguments parse and validate against
  that tool's parameters.
- edit: {"instruction", "original"}: a snippet and a small change to make; the request sends the original
  as OpenAI's Predicted Outputs `prediction`. Greedy decoding must not change the answer, so an edit is valid
  when its text equals specdec's target-only text of the same request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from specdec.data import PROMPTS_FILE
from specdec.runtime.prompts import PromptCase, read_json_lines

STRUCTURED_FILE = PROMPTS_FILE.with_name("structured-heldout.jsonl")  # shipped beside the prompt sets
WORKLOADS = ("extract", "tools", "edit")
# max_tokens per workload: an extraction's JSON, one or two calls, a whole edited snippet (at most ~400 tokens)
MAX_TOKENS = {"extract": 256, "tools": 192, "edit": 512}


@dataclass(frozen=True)
class StructuredItem:
    """One request of a workload: the user's message and the OpenAI body fields that structure its answer."""

    id: str
    workload: str  # one of WORKLOADS
    prompt: str  # the user message
    response_format: dict | None = None  # extract
    tools: tuple[dict, ...] = ()  # tools: OpenAI's {"type": "function", "function": {name, description, parameters}}
    tool_choice: Any = None
    parallel_tool_calls: bool = False  # each request of the set asks for one call
    prediction: str | None = None  # edit: the original text, sent as the prediction
    extra: dict = field(default_factory=dict, compare=False)  # the row's other keys, kept for the record

    def case(self) -> PromptCase:
        """Return the item as serve_load's PromptCase (its id and user message)."""
        return PromptCase(self.id, self.workload, self.prompt)

    def schema(self) -> dict | None:
        """Return the JSON schema an extract answer must meet (None for other workloads)."""
        if not self.response_format:
            return None
        return (self.response_format.get("json_schema") or {}).get("schema")


def load_items(path: str | Path = STRUCTURED_FILE) -> list[StructuredItem]:
    """Return the items of a structured-workload JSON-lines file; raise SpecdecError naming the first bad line."""
    return read_json_lines(path, "workload", lambda row, number: _item(row))


def _item(row: dict) -> StructuredItem:
    workload, id_ = row["workload"], str(row["id"])
    known = {"id", "workload", "prompt", "response_format", "tools", "tool_choice", "parallel_tool_calls",
             "instruction", "original"}
    extra = {k: v for k, v in row.items() if k not in known}
    if workload == "extract":
        if (row["response_format"].get("type") != "json_schema"
                or not isinstance(row["response_format"]["json_schema"]["schema"], dict)):
            raise ValueError(f"item '{id_}': response_format must be a json_schema with a schema")
        return StructuredItem(id_, workload, str(row["prompt"]), response_format=row["response_format"], extra=extra)
    if workload == "tools":
        tools = tuple(row["tools"])
        if not tools or any(t["type"] != "function" or not t["function"]["name"] for t in tools):
            raise ValueError(f"item '{id_}': tools must be a list of functions with names")
        return StructuredItem(id_, workload, str(row["prompt"]), tools=tools,
                              tool_choice=row.get("tool_choice", "required"),
                              parallel_tool_calls=bool(row.get("parallel_tool_calls", False)), extra=extra)
    if workload == "edit":
        original = str(row["original"])
        # the original follows the instruction as it stands (no fences), so the answer can copy it verbatim
        return StructuredItem(id_, workload, f"{row['instruction']}\n\n{original}", prediction=original, extra=extra)
    raise ValueError(f"item '{id_}': unknown workload '{workload}' (use {', '.join(WORKLOADS)})")


def request_fields(item: StructuredItem, plain: bool = False) -> dict[str, Any]:
    """Return the body fields an item adds to its chat completion request.

    `plain`: a server that is not specdec (llama-server, vLLM): neither has Predicted Outputs (vLLM's PR was
    closed unmerged, llama.cpp has none), so an edit goes without its prediction there.
    """
    if item.workload == "extract":
        return {"response_format": item.response_format}
    if item.workload == "tools":
        return {"tools": list(item.tools), "tool_choice": item.tool_choice,
                "parallel_tool_calls": item.parallel_tool_calls}
    return {} if plain or item.prediction is None else {"prediction": {"type": "content", "content": item.prediction}}


def check_json(text: str, schema: Mapping[str, Any]) -> str | None:
    """Return None when `text` is one JSON value that `schema` validates, else why not (one line)."""
    import jsonschema

    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        return f"not JSON: {err.msg} at character {err.pos}"
    validator = jsonschema.validators.validator_for(schema)(schema)
    error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    if error is not None:
        where = "/".join(str(part) for part in error.absolute_path)
        return f"schema: {error.message[:160]}" + (f" (at {where})" if where else "")
    return None


def check_tool_calls(calls: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]) -> str | None:
    """Return None when there is at least one call and each names one of `tools` with arguments that parse and
    validate against its parameters; else why not.

    calls: [{"name", "arguments"}] as merged from a stream (serve_load_client.merge_tool_call_deltas), or
    OpenAI's [{"function": {"name", "arguments"}}].
    """
    if not calls:
        return "no tool call"
    parameters = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    for number, call in enumerate(calls):
        function = call.get("function", call)
        name = function.get("name")
        if name not in parameters:
            return f"call {number}: '{name}' is not one of the tools ({', '.join(parameters)})"
        reason = check_json(function.get("arguments") or "", parameters[name])
        if reason is not None:
            return f"call {number} ({name}) arguments: {reason}"
    return None


def check_edit(text: str, reference: str | None) -> str | None:
    """Return None when an edit's text equals the reference (target-only, greedy), else why not."""
    if reference is None:
        return "no target-only text of this request to compare with"
    if text == reference:
        return None
    at = next((i for i, (a, b) in enumerate(zip(text, reference)) if a != b), min(len(text), len(reference)))
    return f"differs from target-only at character {at} ({len(text)} vs {len(reference)} characters)"


def check_answer(item: StructuredItem, text: str, tool_calls: Sequence[Mapping[str, Any]],
                 reference: str | None = None) -> str | None:
    """Return None when an answer to `item` is valid for its workload (see the module's docstring), else why not."""
    if item.workload == "extract":
        return check_json(text, item.schema() or {})
    if item.workload == "tools":
        return check_tool_calls(tool_calls, item.tools)
    return check_edit(text, reference)
