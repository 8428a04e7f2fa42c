"""Load generator for `specdec serve`: throughput, TTFT, inter-token latency (ITL) and end-to-end
percentiles and goodput, closed-loop clients or open-loop arrivals, target-only against speculative,
one process against Ray Serve (or any OpenAI-compatible server on loopback: llama-server, vLLM).

    python -m specdec.benchmarks.serve_load artifacts/smollm2 --servers process,ray \
        --concurrency 1,2,4,8 --drafters none,ngram --requests 16 --max-tokens 64
    python -m specdec.benchmarks.serve_load --url http://127.0.0.1:8000 --rate 0.5,1,2 --seed 0 \
        --requests 64 --goodput-ttft 0.5 --goodput-itl 0.1 --json

It starts each server itself (`specdec serve` on 127.0.0.1, a free port), or drives running
ones given with --url (loopback addresses only). Each cell (server, drafter, load) is either a
closed loop (--concurrency): `concurrency` clients, each sending its next request when the last one
ended, until the cell's requests are spent; or an open loop (--rate): requests sent at scheduled times
(Poisson arrivals seeded by --seed, or evenly spaced) whatever is still running, as vLLM's
benchmark_serving --request-rate, guidellm and aiperf do. Cells run in rounds that alternate servers
and drafters, so that load from elsewhere on the machine falls on all of them alike. Every request is
a greedy streamed chat completion, so the texts of the drafters (and servers) must be equal: the
report counts the prompts where they are not. The run is bounded: --requests per cell, --time-limit
for the whole run (cells not reached are reported as not run; an open-loop cell also sends nothing
after it and cancels what still streams), a timeout per request. The figures follow vLLM's
definitions (serve_load_stats has them); the client is serve_load_client, the report serve_load_report.

Instead of the loops, one scenario a run (serve_load_scenarios): multi-turn chat (--turns: TTFT of each turn,
later turns over the first), a burst of new prompts beside streaming ones (--burst: their inter-token
latency idle and in the burst), prefill speed (--prefill-lengths: prompt tokens/s of prompts of exactly L
tokens). For every cell of a specdec server, its /metrics tells where the time to first token went
(serve_load_parts). The servers it starts are serve_load_server's.

Why not guidellm or aiperf (checked 2026-12-07, guidellm 0.8.1, aiperf 0.13.0): both drive a local
OpenAI-compatible server at a fixed or Poisson rate from a prompt file of our own and report TTFT/ITL
percentiles and goodput (aiperf's --goodput; guidellm's goodput profile), so they fit the measurement,
but not the install: guidellm requires torch, transformers, datasets>=5 and sanic, and pins click~=8.4
(specdec's venv has 8.5); aiperf needs no torch but pulls ~50 packages (transformers, datasets, dash,
plotly, kaleido, kubernetes-asyncio, nvidia-ml-py, optuna, pyzmq) and pins pillow~=12.3 and pandas~=2.3.
Both count tokens client-side with a Hugging Face tokenizer, and neither sends specdec's fields
(drafter, specdec_stats) nor compares greedy texts across drafters. Run them from a venv of their own
to cross-check these figures.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence
from urllib.parse import urlparse

import click

from specdec.benchmarks import PROMPTS_FILE
from specdec.benchmarks.serve_load_client import run_open_round, run_round
from specdec.benchmarks.serve_load_parts import add_totals, parts_delta, scrape_ttft_parts
from specdec.benchmarks.serve_load_prompts import load_tokenizer
from specdec.benchmarks.serve_load_report import DRAFTER_LABELS, Cell, markdown, mismatches, plot, summarize
from specdec.benchmarks.serve_load_scenario_report import ScenarioCell, scenario_markdown, summarize_scenario
from specdec.benchmarks.serve_load_scenarios import ScenarioPlan, run_scenario, scenario_text
from specdec.benchmarks.serve_load_server import ServerProcess
from specdec.benchmarks.serve_load_stats import (ARRIVALS, GoodputTargets, arrival_times, round_sizes, round_start,
                                                 rounds)
from specdec.data import HELDOUT_PROMPTS_FILE
from specdec.models.errors import SpecdecError
from specdec.runtime.prompts import load_prompts

SERVER_KINDS = ("process", "ray")


def check_loopback(url: str) -> str:
    """Return `url` without a trailing slash; raise SpecdecError unless its host is a loopback address."""
    host = urlparse(url).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if urlparse(url).scheme not in ("http", "https") or not loopback:
        raise SpecdecError(f"--url must be http://127.0.0.1:PORT or another loopback address, got '{url}'")
    return url.rstrip("/")


def _loadavg() -> str:
    """Return the 1-minute load average as text (other work on the machine shows up here)."""
    try:
        return f"{os.getloadavg()[0]:.1f}"
    except OSError:
        return "unknown"


def _csv(kind: type, text: str, name: str) -> list:
    try:
        values = [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise click.BadParameter(f"expected a comma-separated list, got '{text}'", param_hint=name) from None
    if not values:
        raise click.BadParameter("must not be empty", param_hint=name)
    return values


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("artifact", required=False, type=click.Path(file_okay=False))
@click.option("--servers", default="process,ray", show_default=True,
              help="Servers to start from ARTIFACT: 'process' (one specdec serve process) and/or 'ray' "
                   "(Ray Serve, --generations replicas).")
@click.option("--url", "urls", multiple=True, metavar="[NAME=]URL",
              help="Drive a running server instead (loopback only); repeat for several. Replaces --servers.")
@click.option("--plain", "plain", multiple=True, metavar="NAME",
              help="A --url server that is not specdec (llama-server, vLLM): sent only OpenAI's fields, run only "
                   "in the target-only cells, left out of the greedy-text comparison. Repeat for several.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Write a PNG: tokens/s and TTFT p90 against clients (or --rate), one line per server and "
                   "decoding.")
@click.option("--generations", type=click.IntRange(min=1), default=2, show_default=True,
              help="Concurrent generations per server: the process's --max-concurrency, or Ray's replicas "
                   "(one generation each). Engine threads = cores / this in both.")
@click.option("--concurrency", "--clients", "concurrency", default="1,2,4,8", show_default=True,
              help="Closed loop: client counts to run (comma list); each client sends its next request when "
                   "its last one ended. Not with --rate.")
@click.option("--rate", "rates", default=None, metavar="R[,R...]",
              help="Open loop instead of --concurrency: requests per second to send (comma list, one cell "
                   "each), at scheduled times whatever is still running, so queueing shows in TTFT. A cell "
                   "sends --requests requests (split over --rounds) unless --time-limit comes first.")
@click.option("--arrivals", type=click.Choice(ARRIVALS), default="poisson", show_default=True,
              help="Open loop: 'poisson' draws the gaps between sends from an exponential of mean 1/R (a "
                   "Poisson process, as vLLM's benchmark_serving); 'constant' sends exactly every 1/R s.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Open loop: seed of the Poisson schedule; each round draws its own from (seed, round), the "
                   "same for every server and drafter of that round.")
@click.option("--turns", type=click.IntRange(min=2), default=None, metavar="N",
              help="Multi-turn chat instead of single requests: each closed-loop client (--concurrency) runs "
                   "conversations of N turns, sending each turn when the last ended: turn 1 a prompt, turn 2 the "
                   "prompt, the streamed answer as the assistant's message and a follow-up (one of a fixed list, "
                   "chosen per conversation), and so on; --requests counts conversations. Reports TTFT p50/p90 of "
                   "each turn and each later turn over the first (the target: turn 2 <= 0.5x turn 1, its prefix "
                   "cached). Every server gets the same messages.")
@click.option("--think-time", type=click.FloatRange(min=0), default=0.0, show_default=True, metavar="S",
              help="--turns: seconds a client waits after an answer before sending the next turn (a user reading "
                   "it); 0: at once, a server's worst case for reusing the answer.")
@click.option("--burst", type=click.IntRange(min=1), default=None, metavar="N",
              help="Inter-token latency during a burst: --burst-running long requests stream (max_tokens 192; "
                   "ignore_eos where the server is not specdec, which refuses it: the report gives the tokens each "
                   "ran) alone for 1.5 s, then N new prompts arrive at once; once per round. Reports the running "
                   "requests' chunk gaps idle and in the burst (from its send until every burst request has its "
                   "first token, the gap spanning that end included), p50/p99 each, p99 burst over idle (the "
                   "target: <= 2x), and the burst's TTFT p50/p90.")
@click.option("--burst-running", type=click.IntRange(min=1), default=2, show_default=True, metavar="M",
              help="--burst: requests already streaming when the burst arrives.")
@click.option("--prefill-lengths", default=None, metavar="L[,L...]",
              help="Prefill speed: per length, single raw-prompt requests (/v1/completions, no chat template, "
                   "max_tokens 1, target-only, nothing else running) of exactly L prompt tokens, cut with "
                   "ARTIFACT's tokenizer (give ARTIFACT beside --url), a different text every request so that no "
                   "prefix cache helps; --rounds requests per server and length after a warm-up one. Reports "
                   "prompt tokens / TTFT (median) and the prompt tokens each server counted.")
@click.option("--goodput-ttft", type=click.FloatRange(min=0), default=0.5, show_default=True,
              help="Goodput target: a request's time to first token, seconds (inclusive).")
@click.option("--goodput-itl", type=click.FloatRange(min=0), default=0.1, show_default=True,
              help="Goodput target: a request's mean inter-token latency after its first token, seconds "
                   "(vLLM's TPOT: (last chunk - first chunk) / (tokens - 1)).")
@click.option("--goodput-e2el", type=click.FloatRange(min=0), default=None,
              help="Goodput target: a request's end-to-end latency, seconds (default: none). Goodput is the "
                   "requests that met every target, per second and as a share of those sent (vLLM's --goodput).")
@click.option("--drafters", default="none,ngram", show_default=True,
              help="Drafters to compare (comma list of none, ngram, model, auto); 'none' is target-only "
                   "(--prefill-lengths runs that only).")
@click.option("--num-draft-tokens", "-k", default=None, metavar="K|auto",
              help="K sent with every request (default: the server's).")
@click.option("--requests", type=click.IntRange(min=1), default=16, show_default=True,
              help="Requests per cell (server x drafter x clients or rate), split over --rounds (--turns: "
                   "conversations; --burst and --prefill-lengths send one burst or prompt a round instead).")
@click.option("--rounds", "repeats", type=click.IntRange(min=1), default=2, show_default=True,
              help="Rounds per load; each round runs every server x drafter once, alternating.")
@click.option("--min-waves", type=click.IntRange(min=0), default=0, show_default=True,
              help="Closed loop: each round sends at least this many requests per client (0: just its share of "
                   "--requests): a round of one wave (16 requests for 16 clients) is one burst and its tail, a "
                   "few seconds that the box's noise dominates.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=64, show_default=True,
              help="max_tokens of every request (--turns: of every turn; --burst: of the burst's requests; "
                   "--prefill-lengths: 1).")
@click.option("--prompts", "prompts_path", type=click.Path(dir_okay=False), default=None,
              help="Prompt set (JSON lines with \"prompt\"). Default: specdec's benchmark prompts; for --turns, "
                   "--burst and --prefill-lengths its held-out prompts (each request numbered, \"Request 17: ...\", "
                   "so that no server's prefix cache holds one sent before).")
@click.option("--model", default=None, help="`model` sent with requests (default: none, the server's).")
@click.option("--time-limit", type=click.FloatRange(min=1), default=1800.0, show_default=True,
              help="Seconds for the whole run; no new cell starts after it. An open-loop cell also sends "
                   "nothing after it and cancels the requests still streaming (counted as failed).")
@click.option("--output", type=click.Path(file_okay=False), default=None,
              help="Folder for serve_load.json (every request) and serve_load.md (the table).")
@click.option("--json", "as_json", is_flag=True, help="Print the setup and every cell's figures as JSON instead "
                                                      "of the table.")
@click.pass_context
def main(ctx, **options) -> None:
    """Drive specdec serve (and other OpenAI servers) with streaming clients on loopback, closed loop or at a
    fixed request rate; print throughput, latency percentiles and goodput. Or run one scenario: multi-turn chat
    (--turns), a burst beside running requests (--burst), prefill speed (--prefill-lengths). After each table,
    for specdec servers: where the time to first token went (/metrics' specdec:ttft_part_seconds, read around
    every round; left out where a server has none)."""
    if options["rates"] is not None and ctx.get_parameter_source("concurrency") != click.core.ParameterSource.DEFAULT:
        raise click.UsageError("give --concurrency (closed loop) or --rate (open loop), not both")
    given = [flag for flag, key in (("--rate", "rates"), ("--turns", "turns"), ("--burst", "burst"),
                                    ("--prefill-lengths", "prefill_lengths")) if options[key] is not None]
    if len(given) > 1:
        raise click.UsageError(f"give one of {', '.join(given)}: each is a run of its own")
    if options["plot_path"] and set(given) - {"--rate"}:
        raise click.UsageError(f"--plot draws the closed or open loop, not {given[0]}")
    try:
        _main(**options)
    except SpecdecError as err:
        raise click.ClickException(str(err)) from None


@dataclass(frozen=True)
class _Rounds:
    """What every round of the run sends, whatever its server and drafter."""

    model: str | None  # the model id sent (None: the server's)
    cases: list  # the prompts, PromptCase each
    max_tokens: int
    num_draft_tokens: str | None  # K sent with every request (None: the server's)
    requests: int  # per cell, over all its rounds
    repeats: int  # rounds per cell
    min_waves: int  # closed loop: requests per client a round at least
    seed: int  # open loop: the schedule's seed
    arrivals: str  # open loop: poisson | constant
    deadline: float  # perf_counter time after which nothing more is sent


def _main(*, artifact, servers, urls, plain, plot_path, generations, concurrency, rates, arrivals, seed,
          goodput_ttft, goodput_itl, goodput_e2el, drafters, num_draft_tokens, requests, repeats, min_waves,
          max_tokens, prompts_path, model, time_limit, output, as_json, turns, think_time, burst, burst_running,
          prefill_lengths) -> None:
    scenario = "turns" if turns else "burst" if burst else "prefill" if prefill_lengths else None
    open_loop = rates is not None
    loads, drafter_list = _checked_loads_and_drafters(concurrency, rates, drafters)
    if scenario in ("burst", "prefill"):  # one burst size, or the prompt lengths, stand where client counts do
        loads = [burst] if burst else _csv(int, prefill_lengths, "--prefill-lengths")
        if scenario == "prefill" and min(loads) < 2:
            raise click.BadParameter("prompt lengths must be >= 2 tokens", param_hint="--prefill-lengths")
    targets_met = GoodputTargets(ttft=goodput_ttft, itl=goodput_itl, e2el=goodput_e2el)
    prompts_file = Path(prompts_path or (HELDOUT_PROMPTS_FILE if scenario else PROMPTS_FILE))
    cases = load_prompts(prompts_file)
    targets, kinds = _checked_servers(artifact, servers, urls)
    if scenario == "prefill" and not artifact:
        raise click.UsageError("--prefill-lengths needs ARTIFACT (its tokenizer cuts the prompts), --url or not")
    deadline = time.perf_counter() + time_limit
    plan = _Rounds(model, cases, max_tokens, num_draft_tokens, requests, repeats, min_waves, seed, arrivals, deadline)
    scenario_plan = None if scenario is None else ScenarioPlan(
        scenario, model, cases, max_tokens, num_draft_tokens, requests, repeats, deadline, turns=turns or 1,
        think_seconds=think_time,
        running=burst_running, tokenizer=load_tokenizer(artifact) if scenario == "prefill" else None)
    load_before = _loadavg()
    with ExitStack() as stack:
        started_here = _start_servers(stack, kinds, artifact, generations, targets)
        unknown = [name for name in plain if name not in targets]
        if unknown:
            raise click.BadParameter(f"'{unknown[0]}' names no --url server", param_hint="--plain")
        for name, url in targets.items():  # warm-up: the first request of a drafter loads and calibrates
            for drafter in (["none"] if name in plain or scenario == "prefill" else drafter_list):
                asyncio.run(run_round(url, model, cases, drafter, 1, 1, 0, 8, num_draft_tokens, name in plain))
        if scenario_plan:
            scenario_cells, not_run = run_scenario(scenario_plan, targets, plain, drafter_list, loads)
        else:
            cells, not_run = _run_loops(targets, plain, started_here, drafter_list, loads, open_loop, plan)
    load_text = (scenario_text(scenario_plan, loads) if scenario_plan else _load_text(
        open_loop, arrivals, loads, seed, min_waves, max_tokens, requests, repeats))
    setup = {"setup": (f"{_servers_text(targets, kinds, generations)}; {len(cases)} prompts ({prompts_file.name}); "
                       f"{load_text}; machine load average {load_before} at the start, {_loadavg()} at the end"),
             "command": " ".join(["python -m specdec.benchmarks.serve_load", *sys.argv[1:]]),
             "mode": scenario or ("open" if open_loop else "closed"), "not_run": not_run}
    if scenario_plan:
        summaries = [summarize_scenario(cell) for cell in scenario_cells]
        _write_results(setup, summaries, [_cell_json(c) for c in scenario_cells],
                       scenario_markdown(summaries, setup), output, None, as_json)
        return
    order = list(targets)
    keys = sorted(cells, key=lambda k: (order.index(k[0]), k[2], drafter_list.index(k[1])))
    summaries = [summarize(cells[key], targets_met) for key in keys]
    differ = mismatches([cell for cell in cells.values() if cell.server not in plain])
    setup["goodput"] = ", ".join(f"{what} <= {bound:g} s" for what, bound in (
        ("TTFT", targets_met.ttft), ("TPOT", targets_met.itl), ("e2e", targets_met.e2el)) if bound is not None
    ) or "no target"
    setup["equal_texts"] = "yes" if not differ else f"no: prompts {', '.join(differ)} differ"
    _write_results(setup, summaries, [_cell_json(cells[key]) for key in keys],
                   markdown(summaries, setup), output, plot_path, as_json)


def _start_servers(stack: ExitStack, kinds: Sequence[str], artifact, generations: int,
                   targets: dict[str, str]) -> dict[str, ServerProcess]:
    """Start a specdec server of each kind (stopped when `stack` closes), add its URL to `targets`; return them."""
    started: dict[str, ServerProcess] = {}
    for kind in kinds:
        click.echo(f"starting the {kind} server ...", err=True)
        server = ServerProcess(kind, artifact, generations, os.cpu_count() or 1)
        stack.callback(server.stop)
        targets[kind] = server.wait_ready()
        started[kind] = server
    return started


def _run_loops(targets: dict[str, str], plain: Sequence[str], started_here: dict[str, ServerProcess],
               drafters: Sequence[str], loads: Sequence[float], open_loop: bool,
               plan: _Rounds) -> tuple[dict[tuple[str, str, float], Cell], list[str]]:
    """Run every round of the closed or open loop; return the cells by (server, drafter, load) and the rounds the
    time limit left out."""
    cells: dict[tuple[str, str, float], Cell] = {}
    not_run: list[str] = []
    for load, repeat, name, drafter in rounds(list(targets), drafters, loads, plan.repeats, plain):
        cell = cells.setdefault((name, drafter, load), Cell(name, drafter, None if open_loop else int(load),
                                                            rate=load if open_loop else None))
        if time.perf_counter() > plan.deadline:
            not_run.append(f"{name}/{drafter}/{'r' if open_loop else 'c'}{load:g}/round{repeat + 1}")
            continue
        _play_round(cell, targets[name], name in plain, started_here.get(name), open_loop, load, repeat, plan)
    return cells, not_run


def _servers_text(targets: dict[str, str], kinds: Sequence[str], generations: int) -> str:
    """Return the setup's words on the machine and the servers."""
    cores = os.cpu_count() or 1
    return (f"{cores} cores; servers {', '.join(targets)}; "
            + (f"{generations} concurrent generations per server (engine threads {max(1, cores // generations)} "
               "each)" if kinds else "servers started by the caller, as configured there"))


def _load_text(open_loop: bool, arrivals: str, loads: Sequence[float], seed: int, min_waves: int, max_tokens: int,
               requests: int, repeats: int) -> str:
    """Return the setup's words on the load: what is sent, open-loop arrivals and rates, or closed-loop clients."""
    sent = (f"streamed greedy chat completions, max_tokens {max_tokens}; {requests} requests per cell in {repeats} "
            "alternating rounds")
    if open_loop:
        rates = ", ".join(f"{r:g}" for r in loads)
        return f"{sent}; open loop: {arrivals} arrivals at {rates} requests/s (seed {seed})"
    return (f"{sent}" + (f" (at least {min_waves} per client a round)" if min_waves else "")
            + "; closed-loop clients")


def _cell_json(cell: Cell | ScenarioCell) -> dict:
    """Return a cell as JSON: its fields and every record (a scenario's by role: {"turn1": [...], ...})."""
    fields = {k: v for k, v in asdict(cell).items() if k != "records"}
    if isinstance(cell.records, dict):
        return {**fields, "records": {role: [asdict(r) for r in rs] for role, rs in cell.records.items()}}
    return {**fields, "records": [asdict(r) for r in cell.records]}


def _checked_loads_and_drafters(concurrency: str, rates: str | None, drafters: str) -> tuple[list[float], list[str]]:
    """Return (the loads: request rates with --rate, else client counts; the drafters to compare); raise click's
    BadParameter for values that cannot run."""
    open_loop = rates is not None
    loads: list[float] = _csv(float, rates, "--rate") if open_loop else _csv(int, concurrency, "--concurrency")
    if min(loads) <= 0 or (not open_loop and min(loads) < 1):
        raise click.BadParameter("must be > 0" if open_loop else "client counts must be >= 1",
                                 param_hint="--rate" if open_loop else "--concurrency")
    drafter_list = _csv(str, drafters, "--drafters")
    bad = [d for d in drafter_list if d not in DRAFTER_LABELS]
    if bad:
        raise click.BadParameter(f"unknown drafter '{bad[0]}' (use {', '.join(DRAFTER_LABELS)})",
                                 param_hint="--drafters")
    return loads, drafter_list


def _checked_servers(artifact, servers: str, urls: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """Return ({name: url} of the --url servers, the server kinds to start); raise click's errors for servers
    that cannot run."""
    targets: dict[str, str] = {}
    for item in urls:
        name, _, url = item.rpartition("=") if "=" in item else (f"url{len(targets) + 1}", "", item)
        targets[name] = check_loopback(url)
    kinds = [] if urls else _csv(str, servers, "--servers")
    if any(k not in SERVER_KINDS for k in kinds):
        raise click.BadParameter(f"servers are {', '.join(SERVER_KINDS)}", param_hint="--servers")
    if kinds and not artifact:
        raise click.UsageError("give ARTIFACT to start servers, or --url for running ones")
    return targets, kinds


def _play_round(cell: Cell, url: str, plain: bool, process: ServerProcess | None, open_loop: bool, load: float,
                repeat: int, plan: _Rounds) -> None:
    """Send round `repeat` of `cell` to the server at `url` (open loop at rate `load`, else `load` closed-loop
    clients), add its records, time and server CPU to the cell, and print a line on stderr."""
    cpu_before = process.cpu_seconds() if process else None
    parts_before = None if plain else scrape_ttft_parts(url)
    sizes = round_sizes(plan.requests, plan.repeats, 1 if open_loop else int(load), 0 if open_loop else plan.min_waves)
    if open_loop:
        # every server and drafter of a round gets the same schedule and prompts
        schedule = arrival_times(sizes[repeat], load, (plan.seed, repeat), plan.arrivals)
        records, seconds, unsent = asyncio.run(run_open_round(
            url, plan.model, plan.cases, cell.drafter, schedule, sum(sizes[:repeat]), plan.max_tokens,
            plan.num_draft_tokens, plain, plan.deadline))
        cell.send_times.append([r.sent for r in records if r.sent is not None])
        cell.not_sent += unsent
    else:
        start = round_start(sizes, repeat, int(load), len(plan.cases))
        records, seconds = asyncio.run(run_round(url, plan.model, plan.cases, cell.drafter, int(load), sizes[repeat],
                                                 start, plan.max_tokens, plan.num_draft_tokens, plain))
        unsent = 0
    cell.records += records
    cell.seconds += seconds
    if not plain:
        add_totals(cell.parts, parts_delta(parts_before, scrape_ttft_parts(url)))
    if process is not None:
        cell.cpu_seconds = (cell.cpu_seconds or 0.0) + process.cpu_seconds() - cpu_before
    failed = [r for r in records if not r.ok]
    label = f"{load:g} req/s" if open_loop else f"clients {int(load):2d}"
    click.echo(f"  {cell.server:8s} {cell.drafter:6s} {label} round {repeat + 1}: {len(records)} requests "
               f"in {seconds:6.1f} s, {sum(r.tokens for r in records) / max(seconds, 1e-9):6.1f} tok/s"
               + (f", {unsent} not sent (time limit)" if unsent else "")
               + (f", server CPU {cell.cpu_seconds:.1f} s so far" if process is not None else "")
               + (f", {len(failed)} failed ({failed[0].error})" if failed else ""), err=True)


def _write_results(setup: dict, summaries: list, cells_json: list, table: str, output, plot_path,
                   as_json: bool) -> None:
    """Write serve_load.json (setup, summaries, cells with every record) and serve_load.md (`table`) into
    `output` and the plot to `plot_path` where given; print the table, or the setup and summaries as JSON."""
    if output:
        folder = Path(output)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "serve_load.json").write_text(json.dumps(
            {"setup": setup, "summaries": summaries, "cells": cells_json}, indent=1))
        (folder / "serve_load.md").write_text(table)
    if plot_path:
        plot(summaries, plot_path)
    click.echo(json.dumps({"setup": setup, "summaries": summaries}, indent=1) if as_json else table)


if __name__ == "__main__":
    main()
