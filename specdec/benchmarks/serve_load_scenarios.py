"""The load generator's scenarios (serve_load --turns, --burst, --prefill-lengths): their rounds over the
servers, alternating as the closed and open loops do, and the TTFT parts read from each specdec server's
/metrics around every round.

- turns: closed-loop clients, each running conversations: turn 1 a prompt, turn 2 (and on) the conversation so
  far with the streamed answer and a follow-up (serve_load_workloads); TTFT per turn, later turns over the first.
- burst: M long requests stream, then N new prompts arrive at once; the long ones' inter-token latency in the
  idle window against the burst's, and the burst's TTFT.
- prefill: one raw prompt of exactly L tokens at a time (max_tokens 1), different text every request; prompt
  tokens per second of TTFT.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Hashable, Sequence

import click

from specdec.benchmarks.serve_load_parts import add_totals, parts_delta, scrape_ttft_parts
from specdec.benchmarks.serve_load_prompts import prefill_prompt
from specdec.benchmarks.serve_load_scenario_report import ScenarioCell
from specdec.benchmarks.serve_load_stats import round_sizes, rounds
from specdec.benchmarks.serve_load_workloads import RequestSettings, run_burst, run_conversations, run_prefill

RUNNING_TOKENS = 192  # burst: max_tokens of the running requests, long enough to stream through the burst
IDLE_SECONDS = 1.5  # burst: how long the running requests stream alone before the burst


@dataclass(frozen=True)
class ScenarioPlan:
    """What every round of a scenario sends, whatever its server and drafter."""

    scenario: str  # turns | burst | prefill
    model: str | None  # the model id sent (None: the server's)
    cases: list  # the prompts, PromptCase each
    max_tokens: int  # turns: every turn's; burst: the burst requests'
    num_draft_tokens: str | None  # K (None: the server's)
    requests: int  # turns: conversations per cell, over its rounds
    repeats: int  # rounds per cell
    deadline: float  # perf_counter time after which no round starts
    turns: int = 2  # turns: requests per conversation
    think_seconds: float = 0.0  # turns: a client's wait between an answer and its next turn
    running: int = 2  # burst: requests streaming before it
    running_tokens: int = RUNNING_TOKENS
    idle_seconds: float = IDLE_SECONDS
    tokenizer: Any = None  # prefill: the artifact's tokenizers.Tokenizer


class Numbering:
    """Hands out request numbers in blocks, one block per key: every server asks for the same keys in the same
    order, so it sends the same numbered prompts, and no key (round, drafter) gets another's."""

    def __init__(self) -> None:
        self.blocks: dict[Hashable, int] = {}
        self.next = 0

    def block(self, key: Hashable, size: int) -> range:
        """Return the numbers of `key`'s block (`size` of them, given the first time the key is asked)."""
        if key not in self.blocks:
            self.blocks[key], self.next = self.next, self.next + size
        return range(self.blocks[key], self.blocks[key] + size)


def run_scenario(plan: ScenarioPlan, targets: dict[str, str], plain: Sequence[str], drafters: Sequence[str],
                 loads: Sequence[int]) -> tuple[list[ScenarioCell], list[str]]:
    """Run every round of the scenario: per load (clients, burst size, prompt tokens) rounds alternate servers and
    drafters (prefill: target-only), the TTFT parts read from /metrics around each round of a specdec server.
    Return the cells (servers in `targets` order) and the rounds the time limit left out."""
    cells: dict[tuple[str, str, int], ScenarioCell] = {}
    not_run: list[str] = []
    numbers = Numbering()
    play = {"turns": _play_turns, "burst": _play_burst, "prefill": _play_prefill}[plan.scenario]
    drafter_list = ["none"] if plan.scenario == "prefill" else list(drafters)
    for load, repeat, name, drafter in rounds(list(targets), drafter_list, loads, plan.repeats, plain):
        cell = cells.setdefault((name, drafter, load), ScenarioCell(plan.scenario, name, drafter, int(load)))
        if time.perf_counter() > plan.deadline:
            not_run.append(f"{name}/{drafter}/{plan.scenario} {load:g}/round{repeat + 1}")
            continue
        settings = RequestSettings(plan.model, drafter, plan.max_tokens, plan.num_draft_tokens, name in plain)
        if plan.scenario == "prefill" and repeat == 0:  # before /metrics is read: the parts leave the warm-up out
            _warm_prefill(targets[name], settings, int(load), plan, numbers)
        before = None if settings.plain else scrape_ttft_parts(targets[name])
        line = play(cell, targets[name], settings, int(load), repeat, plan, numbers)
        if not settings.plain:
            add_totals(cell.parts, parts_delta(before, scrape_ttft_parts(targets[name])))
        failed = [r for records in cell.records.values() for r in records if not r.ok]
        click.echo(f"  {name:8s} {drafter:6s} {plan.scenario} {load:g} round {repeat + 1}: {line}"
                   + (f", {len(failed)} failed so far ({failed[0].error})" if failed else ""), err=True)
    order = list(targets)
    return sorted(cells.values(), key=lambda c: (order.index(c.server), c.load, drafter_list.index(c.drafter))), not_run


def _play_turns(cell: ScenarioCell, url: str, settings: RequestSettings, clients: int, repeat: int,
                plan: ScenarioPlan, numbers: Numbering) -> str:
    """Run one round of conversations with `clients` clients into `cell`; return its progress line."""
    size = round_sizes(plan.requests, plan.repeats, clients)[repeat]
    block = numbers.block(("turns", clients, repeat, settings.drafter), size)
    by_turn, seconds = asyncio.run(run_conversations(url, plan.cases, block, plan.turns, clients, settings,
                                                     plan.think_seconds))
    for turn, records in by_turn.items():
        cell.records.setdefault(f"turn{turn}", []).extend(records)
    cell.seconds += seconds
    firsts = [r.ttft for r in by_turn[1] if r.ttft is not None]
    later = [r.ttft for r in by_turn.get(2, []) if r.ttft is not None]
    return f"{size} conversations in {seconds:.1f} s, TTFT mean turn 1 {_mean(firsts)}, turn 2 {_mean(later)}"


def _play_burst(cell: ScenarioCell, url: str, settings: RequestSettings, burst: int, repeat: int,
                plan: ScenarioPlan, numbers: Numbering) -> str:
    """Run one burst of `burst` requests beside plan.running long ones into `cell`; return its progress line."""
    block = numbers.block(("burst", burst, repeat, settings.drafter), plan.running + burst)
    result = asyncio.run(run_burst(url, plan.cases, block, plan.running, plan.running_tokens, plan.idle_seconds,
                                   settings))
    cell.records.setdefault("running", []).extend(result.running)
    cell.records.setdefault("burst", []).extend(result.burst)
    cell.idle_gaps += result.idle_gaps
    cell.burst_gaps += result.burst_gaps
    cell.ended_early += result.ended_early
    cell.seconds += result.seconds
    return (f"{len(result.idle_gaps)} idle gaps (max {_max(result.idle_gaps)}), {len(result.burst_gaps)} in the "
            f"burst (max {_max(result.burst_gaps)}), running tokens "
            f"{', '.join(str(r.tokens) for r in result.running)}")


def _warm_prefill(url: str, settings: RequestSettings, length: int, plan: ScenarioPlan, numbers: Numbering) -> None:
    """Send a prompt of `length` tokens of its own, unmeasured: the first of a length may meet one-time costs
    (buffers, kernels for the shape)."""
    [index] = numbers.block(("prefill-warm-up", length), 1)
    text = prefill_prompt(plan.tokenizer, [case.prompt for case in plan.cases], index, length)
    asyncio.run(run_prefill(url, f"warm{length}", text, plan.model, settings.plain))


def _play_prefill(cell: ScenarioCell, url: str, settings: RequestSettings, length: int, repeat: int,
                  plan: ScenarioPlan, numbers: Numbering) -> str:
    """Send one prompt of exactly `length` tokens, a text no request sent before, into `cell`; return its
    progress line."""
    [index] = numbers.block(("prefill", length, repeat), 1)
    text = prefill_prompt(plan.tokenizer, [case.prompt for case in plan.cases], index, length)
    record = asyncio.run(run_prefill(url, f"len{length}/p{index}", text, plan.model, settings.plain))
    cell.records.setdefault("prefill", []).append(record)
    cell.seconds += record.e2e or 0.0
    ttft = record.ttft if record.ttft is not None else record.e2e
    return f"prompt tokens {record.prompt_tokens}, TTFT {_fmt_s(ttft)}"


def _mean(values: Sequence[float]) -> str:
    return _fmt_s(sum(values) / len(values) if values else None)


def _max(values: Sequence[float]) -> str:
    return _fmt_s(max(values) if values else None)


def _fmt_s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


def scenario_text(plan: ScenarioPlan, loads: Sequence[int]) -> str:
    """Return the setup's words on a scenario: what each cell sends, in how many rounds."""
    numbered = "" if plan.scenario == "prefill" else (
        '; every prompt numbered ("Request 17: ...", the same numbers on every server) so that no prefix cache '
        "holds it from an earlier round or drafter")
    return f"{_what_is_sent(plan, loads)}{numbered}; {plan.repeats} alternating rounds per cell"


def _what_is_sent(plan: ScenarioPlan, loads: Sequence[int]) -> str:
    joined = ", ".join(str(load) for load in loads)
    if plan.scenario == "turns":
        return (f"multi-turn chat: {plan.requests} conversations of {plan.turns} turns per cell, closed-loop "
                f"clients {joined}, turn 2 on: the conversation so far with the streamed answer and a fixed "
                f"follow-up, sent {f'{plan.think_seconds:g} s after' if plan.think_seconds else 'as soon as'} the "
                f"answer ended; streamed greedy chat completions, max_tokens {plan.max_tokens} each turn")
    if plan.scenario == "burst":
        return (f"burst: {plan.running} long requests stream (max_tokens {plan.running_tokens}, ignore_eos on "
                f"non-specdec servers; specdec refuses it and runs to its end of text) for {plan.idle_seconds:g} s, "
                f"then {joined} new prompts (max_tokens {plan.max_tokens}) arrive at once, once per round; streamed "
                "greedy chat completions")
    return (f"prefill: one raw prompt at a time (/v1/completions, max_tokens 1, target-only) of exactly {joined} "
            "tokens (the artifact's tokenizer, special tokens included), each from a different sentence of the "
            "prompts' text so that no prefix cache holds it; a warm-up prompt per server and length first")
