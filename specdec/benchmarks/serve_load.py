"""Load generator for `specdec serve`: throughput and TTFT / end-to-end latency percentiles under
concurrent streaming clients, target-only against speculative, one process against Ray Serve.

    python -m specdec.benchmarks.serve_load artifacts/smollm2 --servers process,ray \
        --concurrency 1,2,4,8 --drafters none,ngram --requests 16 --max-tokens 64

It starts each server itself (`specdec serve` on 127.0.0.1, a free port), or drives running
ones given with --url (loopback addresses only). Each cell (server, drafter, concurrency) is a
closed loop: `concurrency` clients, each sending its next request when the last one ended,
until the cell's requests are spent. Cells run in rounds that alternate servers and drafters,
so that load from elsewhere on the machine falls on all of them alike. Every request is a
greedy streamed chat completion, so the texts of the drafters (and servers) must be equal:
the report counts the prompts where they are not. The run is bounded: --requests per cell,
--time-limit for the whole run (cells not reached are reported as not run), a timeout per request.
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence
from urllib.parse import urlparse

import click
import numpy as np

from specdec.benchmarks import PROMPTS_FILE
from specdec.models.errors import SpecdecError
from specdec.runtime.prompts import PromptCase, load_prompts

SERVER_KINDS = ("process", "ray")
DRAFTER_LABELS = {"none": "target-only", "ngram": "n-gram", "model": "draft model", "auto": "auto"}
START_TIMEOUT = 300.0  # seconds for a server (a local Ray and its replicas included) to answer /health
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


@dataclass
class Cell:
    """All requests of one (server, drafter, concurrency) with their wall time."""

    server: str
    drafter: str
    concurrency: int
    records: list[Record] = field(default_factory=list)
    seconds: float = 0.0  # wall time of the cell's rounds, summed
    cpu_seconds: float | None = None  # CPU time of the server's processes over those rounds (servers started here)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Return the q-th percentile (linear interpolation) of `values`, or None when empty."""
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else None


def summarize(cell: Cell) -> dict[str, Any]:
    """Return a cell's figures: requests, errors, tokens, tokens/s, TTFT and e2e p50/p99, tokens per target call."""
    done = [r for r in cell.records if r.ok]
    tokens = sum(r.tokens for r in done)
    ttft = [r.ttft for r in done if r.ttft is not None]
    e2e = [r.e2e for r in done if r.e2e is not None]
    calls = sum(r.target_calls for r in done)
    drafted = sum(r.drafted for r in done)
    return {
        "server": cell.server, "drafter": cell.drafter, "concurrency": cell.concurrency,
        "requests": len(cell.records), "errors": len(cell.records) - len(done), "tokens": tokens,
        "seconds": cell.seconds, "tokens_per_second": tokens / cell.seconds if cell.seconds > 0 else None,
        # CPU the server got: cores used on average, and CPU per generated token (its work, whatever it waited)
        "server_cores": cell.cpu_seconds / cell.seconds if cell.cpu_seconds is not None and cell.seconds else None,
        "server_cpu_ms_per_token": 1000 * cell.cpu_seconds / tokens if cell.cpu_seconds is not None and tokens else None,
        "ttft_p50": percentile(ttft, 50), "ttft_p90": percentile(ttft, 90), "ttft_p99": percentile(ttft, 99),
        "e2e_p50": percentile(e2e, 50), "e2e_p99": percentile(e2e, 99),
        # decode calls only: the prefill is one call per request whatever the drafter
        "tokens_per_target_call": (tokens - len(done)) / (calls - len(done)) if calls > len(done) else None,
        "acceptance_rate": sum(r.accepted for r in done) / drafted if drafted else None,
    }


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


def parse_sse_line(line: str) -> dict | None:
    """Return the JSON object of one `data: {...}` SSE line; None for [DONE], comments and blanks."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return None
    return json.loads(line[len("data: "):])


async def one_request(client, url: str, model: str | None, case: PromptCase, drafter: str,
                      max_tokens: int, num_draft_tokens: str | None, plain: bool = False) -> Record:
    """Send one greedy streamed chat completion and time it; never raises (errors are recorded).

    `plain`: a server that is not specdec (llama-server, vLLM): only OpenAI's own fields are sent.
    """
    body: dict[str, Any] = {"messages": [{"role": "user", "content": case.prompt}], "max_tokens": max_tokens,
                            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if not plain:
        body.update(drafter=drafter, specdec_stats=True)
    if model:
        body["model"] = model
    if num_draft_tokens is not None and not plain:
        body["num_draft_tokens"] = num_draft_tokens if num_draft_tokens == "auto" else int(num_draft_tokens)
    record = Record(case.id, ok=False)
    pieces: list[str] = []
    start = time.perf_counter()
    try:
        # A fresh connection per request for other servers: llama-server drops idle keep-alive connections,
        # and a request sent on one it just closed fails without a response.
        headers = {"Connection": "close"} if plain else None
        async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers,
                                 timeout=REQUEST_TIMEOUT) as reply:
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
                for choice in event.get("choices", []):
                    text = choice.get("delta", {}).get("content")
                    if text:
                        if record.ttft is None:
                            record.ttft = time.perf_counter() - start
                        pieces.append(text)
                if event.get("usage"):
                    record.tokens = event["usage"]["completion_tokens"]
                stats = event.get("specdec")
                if stats:
                    record.target_calls = stats.get("target_calls", 0)
                    record.drafted = stats.get("drafted", 0)
                    record.accepted = stats.get("accepted", 0)
    except Exception as err:  # a timeout or a dropped connection is a failed request, not a crash
        record.error = f"{type(err).__name__}: {err}"
        return record
    record.e2e = time.perf_counter() - start
    record.text = "".join(pieces)
    record.ok = True
    return record


async def run_round(url: str, model: str | None, cases: Sequence[PromptCase], drafter: str, concurrency: int,
                    requests: int, offset: int, max_tokens: int, num_draft_tokens: str | None, plain: bool = False
                    ) -> tuple[list[Record], float]:
    """Run `requests` requests with `concurrency` closed-loop clients; return the records and the wall time."""
    import httpx

    queue = list(range(offset, offset + requests))
    records: list[Record] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, trust_env=False) as client:
        async def worker() -> None:
            while queue:
                index = queue.pop(0)
                records.append(await one_request(client, url, model, cases[index % len(cases)], drafter,
                                                 max_tokens, num_draft_tokens, plain))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return records, time.perf_counter() - start


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


def rounds(servers: Sequence[str], drafters: Sequence[str], concurrency: Sequence[int], repeats: int,
           plain: Sequence[str] = ()) -> Iterator[tuple[int, int, str, str]]:
    """Yield (concurrency, round, server, drafter) in run order: per concurrency, rounds alternate all pairs.

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


def mismatches(cells: Sequence[Cell]) -> list[str]:
    """Return the prompt ids whose greedy texts differ between any two cells (drafters, servers)."""
    texts: dict[str, set[str]] = {}
    for cell in cells:
        for record in cell.records:
            if record.ok:
                texts.setdefault(record.prompt_id, set()).add(record.text)
    return sorted(pid for pid, variants in texts.items() if len(variants) > 1)


def _loadavg() -> str:
    """Return the 1-minute load average as text (other work on the machine shows up here)."""
    try:
        return f"{os.getloadavg()[0]:.1f}"
    except OSError:
        return "unknown"


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(summaries: Sequence[dict[str, Any]], setup: dict[str, Any]) -> str:
    """Return the report: setup, one table row per (server, concurrency, drafter), speedup vs target-only."""
    base = {(s["server"], s["concurrency"]): s for s in summaries if s["drafter"] == "none"}
    lines = [f"Setup: {setup['setup']}", "", f"Command: `{setup['command']}`", "",
             "| server | clients | decoding | requests | tok/s | vs target-only | TTFT p50 s | TTFT p90 s | TTFT p99 s "
             "| e2e p50 s | e2e p99 s | tokens/target call | server cores | server CPU ms/token |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in summaries:
        ref = base.get((s["server"], s["concurrency"]))
        ratio = (s["tokens_per_second"] / ref["tokens_per_second"]
                 if ref and s["drafter"] != "none" and s["tokens_per_second"] and ref["tokens_per_second"] else None)
        requests = f"{s['requests'] - s['errors']}" + (f" ({s['errors']} failed)" if s["errors"] else "")
        lines.append(f"| {s['server']} | {s['concurrency']} | {DRAFTER_LABELS.get(s['drafter'], s['drafter'])} "
                     f"| {requests} | {_fmt(s['tokens_per_second'], 1)} | {_fmt(ratio) + 'x' if ratio else '-'} "
                     f"| {_fmt(s['ttft_p50'])} | {_fmt(s.get('ttft_p90'))} | {_fmt(s['ttft_p99'])} | {_fmt(s['e2e_p50'])} | {_fmt(s['e2e_p99'])} "
                     f"| {_fmt(s['tokens_per_target_call'])} | {_fmt(s.get('server_cores'))} "
                     f"| {_fmt(s.get('server_cpu_ms_per_token'), 0)} |")
    lines += ["", f"Greedy texts equal across drafters and servers: {setup['equal_texts']}"]
    if setup.get("not_run"):
        lines.append(f"Not run (time limit): {', '.join(setup['not_run'])}")
    return "\n".join(lines) + "\n"


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
              help="Write a PNG: tokens/s and TTFT p90 against clients, one line per server and decoding.")
@click.option("--generations", type=click.IntRange(min=1), default=2, show_default=True,
              help="Concurrent generations per server: the process's --max-concurrency, or Ray's replicas "
                   "(one generation each). Engine threads = cores / this in both.")
@click.option("--concurrency", default="1,2,4,8", show_default=True, help="Client counts to run (comma list).")
@click.option("--drafters", default="none,ngram", show_default=True,
              help="Drafters to compare (comma list of none, ngram, model, auto); 'none' is target-only.")
@click.option("--num-draft-tokens", "-k", default=None, metavar="K|auto",
              help="K sent with every request (default: the server's).")
@click.option("--requests", type=click.IntRange(min=1), default=16, show_default=True,
              help="Requests per cell (server x drafter x concurrency), split over --rounds.")
@click.option("--rounds", "repeats", type=click.IntRange(min=1), default=2, show_default=True,
              help="Rounds per concurrency; each round runs every server x drafter once, alternating.")
@click.option("--min-waves", type=click.IntRange(min=0), default=0, show_default=True,
              help="Each round sends at least this many requests per client (0: just its share of --requests): a "
                   "round of one wave (16 requests for 16 clients) is one burst and its tail, a few seconds that "
                   "the box's noise dominates.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=64, show_default=True,
              help="max_tokens of every request.")
@click.option("--prompts", "prompts_path", type=click.Path(dir_okay=False), default=None,
              help="Prompt set (JSON lines with \"prompt\"). Default: specdec's benchmark prompts.")
@click.option("--model", default=None, help="`model` sent with requests (default: none, the server's).")
@click.option("--time-limit", type=click.FloatRange(min=1), default=1800.0, show_default=True,
              help="Seconds for the whole run; no new cell starts after it.")
@click.option("--output", type=click.Path(file_okay=False), default=None,
              help="Folder for serve_load.json (every request) and serve_load.md (the table).")
@click.option("--json", "as_json", is_flag=True, help="Print the summaries as JSON instead of the table.")
def main(artifact, servers, urls, plain, plot_path, generations, concurrency, drafters, num_draft_tokens, requests,
         repeats, min_waves, max_tokens, prompts_path, model, time_limit, output, as_json) -> None:
    """Drive specdec serve (and other OpenAI servers) with concurrent streaming clients on loopback; print
    throughput and latency."""
    try:
        _main(artifact, servers, urls, generations, concurrency, drafters, num_draft_tokens, requests, repeats,
              max_tokens, prompts_path, model, time_limit, output, as_json, plain, plot_path, min_waves)
    except SpecdecError as err:
        raise click.ClickException(str(err)) from None


def _main(artifact, servers, urls, generations, concurrency, drafters, num_draft_tokens, requests, repeats,
          max_tokens, prompts_path, model, time_limit, output, as_json, plain=(), plot_path=None,
          min_waves=0) -> None:
    clients = _csv(int, concurrency, "--concurrency")
    if min(clients) < 1:
        raise click.BadParameter("client counts must be >= 1", param_hint="--concurrency")
    drafter_list = _csv(str, drafters, "--drafters")
    bad = [d for d in drafter_list if d not in DRAFTER_LABELS]
    if bad:
        raise click.BadParameter(f"unknown drafter '{bad[0]}' (use {', '.join(DRAFTER_LABELS)})",
                                 param_hint="--drafters")
    cases = load_prompts(prompts_path or PROMPTS_FILE)
    targets: dict[str, str] = {}
    for item in urls:
        name, _, url = item.rpartition("=") if "=" in item else (f"url{len(targets) + 1}", "", item)
        targets[name] = check_loopback(url)
    kinds = [] if urls else _csv(str, servers, "--servers")
    if any(k not in SERVER_KINDS for k in kinds):
        raise click.BadParameter(f"servers are {', '.join(SERVER_KINDS)}", param_hint="--servers")
    if kinds and not artifact:
        raise click.UsageError("give ARTIFACT to start servers, or --url for running ones")
    cores = os.cpu_count() or 1
    started = time.monotonic()
    load_before = _loadavg()
    cells: dict[tuple[str, str, int], Cell] = {}
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
        for c, repeat, name, drafter in rounds(list(targets), drafter_list, clients, repeats, plain):
            key = (name, drafter, c)
            cell = cells.setdefault(key, Cell(name, drafter, c))
            if time.monotonic() - started > time_limit:
                not_run.append(f"{name}/{drafter}/c{c}/round{repeat + 1}")
                continue
            process = started_here.get(name)
            cpu_before = process.cpu_seconds() if process else None
            # rounds start at different prompts, so each round's first requests are not always the same ones
            records, seconds = asyncio.run(run_round(targets[name], model, cases, drafter, c,
                                                     round_sizes(requests, repeats, c, min_waves)[repeat],
                                                     repeat * c, max_tokens, num_draft_tokens, name in plain))
            cell.records += records
            cell.seconds += seconds
            if process is not None:
                cell.cpu_seconds = (cell.cpu_seconds or 0.0) + process.cpu_seconds() - cpu_before
            failed = sum(not r.ok for r in records)
            click.echo(f"  {name:8s} {drafter:6s} clients {c:2d} round {repeat + 1}: {len(records)} requests "
                       f"in {seconds:6.1f} s, {sum(r.tokens for r in records) / seconds:6.1f} tok/s"
                       + (f", server CPU {cell.cpu_seconds:.1f} s so far" if process is not None else "")
                       + (f", {failed} failed ({records[[r.ok for r in records].index(False)].error})"
                          if failed else ""), err=True)
    summaries = [summarize(cells[key]) for key in sorted(cells, key=lambda k: (list(targets).index(k[0]), k[2],
                                                                               drafter_list.index(k[1])))]
    differ = mismatches([cell for cell in cells.values() if cell.server not in plain])
    setup = {
        "setup": (f"{cores} cores; servers {', '.join(targets)}; "
                  + (f"{generations} concurrent generations per server (engine threads {max(1, cores // generations)} "
                     "each); " if kinds else "servers started by the caller, as configured there; ")
                  + f"{len(cases)} prompts "
                  f"({Path(prompts_path or PROMPTS_FILE).name}), streamed greedy chat completions, max_tokens "
                  f"{max_tokens}; {requests} requests per cell in {repeats} alternating rounds"
                  + (f" (at least {min_waves} per client a round)" if min_waves else "") + "; closed-loop clients; "
                  f"machine load average {load_before} at the start, {_loadavg()} at the end"),
        "command": " ".join(["python -m specdec.benchmarks.serve_load", *sys.argv[1:]]),
        "equal_texts": "yes" if not differ else f"no: prompts {', '.join(differ)} differ",
        "not_run": not_run,
    }
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


def plot(summaries: Sequence[dict[str, Any]], path: str) -> None:
    """Write a PNG: aggregate tokens/s (left) and TTFT p90 (right) against clients, a line per server x decoding."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    lines: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for s in summaries:
        lines.setdefault((s["server"], s["drafter"]), []).append(s)
    for (server, drafter), points in lines.items():
        points = sorted(points, key=lambda s: s["concurrency"])
        label = f"{server}, {DRAFTER_LABELS.get(drafter, drafter)}"
        clients = [s["concurrency"] for s in points]
        left.plot(clients, [s["tokens_per_second"] or 0 for s in points], marker="o", label=label)
        right.plot(clients, [s.get("ttft_p90") or 0 for s in points], marker="o", label=label)
    ticks = sorted({s["concurrency"] for s in summaries})
    for axis, title in ((left, "aggregate output tokens/s"), (right, "time to first token, p90 (s)")):
        axis.set_xscale("log", base=2)
        axis.set_xticks(ticks, [str(t) for t in ticks])
        axis.set_xlabel("streaming clients")
        axis.set_title(title)
        axis.grid(alpha=0.3)
    right.set_yscale("log")
    left.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    main()
