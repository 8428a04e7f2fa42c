"""The load generator's scenarios, client side: multi-turn conversations (closed loop), a burst of new prompts
beside requests already streaming, and single raw prompts for prefill speed.

Every scenario numbers its prompts ("Request 17: ..."), the same numbers on every server: prefix caches
(specdec's --prefix-cache, llama-server's cache_prompt, vLLM's prefix caching) would otherwise serve a prompt
sent before (by an earlier round or another drafter) from its cache, and a first turn or a burst would not cost
what a new one does.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Sequence

from specdec.benchmarks.serve_load_client import REQUEST_TIMEOUT, Record, http_client, one_completion, one_request
from specdec.benchmarks.serve_load_stats import window_gaps
from specdec.runtime.prompts import PromptCase

# Turn 2 onwards asks one of these; conversation n's turn t asks FOLLOW_UPS[(n + t - 2) % len(FOLLOW_UPS)].
FOLLOW_UPS = (
    "Can you say that again in fewer words?",
    "Thanks. What is the most important point in your answer, and why?",
    "Please give one concrete example of that.",
    "Could you turn your answer into a short numbered list?",
    "What would a skeptic say about your answer?",
    "Explain the same thing to a ten year old.",
)

# Prompts a small chat model answers at length: the running requests of a burst stream through its window.
LONG_PROMPTS = (
    "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle, and tell what "
    "happens on every day of the week that follows.",
    "Explain step by step, in detail, how a bill becomes a law, with an example for each step.",
    "Write a detailed guide to growing vegetables at home: soil, seeds, watering, pests and the harvest.",
    "Describe the history of the bicycle from its invention to today, decade by decade.",
)


@dataclass(frozen=True)
class RequestSettings:
    """What every request of a scenario cell sends, whatever its role."""

    model: str | None  # the model id sent (None: the server's)
    drafter: str
    max_tokens: int
    num_draft_tokens: str | None  # K (None: the server's)
    plain: bool  # a server that is not specdec: OpenAI's fields only


def numbered(prompt: str, number: int) -> str:
    """Return `prompt` as request `number` sends it: "Request 17: <prompt>" (no server has it cached)."""
    return f"Request {number}: {prompt}"


def follow_up(conversation: int, turn: int) -> str:
    """Return the user's message of `turn` (2, 3, ...) in conversation `conversation`; conversations side by
    side ask different ones, and no conversation asks one twice while turns < len(FOLLOW_UPS) + 2."""
    return FOLLOW_UPS[(conversation + turn - 2) % len(FOLLOW_UPS)]


def turn_messages(first: str, answers: Sequence[str], follow_ups: Sequence[str]) -> list[dict[str, str]]:
    """Return the chat messages of turn len(answers) + 1: the first user message, then each earlier answer as
    the assistant's message followed by its follow-up as the user's.

    E.g. ("Hi", ["Hello!"], ["And?"]) -> [user Hi, assistant Hello!, user And?].
    """
    if len(answers) != len(follow_ups):
        raise ValueError(f"one follow-up per answer: got {len(answers)} answers, {len(follow_ups)} follow-ups")
    messages = [{"role": "user", "content": first}]
    for answer, question in zip(answers, follow_ups):
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": question}]
    return messages


async def run_conversations(url: str, cases: Sequence[PromptCase], numbers: Sequence[int], turns: int,
                            clients: int, settings: RequestSettings,
                            think_seconds: float = 0.0) -> tuple[dict[int, list[Record]], float]:
    """Run conversation n for each n in `numbers` with `clients` closed-loop clients: each turn is sent
    `think_seconds` after the last one ended, with the streamed answers so far; return ({turn: records}, wall
    seconds).

    Conversation n opens with numbered(cases[n % len(cases)].prompt, n); a failed turn ends it."""
    queue = list(numbers)
    by_turn: dict[int, list[Record]] = {t: [] for t in range(1, turns + 1)}
    async with http_client(clients) as client:
        async def worker() -> None:
            while queue:
                number = queue.pop(0)
                case = cases[number % len(cases)]
                answers: list[str] = []
                for turn in range(1, turns + 1):
                    questions = [follow_up(number, t) for t in range(2, turn + 1)]
                    messages = turn_messages(numbered(case.prompt, number), answers, questions)
                    record = await one_request(
                        client, url, settings.model, PromptCase(f"{case.id}/r{number}/t{turn}", case.group, ""),
                        settings.drafter, settings.max_tokens, settings.num_draft_tokens, settings.plain,
                        {"messages": messages})
                    by_turn[turn].append(record)
                    if not record.ok:
                        break
                    answers.append(record.text)
                    if turn < turns and think_seconds:
                        await asyncio.sleep(think_seconds)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        return by_turn, time.perf_counter() - start


@dataclass
class BurstRound:
    """One burst: the running requests, the burst's, and the running requests' chunk gaps in each window."""

    running: list[Record]
    burst: list[Record]
    idle_gaps: list[float] = field(default_factory=list)  # seconds, the running requests' gaps in the idle window
    burst_gaps: list[float] = field(default_factory=list)  # seconds, their gaps overlapping the burst window
    ended_early: int = 0  # running requests that had ended before the burst's last first token
    seconds: float = 0.0


async def run_burst(url: str, cases: Sequence[PromptCase], numbers: Sequence[int], running: int,
                    running_tokens: int, idle_seconds: float, settings: RequestSettings) -> BurstRound:
    """Start `running` long streamed requests (max_tokens `running_tokens`; ignore_eos on a plain server: specdec
    refuses it), wait until each streams and then `idle_seconds` more, send the burst at once, and return the
    round with its windows' gaps.

    numbers: one per request, the running ones first (LONG_PROMPTS in turn), then the burst's (request n sends
    cases[n % len(cases)]); each prompt goes out numbered()."""
    def case(number: int, prompt: str, pid: str) -> PromptCase:
        return PromptCase(f"{pid}/r{number}", "open", numbered(prompt, number))

    async with http_client(None) as client:  # no connection cap: the burst goes out at once
        start = time.perf_counter()
        extra = {"ignore_eos": True} if settings.plain else None
        long_records = [Record(f"long{i}/r{n}", ok=False) for i, n in enumerate(numbers[:running])]
        long_tasks = [asyncio.create_task(one_request(
            client, url, settings.model, case(n, LONG_PROMPTS[i % len(LONG_PROMPTS)], f"long{i}"), settings.drafter,
            running_tokens, settings.num_draft_tokens, settings.plain, extra, record))
            for i, (n, record) in enumerate(zip(numbers, long_records))]
        end = time.perf_counter() + REQUEST_TIMEOUT
        while any(not r.chunk_times and not t.done() for r, t in zip(long_records, long_tasks)):
            if time.perf_counter() > end:
                break
            await asyncio.sleep(0.005)
        idle_start = time.perf_counter()
        await asyncio.sleep(idle_seconds)
        burst_send = time.perf_counter()
        burst = await asyncio.gather(*(one_request(
            client, url, settings.model, case(n, cases[n % len(cases)].prompt, cases[n % len(cases)].id),
            settings.drafter, settings.max_tokens, settings.num_draft_tokens, settings.plain)
            for n in numbers[running:]))
        long_done = await asyncio.gather(*long_tasks)
        seconds = time.perf_counter() - start
    return burst_windows(long_done, list(burst), (idle_start, burst_send), seconds)


def burst_windows(running: list[Record], burst: list[Record], idle: tuple[float, float],
                  seconds: float) -> BurstRound:
    """Return the round: the burst window runs from its send (idle's end) to its last first token; the running
    requests' gaps are split into the two windows (serve_load_stats.window_gaps)."""
    send = idle[1]
    firsts = [r.started + r.ttft for r in burst if r.started is not None and r.ttft is not None]
    window = (send, max(firsts, default=send))
    result = BurstRound(running, burst, seconds=seconds)
    for record in running:
        if record.started is None:
            continue
        times = [record.started + t for t in record.chunk_times]
        idle_gaps, burst_gaps = window_gaps(times, idle, window)
        result.idle_gaps += idle_gaps
        result.burst_gaps += burst_gaps
        if not times or times[-1] < window[1]:
            result.ended_early += 1
    return result


async def run_prefill(url: str, prompt_id: str, text: str, model: str | None, plain: bool) -> Record:
    """Send `text` alone as a raw text completion of one token and return its record (TTFT ~ the prefill)."""
    async with http_client(1) as client:
        return await one_completion(client, url, model, prompt_id, text, 1, plain)
