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
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Sequence
from urllib.parse import urlparse

import click

from specdec.benchmarks import PROMPTS_FILE
from specdec.benchmarks.serve_load_client import run_open_round, run_round
from specdec.benchmarks.serve_load_report import DRAFTER_LABELS, Cell, markdown, mismatches, plot, summarize
from specdec.benchmarks.serve_load_stats import ARRIVALS, GoodputTargets, arrival_times
from specdec.models.errors import SpecdecError
from specdec.runtime.prompts import load_prompts

SERVER_KINDS = ("process", "ray")
START_TIMEOUT = 300.0  # seconds for a server (a local Ray and its replicas included) to answer /health


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


class ServerProcess:
    """`specdec serve` in a child process on 127.0.0.1; `stop()` sends SIGTERM and waits."""

    def __init__(self, kind: str, artifact: str, generations: int, cores: int, extra: Sequence[str] = ()):
        command = [sys.executable, "-m", "specdec.cli.main", "serve", artifact, "--host", "127.0.0.1",
                   "--max-queue", "64", "--log-level", "warning", *extra]
        if kind == "ray":
            from specdec.serve.ray_app import free_port

            command += ["--ray", "--replicas", str(generations), "--replica-cpus", f"{cores / generations:g}",
                        "--max-concurrency", "1", "--port", str(free_port("127.0.0.1"))]
        else:
            command += ["--max-concurrency", str(generations), "--port", "0"]
        self.kind, self.command = kind, command
        self.output: list[str] = []
        self.url: str | None = None
        self._listening = threading.Event()
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)  # Ray's processes stay in its session
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            match = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
            if match:
                self.url = match.group(1)
                self._listening.set()

    def wait_ready(self, timeout: float = START_TIMEOUT) -> str:
        """Return the server's URL once /health answers 200; raise SpecdecError if it does not in time."""
        import httpx

        end = time.monotonic() + timeout
        while not self._listening.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > end:
                raise SpecdecError(f"{self.kind} server did not start: {''.join(self.output)[-1500:]}")
        assert self.url is not None
        while time.monotonic() < end:
            try:
                if httpx.get(self.url + "/health", timeout=5, trust_env=False).status_code == 200:
                    return self.url
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise SpecdecError(f"{self.kind} server at {self.url} never became healthy")

    def cpu_seconds(self) -> float:
        """Return the user + system CPU seconds of the server's live process tree (Ray's processes included)."""
        return tree_cpu_seconds(self.proc.pid)

    def stop(self, timeout: float = 120.0) -> None:
        """SIGTERM the server and wait; kill its process group if it has not exited in `timeout` seconds."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


def tree_cpu_seconds(root: int) -> float:
    """Return the CPU seconds (user + system) of `root` and its live descendants, read from /proc (0 elsewhere)."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        times[int(entry)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    total, todo, seen = 0.0, [root], set()
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += times.get(pid, 0.0)
        todo += children.get(pid, [])
    return total


def rounds(servers: Sequence[str], drafters: Sequence[str], concurrency: Sequence[float], repeats: int,
           plain: Sequence[str] = ()) -> Iterator[tuple[float, int, str, str]]:
    """Yield (load, round, server, drafter) in run order: per load (clients, or an open-loop rate), rounds
    alternate all pairs.

    A `plain` server (not specdec) runs only its own decoding, under the drafter label "none"."""
    for c in concurrency:
        for repeat in range(repeats):
            pairs = [(s, d) for s in servers for d in drafters if s not in plain or d == "none"]
            if repeat % 2:  # the second round runs the pairs backwards, so no pair always runs first
                pairs.reverse()
            for server, drafter in pairs:
                yield c, repeat, server, drafter


def round_sizes(requests: int, repeats: int, clients: int, min_waves: int = 0) -> list[int]:
    """Return the requests of each round of a cell: `requests` split over `repeats` rounds, but at least
    `min_waves` x `clients` a round."""
    return [max(requests // repeats + (1 if r < requests % repeats else 0), min_waves * clients)
            for r in range(repeats)]


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
@click.option("--goodput-ttft", type=click.FloatRange(min=0), default=0.5, show_default=True,
              help="Goodput target: a request's time to first token, seconds (inclusive).")
@click.option("--goodput-itl", type=click.FloatRange(min=0), default=0.1, show_default=True,
              help="Goodput target: a request's mean inter-token latency after its first token, seconds "
                   "(vLLM's TPOT: (last chunk - first chunk) / (tokens - 1)).")
@click.option("--goodput-e2el", type=click.FloatRange(min=0), default=None,
              help="Goodput target: a request's end-to-end latency, seconds (default: none). Goodput is the "
                   "requests that met every target, per second and as a share of those sent (vLLM's --goodput).")
@click.option("--drafters", default="none,ngram", show_default=True,
              help="Drafters to compare (comma list of none, ngram, model, auto); 'none' is target-only.")
@click.option("--num-draft-tokens", "-k", default=None, metavar="K|auto",
              help="K sent with every request (default: the server's).")
@click.option("--requests", type=click.IntRange(min=1), default=16, show_default=True,
              help="Requests per cell (server x drafter x clients or rate), split over --rounds.")
@click.option("--rounds", "repeats", type=click.IntRange(min=1), default=2, show_default=True,
              help="Rounds per load; each round runs every server x drafter once, alternating.")
@click.option("--min-waves", type=click.IntRange(min=0), default=0, show_default=True,
              help="Closed loop: each round sends at least this many requests per client (0: just its share of "
                   "--requests): a round of one wave (16 requests for 16 clients) is one burst and its tail, a "
                   "few seconds that the box's noise dominates.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=64, show_default=True,
              help="max_tokens of every request.")
@click.option("--prompts", "prompts_path", type=click.Path(dir_okay=False), default=None,
              help="Prompt set (JSON lines with \"prompt\"). Default: specdec's benchmark prompts.")
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
    fixed request rate; print throughput, latency percentiles and goodput."""
    if options["rates"] is not None and ctx.get_parameter_source("concurrency") != click.core.ParameterSource.DEFAULT:
        raise click.UsageError("give --concurrency (closed loop) or --rate (open loop), not both")
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
          max_tokens, prompts_path, model, time_limit, output, as_json) -> None:
    open_loop = rates is not None
    loads, drafter_list = _checked_loads_and_drafters(concurrency, rates, drafters)
    targets_met = GoodputTargets(ttft=goodput_ttft, itl=goodput_itl, e2el=goodput_e2el)
    cases = load_prompts(prompts_path or PROMPTS_FILE)
    targets, kinds = _checked_servers(artifact, servers, urls)
    cores = os.cpu_count() or 1
    plan = _Rounds(model, cases, max_tokens, num_draft_tokens, requests, repeats, min_waves, seed, arrivals,
                   time.perf_counter() + time_limit)
    load_before = _loadavg()
    cells: dict[tuple[str, str, float], Cell] = {}
    not_run: list[str] = []
    started_here: dict[str, ServerProcess] = {}
    with ExitStack() as stack:
        for kind in kinds:
            click.echo(f"starting the {kind} server ...", err=True)
            server = ServerProcess(kind, artifact, generations, cores)
            stack.callback(server.stop)
            targets[kind] = server.wait_ready()
            started_here[kind] = server
        unknown = [name for name in plain if name not in targets]
        if unknown:
            raise click.BadParameter(f"'{unknown[0]}' names no --url server", param_hint="--plain")
        for name, url in targets.items():  # warm-up: the first request of a drafter loads and calibrates
            for drafter in (["none"] if name in plain else drafter_list):
                asyncio.run(run_round(url, model, cases, drafter, 1, 1, 0, 8, num_draft_tokens, name in plain))
        for load, repeat, name, drafter in rounds(list(targets), drafter_list, loads, repeats, plain):
            key = (name, drafter, load)
            cell = cells.setdefault(key, Cell(name, drafter, None if open_loop else int(load),
                                              rate=load if open_loop else None))
            if time.perf_counter() > plan.deadline:
                not_run.append(f"{name}/{drafter}/{'r' if open_loop else 'c'}{load:g}/round{repeat + 1}")
                continue
            _play_round(cell, targets[name], name in plain, started_here.get(name), open_loop, load, repeat, plan)
    order = list(targets)
    summaries = [summarize(cells[key], targets_met)
                 for key in sorted(cells, key=lambda k: (order.index(k[0]), k[2], drafter_list.index(k[1])))]
    differ = mismatches([cell for cell in cells.values() if cell.server not in plain])
    goal = ", ".join(f"{what} <= {bound:g} s" for what, bound in (("TTFT", targets_met.ttft),
                     ("TPOT", targets_met.itl), ("e2e", targets_met.e2el)) if bound is not None)
    load_text = (f"open loop: {arrivals} arrivals at {', '.join(f'{r:g}' for r in loads)} requests/s (seed {seed})"
                 if open_loop else "closed-loop clients")
    setup = {
        "setup": (f"{cores} cores; servers {', '.join(targets)}; "
                  + (f"{generations} concurrent generations per server (engine threads {max(1, cores // generations)} "
                     "each); " if kinds else "servers started by the caller, as configured there; ")
                  + f"{len(cases)} prompts "
                  f"({Path(prompts_path or PROMPTS_FILE).name}), streamed greedy chat completions, max_tokens "
                  f"{max_tokens}; {requests} requests per cell in {repeats} alternating rounds"
                  + (f" (at least {min_waves} per client a round)" if min_waves and not open_loop else "")
                  + f"; {load_text}; machine load average {load_before} at the start, {_loadavg()} at the end"),
        "command": " ".join(["python -m specdec.benchmarks.serve_load", *sys.argv[1:]]),
        "mode": "open" if open_loop else "closed",
        "goodput": goal or "no target",
        "equal_texts": "yes" if not differ else f"no: prompts {', '.join(differ)} differ",
        "not_run": not_run,
    }
    _write_results(setup, summaries, cells, output, plot_path, as_json)


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
        # rounds start at different prompts, so each round's first requests are not always the same ones
        records, seconds = asyncio.run(run_round(url, plan.model, plan.cases, cell.drafter, int(load),
                                                 sizes[repeat], repeat * int(load), plan.max_tokens,
                                                 plan.num_draft_tokens, plain))
        unsent = 0
    cell.records += records
    cell.seconds += seconds
    if process is not None:
        cell.cpu_seconds = (cell.cpu_seconds or 0.0) + process.cpu_seconds() - cpu_before
    failed = [r for r in records if not r.ok]
    label = f"{load:g} req/s" if open_loop else f"clients {int(load):2d}"
    click.echo(f"  {cell.server:8s} {cell.drafter:6s} {label} round {repeat + 1}: {len(records)} requests "
               f"in {seconds:6.1f} s, {sum(r.tokens for r in records) / max(seconds, 1e-9):6.1f} tok/s"
               + (f", {unsent} not sent (time limit)" if unsent else "")
               + (f", server CPU {cell.cpu_seconds:.1f} s so far" if process is not None else "")
               + (f", {len(failed)} failed ({failed[0].error})" if failed else ""), err=True)


def _write_results(setup: dict, summaries: list, cells: dict, output, plot_path, as_json: bool) -> None:
    """Write serve_load.json and serve_load.md into `output` and the plot to `plot_path` where given; print the
    Markdown table, or the setup and summaries as JSON."""
    table = markdown(summaries, setup)
    if output:
        folder = Path(output)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "serve_load.json").write_text(json.dumps(
            {"setup": setup, "summaries": summaries,
             "cells": [{**{k: v for k, v in asdict(c).items() if k != "records"},
                        "records": [asdict(r) for r in c.records]} for c in cells.values()]}, indent=1))
        (folder / "serve_load.md").write_text(table)
    if plot_path:
        plot(summaries, plot_path)
    click.echo(json.dumps({"setup": setup, "summaries": summaries}, indent=1) if as_json else table)


if __name__ == "__main__":
    main()
