"""`make bench-structured`: structured outputs, tool calls and predicted-output edits served side by side.

    python -m specdec.benchmarks.structured_bench artifacts/smollm2 --clients 1,4,8 --requests 16 --rounds 2 \
        --threads 2 --llama-server .anchors/build/bin/llama-server --gguf MODEL.gguf \
        --vllm-python .venv-vllm/bin/python --hf-folder benchmarks/out/smollm2-hf

Three workloads (structured_workloads: extract under a strict JSON schema, a required tool call, a small edit
sent with its original as the `prediction`), each at every --clients count of closed-loop streaming clients.
specdec runs each request twice over: target-only (drafter none, the same grammar) and speculation (drafter
auto, K auto); llama-server (--jinja, for tools) and vLLM CPU, when given, run their own plain decoding of the
same requests, each server at --threads threads. Rounds alternate servers and decodings (serve_load.rounds),
so load from elsewhere on the machine falls on all alike. Every request is a greedy streamed chat completion
sent by serve_load's client; the report (structured_report) gives per cell the share of valid answers, output
tokens/s, TTFT p50/p90, prediction tokens accepted/rejected, the grammar's mask cost per target call, and
tokens/s against specdec's target-only cell. Writes structured.json (every request), structured.md and
structured.png to --output; --results also writes the report (and its plot beside it) elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

import click

from specdec.benchmarks.serve_load import (ServerProcess, _csv, _loadavg, check_loopback, round_sizes, round_start,
                                           rounds)
from specdec.benchmarks.serve_load_client import run_round
from specdec.benchmarks.structured_report import (BASE_SERVER, StructuredCell, differing, edit_references, markdown,
                                                  plot, summarize_cell)
from specdec.benchmarks.structured_workloads import (MAX_TOKENS, STRUCTURED_FILE, WORKLOADS, StructuredItem,
                                                     load_items, request_fields)
from specdec.models.errors import SpecdecError
from specdec.runtime.machine import cpu_model

MODEL = "smollm2"  # the name every server started here serves the model under
# Every server started here prefills every prompt whole: rounds send the same prompts again, and a prefix cache
# served some of them (which, depended on the order of the rounds and the slots), so one decoding's rounds found
# more prompts cached than the other's (edits, 1 client: target-only TTFT p50 0.19 s, speculation 0.03 s, reading
# 2.79x where both uncached read 2.63x). A new document to edit or extract from is uncached too.
NO_PROMPT_CACHE = "every server started here without prompt caching (specdec --no-prefix-cache, llama-server " \
                  "--no-cache-prompt, vLLM --no-enable-prefix-caching): each request prefills its whole prompt"
DECODINGS = ("none", "auto")  # specdec's: target-only, then speculation
ANCHOR_START_TIMEOUT = 900.0  # vLLM CPU takes minutes to start on 2 cores


class AnchorProcess(ServerProcess):
    """A server that is not specdec (llama-server, vLLM) in a child process on a port chosen beforehand; waits,
    reports CPU and stops like ServerProcess."""

    def __init__(self, kind: str, command: list[str], env: dict[str, str], port: int):
        self.kind, self.command = kind, command
        self.output: list[str] = []
        self.url = f"http://127.0.0.1:{port}"
        self._listening = threading.Event()
        self._listening.set()  # the port is known: wait_ready goes straight to polling /health
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output = (self.output + [line])[-200:]  # the tail, for the error if it dies


def anchor_commands(threads: int, slots: int, llama_server: str | None, gguf: str | None, vllm_python: str | None,
                    hf_folder: str | None) -> dict[str, tuple[list[str], dict[str, str], int]]:
    """Return {name: (command, environment, port)} of the anchors asked for, each at `threads` threads, as
    tools/bench_serve.py starts them; llama-server with --jinja (its tool calls need the chat template). Neither
    caches prompts (NO_PROMPT_CACHE says why)."""
    from specdec.serve.ray_app import free_port

    env = dict(os.environ)
    servers = {}
    if llama_server:
        port = free_port("127.0.0.1")
        servers["llama-server"] = ([llama_server, "-m", str(gguf), "-np", str(slots), "-t", str(threads),
                                    "-c", str(1024 * slots), "--jinja", "--no-cache-prompt", "--alias", MODEL,
                                    "--host", "127.0.0.1",
                                    "--port", str(port)], env, port)
    if vllm_python:
        port = free_port("127.0.0.1")
        vllm_env = {**env, "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_KVCACHE_SPACE": "2",
                    "OMP_NUM_THREADS": str(threads)}
        vllm = str(Path(vllm_python).with_name("vllm"))
        # tool_choice "required" needs a tool-call parser in vLLM; hermes reads the <tool_call> JSON its
        # chat template asks for
        servers["vllm"] = ([vllm, "serve", str(hf_folder), "--dtype", "float32", "--max-num-seqs", "16",
                            "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--no-enable-prefix-caching",
                            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL], vllm_env, port)
    return servers


def _none(value: str | None) -> str | None:
    return None if value is None or value.lower() == "none" else value


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("artifact", required=False, type=click.Path(file_okay=False))
@click.option("--url", default=None, metavar="URL",
              help="Drive a running specdec server instead of starting one from ARTIFACT (loopback only).")
@click.option("--model", default=None,
              help=f"`model` sent with requests (default: '{MODEL}' for servers started here, none with --url).")
@click.option("--workloads", default=",".join(WORKLOADS), show_default=True,
              help="Workloads to run (comma list of extract, tools, edit).")
@click.option("--clients", default="1,4,8", show_default=True,
              help="Closed-loop streaming client counts (comma list); each client sends its next request when its "
                   "last one ended.")
@click.option("--requests", type=click.IntRange(min=1), default=16, show_default=True,
              help="Requests per cell (workload x server x decoding x clients), split over --rounds.")
@click.option("--rounds", "repeats", type=click.IntRange(min=1), default=2, show_default=True,
              help="Rounds per workload and client count; each round runs every server and decoding once, "
                   "alternating their order.")
@click.option("--min-waves", type=click.IntRange(min=0), default=0, show_default=True,
              help="Each round sends at least this many requests per client (0: just its share of --requests).")
@click.option("--max-tokens", type=click.IntRange(min=1), default=None,
              help="max_tokens of every request (default per workload: "
                   + ", ".join(f"{w} {n}" for w, n in MAX_TOKENS.items()) + ").")
@click.option("--num-draft-tokens", "-k", default="auto", show_default=True, metavar="K|auto",
              help="K of specdec's speculation cells.")
@click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True,
              help="Threads of every server started here (specdec --threads, llama-server -t, vLLM's OpenMP).")
@click.option("--max-batch", default="auto", show_default=True, metavar="N|auto",
              help="specdec --max-batch, and llama-server's -np (auto: the artifact's serving slots).")
@click.option("--llama-server", default=None, metavar="BIN", help="llama-server binary to run beside (none: not run).")
@click.option("--gguf", default=None, metavar="FILE", help="The GGUF llama-server serves.")
@click.option("--vllm-python", default=None, metavar="PY",
              help="python of a vLLM CPU venv to run `vllm serve` beside (none: not run).")
@click.option("--hf-folder", default=None, metavar="DIR", help="The Hugging Face folder vLLM serves.")
@click.option("--data", "data_path", type=click.Path(dir_okay=False), default=None,
              help="Workload set (JSON lines; default: specdec's structured-heldout.jsonl).")
@click.option("--time-limit", type=click.FloatRange(min=1), default=3600.0, show_default=True,
              help="Seconds for the whole run; no new round starts after it.")
@click.option("--output", type=click.Path(file_okay=False), default="benchmarks/out/structured", show_default=True,
              help="Folder for structured.json (every request), structured.md and structured.png.")
@click.option("--results", type=click.Path(dir_okay=False), default=None,
              help="Also write the report here (e.g. benchmarks/STRUCTURED.md), its plot beside it as .png.")
@click.option("--json", "as_json", is_flag=True, help="Print the setup and every cell's figures as JSON.")
def main(**options) -> None:
    """Serve structured outputs, tool calls and predicted edits with specdec target-only and speculation (and
    llama-server / vLLM); print validity, tokens/s, TTFT, prediction tokens and mask cost per cell."""
    try:
        _main(**options)
    except SpecdecError as err:
        raise click.ClickException(str(err)) from None


def _main(*, artifact, url, model, workloads, clients, requests, repeats, min_waves, max_tokens, num_draft_tokens,
          threads, max_batch, llama_server, gguf, vllm_python, hf_folder, data_path, time_limit, output, results,
          as_json) -> None:
    chosen = _csv(str, workloads, "--workloads")
    if any(w not in WORKLOADS for w in chosen):
        raise click.BadParameter(f"workloads are {', '.join(WORKLOADS)}", param_hint="--workloads")
    loads: list[int] = _csv(int, clients, "--clients")
    if min(loads) < 1:
        raise click.BadParameter("client counts must be >= 1", param_hint="--clients")
    llama_server, vllm_python = _none(llama_server), _none(vllm_python)
    if llama_server and not gguf:
        raise click.UsageError("--llama-server needs --gguf (the GGUF it serves)")
    if vllm_python and not hf_folder:
        raise click.UsageError("--vllm-python needs --hf-folder (the Hugging Face folder it serves)")
    if bool(url) == bool(artifact):
        raise click.UsageError("give ARTIFACT to start specdec serve, or --url for a running one (not both)")
    items = load_items(data_path or STRUCTURED_FILE)
    by_workload = {w: [item for item in items if item.workload == w] for w in chosen}
    empty = [w for w, group in by_workload.items() if not group]
    if empty:
        raise SpecdecError(f"the workload set has no '{empty[0]}' items")
    model = model or (None if url else MODEL)
    started = time.perf_counter()
    load_before = _loadavg()
    with ExitStack() as stack:
        targets, processes = _start_servers(stack, artifact, url, threads, max_batch, llama_server, gguf,
                                            vllm_python, hf_folder)
        plain = [name for name in targets if name != BASE_SERVER]
        cells, not_run = _run(targets, processes, plain, by_workload, loads, requests, repeats, min_waves, max_tokens,
                              num_draft_tokens, model, started + time_limit)
    lookup = {w: {item.id: item for item in group} for w, group in by_workload.items()}
    references = edit_references(cells.values())
    order = list(targets)
    keys = sorted(cells, key=lambda k: (chosen.index(k[0]), order.index(k[1]), k[3], DECODINGS.index(k[2])))
    summaries = [summarize_cell(cells[k], lookup[k[0]], references, cells.get((k[0], BASE_SERVER, "none", k[3])))
                 for k in keys]
    differ = differing(c for c in cells.values() if c.server == BASE_SERVER)
    setup = {
        "setup": (f"{os.cpu_count()} cores; servers {', '.join(targets)}"
                  + (f" at {threads} threads each" if not url else " (specdec started by the caller)")
                  + f"; workloads {', '.join(f'{w} ({len(by_workload[w])} items)' for w in chosen)} from "
                  f"{Path(data_path or STRUCTURED_FILE).name}; streamed greedy chat completions, max_tokens "
                  + (str(max_tokens) if max_tokens else ", ".join(f"{w} {MAX_TOKENS[w]}" for w in chosen))
                  + f"; {requests} requests per cell in {repeats} alternating rounds; {NO_PROMPT_CACHE}"
                  + (" (specdec: as configured by the caller)" if url else "")
                  + (f" (at least {min_waves} per client a round)" if min_waves else "")
                  + f"; speculation: drafter auto, K {num_draft_tokens}; machine load average {load_before} at the "
                  f"start, {_loadavg()} at the end; {time.perf_counter() - started:.0f} s"),
        "cpu": cpu_model(),
        "threads": (threads if not url else f"{threads} for the servers started here; specdec's as configured by "
                    "the caller" if plain else "as configured by the caller"),
        "command": " ".join(["python -m specdec.benchmarks.structured_bench", *sys.argv[1:]]),
        "equal_texts": "yes" if not differ else f"no: {', '.join(differ)} differ",
        "notes": (["llama-server and vLLM have no Predicted Outputs: their edits go without the prediction, and "
                   "their texts (other weights or kernels) are compared with specdec's target-only text as is"]
                  if plain and "edit" in chosen else [])
        + (["TTFT on tools: the first streamed chunk carrying arguments text (specdec sends a required call's "
            "name, then its arguments as they are decoded)"] if "tools" in chosen else []),
        "not_run": not_run,
    }
    _write(cells, summaries, setup, Path(output), Path(results) if results else None)
    click.echo(json.dumps({"setup": setup, "summaries": summaries}, indent=1) if as_json
               else markdown(summaries, setup))


def _start_servers(stack: ExitStack, artifact, url, threads, max_batch, llama_server, gguf, vllm_python,
                   hf_folder) -> tuple[dict[str, str], dict[str, ServerProcess]]:
    """Start specdec (unless --url) and the anchors asked for, stopped when `stack` closes; return their URLs and
    the processes started here."""
    targets: dict[str, str] = {}
    processes: dict[str, ServerProcess] = {}
    if url:
        targets[BASE_SERVER] = check_loopback(url)
    else:
        click.echo("starting specdec serve ...", err=True)
        server = ServerProcess("process", artifact, 1, os.cpu_count() or 1,
                               ["--max-batch", str(max_batch), "--threads", str(threads), "--model-name", MODEL,
                                "--no-prefix-cache"])
        stack.callback(server.stop)
        targets[BASE_SERVER], processes[BASE_SERVER] = server.wait_ready(), server
    slots = max_batch
    if not str(max_batch).isdigit() and llama_server:  # llama-server gets the slots specdec's auto takes
        from specdec.models.manifest import load_manifest

        slots = load_manifest(Path(artifact), check_files=False).target.serving_slots if artifact else 8
    for name, (command, env, port) in anchor_commands(threads, int(slots) if llama_server else 0, llama_server,
                                                      gguf, vllm_python, hf_folder).items():
        click.echo(f"starting {name}: {' '.join(command)}", err=True)
        anchor = AnchorProcess(name, command, env, port)
        stack.callback(anchor.stop)
        processes[name] = anchor
    for name, process in processes.items():
        if name != BASE_SERVER:
            targets[name] = process.wait_ready(ANCHOR_START_TIMEOUT)
    return targets, processes


def _run(targets: dict[str, str], processes: dict[str, ServerProcess], plain: Sequence[str],
         by_workload: dict[str, list[StructuredItem]], loads: Sequence[int], requests: int, repeats: int,
         min_waves: int, max_tokens: int | None, num_draft_tokens: str, model: str | None,
         deadline: float) -> tuple[dict[tuple[str, str, str, int], StructuredCell], list[str]]:
    """Warm each server and decoding up, then run every workload's rounds; return the cells by (workload, server,
    decoding, clients) and the rounds the time limit left out."""
    cells: dict[tuple[str, str, str, int], StructuredCell] = {}
    not_run: list[str] = []
    for workload, group in by_workload.items():
        cases = [item.case() for item in group]
        extras = {False: {item.id: request_fields(item) for item in group},
                  True: {item.id: request_fields(item, plain=True) for item in group}}
        tokens = max_tokens or MAX_TOKENS[workload]
        for name, url in targets.items():  # warm-up: a decoding's first request loads and calibrates, grammars compile
            for drafter in (["none"] if name in plain else DECODINGS):
                asyncio.run(run_round(url, model, cases, drafter, 1, 1, 0, min(tokens, 16), num_draft_tokens,
                                      name in plain, extras[name in plain]))
        for load, repeat, name, drafter in rounds(list(targets), DECODINGS, loads, repeats, plain):
            cell = cells.setdefault((workload, name, drafter, load), StructuredCell(name, drafter, load,
                                                                                    workload=workload))
            if time.perf_counter() > deadline:
                not_run.append(f"{workload}/{name}/{drafter}/c{load}/round{repeat + 1}")
                continue
            process = processes.get(name)
            cpu_before = process.cpu_seconds() if process else None
            sizes = round_sizes(requests, repeats, load, min_waves)
            records, seconds = asyncio.run(run_round(targets[name], model, cases, drafter, load, sizes[repeat],
                                                     round_start(sizes, repeat, load, len(cases)), tokens,
                                                     num_draft_tokens, name in plain, extras[name in plain]))
            cell.records += records
            cell.seconds += seconds
            cell.round_tokens.append(sum(r.tokens for r in records if r.ok))
            cell.round_seconds.append(seconds)
            if process is not None:
                cell.cpu_seconds = (cell.cpu_seconds or 0.0) + process.cpu_seconds() - cpu_before
            failed = [r for r in records if not r.ok]
            click.echo(f"  {workload:7s} {name:12s} {drafter:4s} clients {load:2d} round {repeat + 1}: "
                       f"{len(records)} requests in {seconds:6.1f} s, "
                       f"{cell.round_tokens[-1] / max(seconds, 1e-9):6.1f} tok/s" + (f", {len(failed)} failed ({failed[0].error})" if failed else ""), err=True)
    return cells, not_run


def _write(cells: dict, summaries: list[dict], setup: dict, folder: Path, results: Path | None) -> None:
    """Write structured.json (setup, figures, every request), structured.md and structured.png to `folder`; the
    report and its plot also to `results` (and results.png) when given."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "structured.json").write_text(json.dumps(
        {"setup": setup, "summaries": summaries,
         "cells": [{**{k: v for k, v in asdict(c).items() if k != "records"},
                    "records": [asdict(r) for r in c.records]} for c in cells.values()]}, indent=1))
    has_figures = any(s["tokens_per_second"] for s in summaries)
    if has_figures:
        plot(summaries, str(folder / "structured.png"))
    (folder / "structured.md").write_text(markdown(summaries, {**setup, "plot": "structured.png" if has_figures
                                                               else None}))
    if results is not None:
        results.parent.mkdir(parents=True, exist_ok=True)
        picture = results.with_suffix(".png")
        if has_figures:  # the plot travels with the report, under the report's name (as `specdec bench --results`)
            plot(summaries, str(picture))
        results.write_text(markdown(summaries, {**setup, "plot": picture.name if has_figures else None}))


if __name__ == "__main__":
    main()
