"""The load generator's client side: one streamed chat (or text) completion timed chunk by chunk, a closed-loop
round (N clients, each sending its next request when the last one ended) and an open-loop round
(requests sent at scheduled times whatever is still running, stopped at a deadline)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from specdec.runtime.prompts import PromptCase

REQUEST_TIMEOUT = 300.0


@dataclass
class Record:
    """One request as the client saw it."""

    prompt_id: str
    ok: bool
    ttft: float | None = None  # seconds from sending to the first non-empty text piece
    e2e: float | None = None  # seconds from sending to the end of the stream
    tokens: int = 0  # completion tokens (the usage chunk)
    text: str = ""
    error: str | None = None
    target_calls: int = 0  # from the response's speculative stats
    drafted: int = 0
    accepted: int = 0
    sent: float | None = None  # open loop: seconds from the round's start to sending
    chunk_times: list[float] = field(default_factory=list)  # seconds from sending to each chunk with text
    # completion tokens so far reported with each text chunk (vLLM's continuous_usage_stats); empty if not
    chunk_tokens: list[int] = field(default_factory=list)
    tool_calls: list[dict] = field(default_factory=list)  # the streamed delta.tool_calls, merged per index
    finish_reason: str | None = None
    prediction_tokens: tuple[int, int] | None = None  # usage's (accepted, rejected) prediction tokens, if given
    stats: dict = field(default_factory=dict)  # the response's "specdec" object (specdec_stats), as sent
    prompt_tokens: int | None = None  # usage's prompt tokens, as the server counted them
    started: float | None = None  # time.perf_counter() when it was sent (chunk_times count from here)


def merge_tool_call_deltas(calls: list[dict], deltas: Sequence[dict]) -> None:
    """Fold one chunk's `delta.tool_calls` into `calls` (OpenAI's streamed shape: the first delta of a call
    carries its index, id and name; later ones append pieces of `function.arguments`).

    E.g. [] + [{"index": 0, "function": {"name": "f", "arguments": "{\"a\""}}] + [{"index": 0, "function":
    {"arguments": ": 1}"}}] -> [{"id": None, "name": "f", "arguments": "{\"a\": 1}"}].
    """
    for delta in deltas:
        index = delta.get("index", len(calls))
        while len(calls) <= index:
            calls.append({"id": None, "name": "", "arguments": ""})
        function = delta.get("function") or {}
        calls[index]["id"] = delta.get("id") or calls[index]["id"]
        calls[index]["name"] += function.get("name") or ""
        calls[index]["arguments"] += function.get("arguments") or ""


def parse_sse_line(line: str) -> dict | None:
    """Return the JSON object of one `data: {...}` SSE line; None for [DONE], comments and blanks."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return None
    return json.loads(line[len("data: "):])


async def one_request(client, url: str, model: str | None, case: PromptCase, drafter: str,
                      max_tokens: int, num_draft_tokens: str | None, plain: bool = False,
                      extra: Mapping[str, Any] | None = None, record: Record | None = None) -> Record:
    """Send one greedy streamed chat completion and time each chunk of text or tool-call arguments; return its
    record (never raises: errors are recorded).

    `plain`: a server that is not specdec (llama-server, vLLM): only OpenAI's own fields are sent.
    `extra`: fields added to the body (response_format, tools, prediction, messages, ...), as given.
    `record`: the record to fill (a caller may watch its chunk_times grow while the answer streams).
    """
    # continuous_usage_stats: vLLM then reports the running token count with every chunk, so a chunk of
    # several tokens counts as several gaps (serve_load_stats.inter_token_latencies); others ignore it
    body: dict[str, Any] = {"messages": [{"role": "user", "content": case.prompt}], "max_tokens": max_tokens,
                            "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if not plain:
        # each decoding's own prefix-cache namespace: a round sends every decoding the same prompts, and the second
        # would find them cached where a server running one decoding (the anchors) does not
        body.update(drafter=drafter, specdec_stats=True, cache_salt=f"decoding-{drafter}")
    if model:
        body["model"] = model
    body.update(extra or {})
    if num_draft_tokens is not None and not plain:
        body["num_draft_tokens"] = num_draft_tokens if num_draft_tokens == "auto" else int(num_draft_tokens)
    return await stream_request(client, url + "/v1/chat/completions", body, plain,
                                record if record is not None else Record(case.id, ok=False))


async def one_completion(client, url: str, model: str | None, prompt_id: str, prompt: str, max_tokens: int,
                         plain: bool = False) -> Record:
    """Send one greedy streamed text completion of the raw `prompt` (/v1/completions: no chat template) and
    return its record, `prompt_tokens` as the server reported them (never raises)."""
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}}
    if not plain:
        body["drafter"] = "none"  # the target's own prefill, no draft model's beside it
    if model:
        body["model"] = model
    return await stream_request(client, url + "/v1/completions", body, plain, Record(prompt_id, ok=False))


async def stream_request(client, endpoint: str, body: Mapping[str, Any], plain: bool, record: Record) -> Record:
    """POST `body` to `endpoint` as a stream, time each chunk with text (chat's delta.content, completions' text)
    or tool-call arguments into `record`, and return it (never raises: errors are recorded)."""
    pieces: list[str] = []
    start = record.started = time.perf_counter()
    try:
        # A fresh connection per request for other servers: llama-server drops idle keep-alive connections,
        # and a request sent on one it just closed fails without a response.
        headers = {"Connection": "close"} if plain else None
        async with client.stream("POST", endpoint, json=body, headers=headers, timeout=REQUEST_TIMEOUT) as reply:
            if reply.status_code != 200:
                record.error = f"HTTP {reply.status_code}: {(await reply.aread())[:200]!r}"
                return record
            async for line in reply.aiter_lines():
                event = parse_sse_line(line)
                if event is None:
                    continue
                if "error" in event:
                    record.error = str(event["error"].get("message"))
                    return record
                _read_event(event, time.perf_counter() - start, record, pieces)
    except Exception as err:  # a timeout or a dropped connection is a failed request, not a crash
        record.error = f"{type(err).__name__}: {err}"
        return record
    record.e2e = time.perf_counter() - start
    record.ttft = record.chunk_times[0] if record.chunk_times else None
    if len(record.chunk_tokens) != len(record.chunk_times):  # counts on some chunks only: not usable
        record.chunk_tokens = []
    record.text = "".join(pieces)
    record.ok = True
    return record


def _read_event(event: dict, now: float, record: Record, pieces: list[str]) -> None:
    """Fold one streamed event, received `now` seconds after sending, into `record` (text into `pieces`)."""
    choices = event.get("choices", [])
    text = "".join((choice.get("delta") or {}).get("content") or choice.get("text") or "" for choice in choices)
    calls = [call for choice in choices for call in (choice.get("delta") or {}).get("tool_calls") or []]
    merge_tool_call_deltas(record.tool_calls, calls)
    # a tool call's text is its arguments: their chunks time the answer as content chunks do
    if text or any((call.get("function") or {}).get("arguments") for call in calls):
        record.chunk_times.append(now)
        pieces.append(text)
        if (event.get("usage") or {}).get("completion_tokens") is not None:
            record.chunk_tokens.append(event["usage"]["completion_tokens"])
    for choice in choices:
        record.finish_reason = choice.get("finish_reason") or record.finish_reason
    if event.get("usage"):
        record.tokens = event["usage"].get("completion_tokens") or 0
        record.prompt_tokens = event["usage"].get("prompt_tokens", record.prompt_tokens)
        details = event["usage"].get("completion_tokens_details") or {}
        if "accepted_prediction_tokens" in details:
            record.prediction_tokens = (details["accepted_prediction_tokens"],
                                        details.get("rejected_prediction_tokens", 0))
    stats = event.get("specdec")
    if stats:
        record.stats = stats
        record.target_calls = stats.get("target_calls", 0)
        record.drafted = stats.get("drafted", 0)
        record.accepted = stats.get("accepted", 0)


def http_client(connections: int | None):
    """Return an httpx.AsyncClient for loopback (no proxy from the environment) with at most `connections`."""
    import httpx

    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(limits=limits, trust_env=False)


async def run_round(url: str, model: str | None, cases: Sequence[PromptCase], drafter: str, concurrency: int,
                    requests: int, offset: int, max_tokens: int, num_draft_tokens: str | None, plain: bool = False,
                    extras: Mapping[str, Mapping[str, Any]] | None = None) -> tuple[list[Record], float]:
    """Run `requests` requests with `concurrency` closed-loop clients; return the records and the wall time.

    `extras`: body fields per case id, added to that case's requests (one_request's `extra`)."""
    queue = list(range(offset, offset + requests))
    records: list[Record] = []
    async with http_client(concurrency) as client:
        async def worker() -> None:
            while queue:
                index = queue.pop(0)
                case = cases[index % len(cases)]
                records.append(await one_request(client, url, model, case, drafter, max_tokens, num_draft_tokens,
                                                 plain, (extras or {}).get(case.id)))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return records, time.perf_counter() - start


async def run_open_round(url: str, model: str | None, cases: Sequence[PromptCase], drafter: str,
                         arrivals: Sequence[float], offset: int, max_tokens: int, num_draft_tokens: str | None,
                         plain: bool = False, deadline: float = float("inf")) -> tuple[list[Record], float, int]:
    """Send request i at `arrivals[i]` seconds after the start, whatever is still running (open loop).

    `deadline` (a time.perf_counter() value) ends the round: no request is sent after it, and requests
    still streaming then are cancelled and recorded as failed. Return the records (in send order), the
    wall time from the first send to the last end (or the deadline), and how many were never sent.
    """
    async with http_client(None) as client:  # no connection cap: the schedule, not a pool, sets the load
        start = time.perf_counter()
        sent: list[tuple[Record, asyncio.Task]] = []
        for i, at in enumerate(arrivals):
            if start + at > deadline:
                break
            # absolute times: a late send does not push the later ones back (vLLM sleeps gap after gap)
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            case = cases[(offset + i) % len(cases)]
            placeholder = Record(case.id, ok=False, sent=time.perf_counter() - start)
            sent.append((placeholder, asyncio.create_task(
                one_request(client, url, model, case, drafter, max_tokens, num_draft_tokens, plain))))
        tasks = [task for _, task in sent]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        seconds = time.perf_counter() - start
    records = []
    for placeholder, task in sent:
        if task.cancelled():
            placeholder.error = "cancelled at the time limit"
            records.append(placeholder)
        else:
            record = task.result()
            record.sent = placeholder.sent
            records.append(record)
    return records, seconds, len(arrivals) - len(sent)
