"""OpenAI request bodies (pydantic), the error shape, and the response/chunk builders.

Errors follow OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, as vLLM's
server does. Fields OpenAI defines but specdec cannot honour (best_of > 1, audio, ...)
are refused with a 400 naming the field, never silently ignored; fields it does not know
are ignored, as OpenAI's own clients add new ones over time.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

MAX_STOP_STRINGS = 16  # OpenAI allows 4, vLLM any number; evaluation harnesses send 5 or more (a task's stops and EOS)
MAX_CHOICES = 16  # n: each choice is a generation of its own (a KV slot, an admission place)
MAX_PROMPTS = 32  # completions' prompt list (an evaluation harness's batch)
MAX_REQUEST_CHOICES = 64  # prompts x n
MAX_STOP_LENGTH = 256  # characters per stop string
MAX_MESSAGES = 512  # chat messages per request
MAX_LOGIT_BIAS = 300  # logit_bias entries per request
MAX_STOP_TOKEN_IDS = 64
# OpenAI fields that change nothing a text-only, single-server model does: accepted and ignored
# (docs/SERVE.md lists them).
IGNORED_FIELDS = ("user", "metadata", "store", "service_tier", "prompt_cache_key",
                  "safety_identifier", "reasoning_effort", "verbosity")


class APIError(Exception):
    """An error answered in OpenAI's shape with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """Return the JSON body: {"error": {message, type, param, code}}."""
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | int | None = None) -> dict[str, Any]:
    """Return OpenAI's error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: StrictStr
    text: StrictStr | None = None


class Prediction(BaseModel):
    """OpenAI's Predicted Outputs: the text the answer is expected to be (`{"type": "content", "content": ...}`)."""

    type: Literal["content"]
    content: Union[StrictStr, list[TextPart]]

    def text(self) -> str:
        """Return the predicted text (text parts joined); raise APIError for a part that is not text."""
        if isinstance(self.content, str):
            return self.content
        if any(part.type != "text" or part.text is None for part in self.content):
            raise APIError(400, "prediction.content: only text parts are supported", param="prediction.content")
        return "".join(part.text or "" for part in self.content)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: StrictStr
    content: Union[StrictStr, list[TextPart], None] = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: StrictStr | None = None  # a tool result's call


class _Common(BaseModel):
    """Fields both endpoints share, with specdec's own knobs as extra body fields."""

    model_config = ConfigDict(extra="ignore")
    ECHOES: ClassVar[bool] = False  # whether `echo` (the prompt, and its logprobs, ahead of the answer) is served
    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=0)  # 0: only with echo (the prompt scored, no answer)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(default=None, ge=-1)  # vLLM's extension; -1 and 0 mean off
    seed: StrictInt | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)  # vLLM's extension
    repetition_penalty: float | None = Field(default=None, ge=0.01, le=10.0)  # vLLM's extension
    logit_bias: dict[StrictStr, float] | None = None  # {"token id": -100..100}
    stop: Union[StrictStr, list[StrictStr], None] = None
    stop_token_ids: list[StrictInt] | None = None  # vLLM's extension: these tokens end the answer
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # specdec's knobs (extra_body in the openai client)
    num_draft_tokens: Union[StrictInt, Literal["auto"], None] = None  # K
    drafter: Literal["auto", "model", "ngram", "none", "eagle", "ngram+model", "ngram+eagle"] | None = None
    specdec_stats: StrictBool | None = None  # include this request's speculative stats
    specdec_tokens: StrictBool | None = None  # stream each token's text and how it came (the page at /)
    # vLLM's: the prefix cache reuses KV only between requests of the same salt (tenants that must not time each
    # other's prompts); checked by GenerationConfig (1 to 256 characters)
    cache_salt: StrictStr | None = None
    # OpenAI fields specdec refuses unless they hold their neutral value (see unsupported())
    # Same shape as the vLLM block below by design: pydantic reads the request schema from one declaration per field.
    # n choices: n generations of the prompt (each its own slot; a sampled one seeded seed + i where seed is set)
    n: StrictInt | None = Field(default=None, ge=1, le=MAX_CHOICES)
    best_of: StrictInt | None = None
    # chat: true/false (with top_logprobs 0..20); completions: the number of alternatives, 0..5
    logprobs: Union[StrictBool, StrictInt, None] = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    response_format: Any = None
    tools: Any = None  # checked by specdec/serve/structured.py (tool_plan)
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    functions: Any = None
    function_call: Any = None
    echo: StrictBool | None = None
    suffix: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Prediction | None = None
    web_search_options: Any = None
    # vLLM's extensions that would change the answer and are not implemented (declared like OpenAI's above)
    ignore_eos: StrictBool | None = None
    min_tokens: StrictInt | None = None
    use_beam_search: StrictBool | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None

    def unsupported(self) -> tuple[str, str] | None:
        """Return (field, reason) for the first field set to a value specdec cannot serve, else None."""
        checks = [
            ("best_of", self.best_of not in (None, 1), "only best_of=1 is supported"),
            ("functions", bool(self.functions), "functions are not supported"),
            ("function_call", self.function_call not in (None, "none", "auto"), "function_call is not supported"),
            ("echo", bool(self.echo) and not self.ECHOES, "echo is only supported on /v1/completions"),
            ("suffix", bool(self.suffix), "suffix is not supported"),
            ("audio", self.audio is not None, "audio output is not supported"),
            ("modalities", self.modalities not in (None, ["text"]), "only the text modality is supported"),
            ("web_search_options", self.web_search_options is not None, "web search is not supported"),
            ("ignore_eos", bool(self.ignore_eos), "ignore_eos is not supported"),
            ("min_tokens", self.min_tokens not in (None, 0), "min_tokens is not supported"),
            ("use_beam_search", bool(self.use_beam_search), "beam search is not supported"),
        ]
        return next(((field, reason) for field, bad, reason in checks if bad), None)

    def alternatives(self, chat: bool) -> int | None:
        """Return how many alternatives each token's logprobs list (None: no logprobs); raise APIError for a
        combination OpenAI refuses (top_logprobs without logprobs; completions' logprobs above 5)."""
        if chat:
            if self.logprobs not in (None, True, False):
                raise APIError(400, "logprobs is true or false on chat completions (top_logprobs gives the count)",
                               param="logprobs")
            if self.top_logprobs is not None and not self.logprobs:
                raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
            return (self.top_logprobs or 0) if self.logprobs else None
        if self.logprobs is None or self.logprobs is False:
            return None
        if self.logprobs is True or not 0 <= self.logprobs <= 5:
            raise APIError(400, "logprobs on completions is the number of alternatives, 0..5", param="logprobs")
        return self.logprobs

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """Return logit_bias as (token id, bias) pairs; raise APIError for a key that is not a token id, a bias
        outside [-100, 100] or too many entries."""
        bias = self.logit_bias or {}
        if len(bias) > MAX_LOGIT_BIAS:
            raise APIError(400, f"logit_bias takes at most {MAX_LOGIT_BIAS} entries", param="logit_bias")
        pairs = []
        for key, value in bias.items():
            if not key.isdigit():
                raise APIError(400, f"logit_bias keys are token ids, got '{key[:32]}'", param="logit_bias")
            if not -100.0 <= value <= 100.0:
                raise APIError(400, f"logit_bias values are in [-100, 100], got {value} for token {key}",
                               param="logit_bias")
            pairs.append((int(key), float(value)))
        return tuple(pairs)

    def stop_strings(self) -> tuple[str, ...]:
        """Return the stop strings as a tuple (empty strings dropped)."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return tuple(s for s in stops if s)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)  # OpenAI's newer name for max_tokens


class CompletionRequest(_Common):
    ECHOES: ClassVar[bool] = True
    # one prompt (text or token ids) or a list of them (up to MAX_PROMPTS): choice i * n + j is prompt i's j-th
    prompt: Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]


class TokenizeRequest(BaseModel):
    """vLLM's POST /tokenize: a prompt, or chat messages through the chat template."""

    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = None  # None: True for a prompt, False for messages (vLLM's defaults)
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False


class DetokenizeRequest(BaseModel):
    """vLLM's POST /detokenize: token ids back to text."""

    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    tokens: list[StrictInt]


CHAT_ROLES = ("system", "user", "assistant", "tool")


def chat_messages(request: ChatCompletionRequest | TokenizeRequest) -> list[dict[str, Any]]:
    """Return the messages as {role, content} strings (an assistant's tool_calls and a tool result's tool_call_id
    kept) for the chat template; raise APIError for what it cannot take."""
    if not request.messages:
        raise APIError(400, "messages must not be empty", param="messages")
    out = []
    for i, message in enumerate(request.messages):
        if message.role not in CHAT_ROLES:
            raise APIError(400, f"messages[{i}].role '{message.role}' is not supported (use one of "
                                f"{', '.join(CHAT_ROLES)})", param=f"messages[{i}].role")
        content = message.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise APIError(400, f"messages[{i}].content: only text parts are supported",
                               param=f"messages[{i}].content")
            content = "".join(part.text or "" for part in content)
        entry: dict[str, Any] = {"role": message.role, "content": content or ""}
        if message.tool_calls and message.role == "assistant":
            if not all(isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
                       for c in message.tool_calls):
                raise APIError(400, f"messages[{i}].tool_calls: each needs a function with a name",
                               param=f"messages[{i}].tool_calls")
            entry["tool_calls"] = message.tool_calls
        if message.role == "tool":
            # OpenAI's rule: a result answers a call, so it follows the assistant turn that made the calls
            if not out or not (out[-1].get("tool_calls") or out[-1]["role"] == "tool"):
                raise APIError(400, f"messages[{i}]: a 'tool' message must follow an assistant message with "
                                    "tool_calls (or another tool result)", param=f"messages[{i}].role")
            entry["tool_call_id"] = message.tool_call_id or ""
        out.append(entry)
    return out


def new_id(prefix: str) -> str:
    """Return a fresh response id such as 'chatcmpl-3f2a...'."""
    return f"{prefix}-{uuid.uuid4().hex}"


# Which process answered (one Ray replica from another); OpenAI's field for the serving configuration.
SYSTEM_FINGERPRINT = f"specdec-{os.getpid()}"

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "max_positions": "length"}


def usage(prompt_tokens: int, completion_tokens: int,
          prediction_tokens: tuple[int, int] | None = None) -> dict[str, Any]:
    """Return OpenAI's usage object; with `prediction_tokens` (accepted, rejected), its completion_tokens_details."""
    body: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                            "total_tokens": prompt_tokens + completion_tokens}
    if prediction_tokens is not None:
        accepted, rejected = prediction_tokens
        body["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                             "rejected_prediction_tokens": rejected, "reasoning_tokens": 0}
    return body


def response_choice(chat: bool, index: int, text: str, finish: str, logprobs: dict[str, Any] | None = None,
                    tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Return one choice of a non-streamed body (`logprobs`: OpenAI's shape; `tool_calls`: the calls the answer
    makes, which replace its text)."""
    if chat:
        message = ({"role": "assistant", "content": None, "tool_calls": tool_calls} if tool_calls
                   else {"role": "assistant", "content": text})
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def completion_response(chat: bool, id: str, model: str, choices: list[dict[str, Any]], usage_: dict[str, Any],
                        extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Return a non-streamed chat.completion or text_completion body of `choices` (response_choice's)."""
    body = {"id": id, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "system_fingerprint": SYSTEM_FINGERPRINT, "choices": choices, "usage": usage_}
    return {**body, **(extra or {})}


def total_usage(prompt_tokens: int, usages: list[dict[str, Any]]) -> dict[str, Any]:
    """Return the usage of a request's choices: `prompt_tokens` (each prompt counted once), completions summed."""
    if len(usages) == 1:
        return usages[0]
    details = [u["completion_tokens_details"] for u in usages if "completion_tokens_details" in u]
    predicted = (sum(d["accepted_prediction_tokens"] for d in details),
                 sum(d["rejected_prediction_tokens"] for d in details)) if details else None
    return usage(prompt_tokens, sum(u["completion_tokens"] for u in usages), predicted)


def chunk(chat: bool, id: str, created: int, model: str, text: str | None = None, finish: str | None = None,
          role: bool = False, usage_: dict[str, Any] | None = None, extra: dict[str, Any] | None = None,
          logprobs: dict[str, Any] | None = None, tool_calls: list[dict[str, Any]] | None = None,
          index: int = 0) -> dict:
    """Return one streamed chunk of choice `index`; with `usage_` and no text/finish it is the usage-only last
    chunk; `tool_calls` (each with its index) go in the delta."""
    if usage_ is not None and text is None and finish is None and tool_calls is None:
        choices: list[dict] = []
    elif chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choices = [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]
    else:
        choices = [{"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}]
    body = {"id": id, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "system_fingerprint": SYSTEM_FINGERPRINT, "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    return {**body, **(extra or {})}


def token_kinds(drafted: int, num_accepted: int, committed: int, is_bonus: bool, rejected: bool) -> list[str]:
    """Return how each committed token of one iteration came: "accepted" (a draft that passed), then the last
    one "bonus" (row K+1 after every draft passed), "recovered" (drawn after a rejection) or "plain" (no draft)."""
    kinds = ["accepted"] * min(num_accepted, committed)
    if committed > len(kinds):
        kinds.append("bonus" if drafted and is_bonus else "recovered" if drafted and rejected else "plain")
    return kinds


def openapi_schema() -> dict[str, Any]:
    """Return an OpenAPI 3.1 document of the routes, the request bodies taken from the pydantic models
    (the routes read their bodies themselves, to answer every bad one in OpenAI's error shape)."""
    error = {"description": "OpenAI's error object", "content": {"application/json": {"schema": {"type": "object"}}}}
    ok = {"description": "OK", "content": {"application/json": {"schema": {"type": "object"}}}}

    def post(model: type[BaseModel], summary: str) -> dict[str, Any]:
        return {"post": {"summary": summary, "requestBody": {"required": True, "content": {
            "application/json": {"schema": model.model_json_schema(ref_template="#/components/schemas/{model}")}}},
            "responses": {"200": ok, "400": error}}}

    def get(summary: str, parameters: list | None = None) -> dict[str, Any]:
        return {"get": {"summary": summary, "parameters": parameters or [], "responses": {"200": ok}}}

    schemas: dict[str, Any] = {}
    for model in (ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest):
        schemas.update(model.model_json_schema(ref_template="#/components/schemas/{model}").get("$defs", {}))
    paths = {
        "/v1/chat/completions": post(ChatCompletionRequest, "A chat completion, streamed (SSE) or not"),
        "/v1/completions": post(CompletionRequest, "A text completion, streamed (SSE) or not"),
        "/tokenize": post(TokenizeRequest, "Token ids of a prompt or of chat messages (vLLM's)"),
        "/detokenize": post(DetokenizeRequest, "Text of token ids (vLLM's)"),
        "/tokenizer_info": get("The tokenizer's special tokens and chat template (vLLM's)"),
        "/v1/models": get("The served model"),
        "/v1/models/{model_id}": get("One model by id", [
            {"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}]),
        "/health": get("200 when ready, 503 while loading or draining"),
        "/metrics": get("Prometheus text"),
    }
    for path in paths.values():  # pydantic's $defs live in components
        for operation in path.values():
            body = operation.get("requestBody", {}).get("content", {}).get("application/json", {})
            body.get("schema", {}).pop("$defs", None)
    return {"openapi": "3.1.0", "info": {"title": "specdec", "version": "1"}, "paths": paths,
            "components": {"schemas": schemas}}
