"""`specdec bench`: the benchmark suite, side by side with the anchors, as Markdown, JSON and PNG."""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import platform
import shutil
import sys
import time
from importlib import metadata
from pathlib import Path

import click
import numpy as np

from specdec.cli.options import json_option, max_new_tokens_option, provider_option, threads_option
from specdec.console import elapsed_progress, one_line_errors
from specdec.models.extras import missing_dependency
from specdec.runtime.config import MAX_DRAFT_TOKENS
from specdec.runtime.machine import cpu_model

GENAI_PREFILL_SAMPLES = 3  # extra prefills per genai worker run: TTFT is a median, as specdec's (3 runs per repeat)
PAIRED_PREFILL_ROUNDS = 8  # per prompt: one specdec and one genai prefill back to back (order alternating)


def _settle() -> None:
    """Leave the machine idle before one side's timed work (specdec/benchmarks/anchors.py: SETTLE_SECONDS)."""
    from specdec.benchmarks.anchors import SETTLE_SECONDS

    time.sleep(SETTLE_SECONDS)


def _paired_prefills(engine, genai, prompt_ids: dict[str, list[int]], rounds: int, progress) -> dict[str, list]:
    """Return {prompt id: [(specdec seconds, genai seconds)]}: the two prefills of a round run back to back,
    so a burst of other load falls on both; the first to run alternates by round, and each starts on a
    settled machine (`_settle`)."""
    from specdec.runtime.engine import GenerationConfig

    pairs: dict[str, list] = {}
    for prompt_id, ids in prompt_ids.items():
        progress(f"time to first token, {rounds} paired rounds: {prompt_id}")
        genai.prefills(ids)  # a first prefill of these ids warms genai up, as a greedy run of them did
        for round_index in range(rounds):
            timed = {}
            for side in (("specdec", "genai") if round_index % 2 == 0 else ("genai", "specdec")):
                _settle()
                if side == "genai":
                    timed[side] = genai.prefills(ids)[0]
                else:
                    result = engine.generate(ids, GenerationConfig(max_new_tokens=1, drafter="none"))
                    timed[side] = result.stats.prefill_seconds
            pairs.setdefault(prompt_id, []).append((timed["specdec"], timed["genai"]))
    return pairs


def _target_graph(engine) -> str:
    """Return the export choices of the target graph that change its speed, in words, for the report's header."""
    spec = engine.target.spec
    head = ("greedy calls read an 8-bit LM head whose argmax is bounded to the fp32 head's (--greedy-head)"
            if engine.target.greedy_head is not None else f"{spec.kv_dtype} LM head")
    pad = f", attention over {1 + spec.attention_pad_rows}+ query rows (--exact-steps)" if spec.attention_pad_rows else ""
    long_calls = (f", calls over {engine.target.long_call_rows} tokens (prefills) take onnxruntime's causal "
                  "attention kernel, shorter ones its flash kernel" if spec.long_call_name else "")
    return head + pad + (f", calls padded to {spec.min_rows} rows" if spec.min_rows > 1 else "") + long_calls


def _machine() -> str:
    cpu = cpu_model() or platform.machine()
    return f"{os.cpu_count()} cores, {cpu}, {platform.system()} {platform.release()}"


def _versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for package in ("specdec", "onnxruntime", "onnxruntime-gpu", "numpy", "tokenizers", "torch", "transformers",
                    "onnxruntime-genai"):
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return out


@click.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--prompts", "prompts_file", type=click.Path(path_type=Path), default=None,
              help="JSON-lines prompt set (default: the versioned set shipped with specdec, specdec/data/prompts.jsonl).")
@max_new_tokens_option(128, "Tokens generated per prompt and run (greedy).", lowest=2, highest=4096)
@click.option("--repeats", type=click.IntRange(1, 50), default=3, show_default=True,
              help="Times every (prompt, configuration) runs; the report quotes medians. With --steps: "
                   "repetitions per cell, in rounds of 3 interleaved with genai's (at least 3 rounds).")
@click.option("-k", "--num-draft-tokens", type=click.IntRange(1, MAX_DRAFT_TOKENS), default=None,
              help="Fixed K of the speculative configurations (default: the artifact's tuned K, else 4).")
@click.option("--anchors/--no-anchors", default=True, show_default=True,
              help="Also run transformers generate (greedy, prompt lookup) when torch is installed.")
@click.option("--genai-python", type=click.Path(path_type=Path), default=None,
              help="Python of a venv with onnxruntime-genai (`make anchors-genai`) to run it as an anchor.")
@click.option("--genai-model", type=click.Path(path_type=Path), default=None,
              help="Folder of the genai builder's model for --genai-python.")
@click.option("--output", "-o", type=click.Path(path_type=Path), default=Path("benchmarks/out"), show_default=True,
              help="Folder for bench.json and bench.png.")
@click.option("--results", type=click.Path(path_type=Path), default=None,
              help="Also write the Markdown report to this file (e.g. benchmarks/RESULTS.md).")
@provider_option("onnxruntime execution provider.")
@threads_option("Threads for specdec's sessions and every anchor: onnxruntime, onnxruntime-genai and torch "
                "(default: all cores).")
@click.option("--shared-threads/--no-shared-threads", default=False, show_default=True,
              help="With a draft model or head: run it and the target on one onnxruntime thread pool "
                   "(see `specdec generate --help`).")
@json_option("Print the JSON document instead of the Markdown table.")
@click.option("--no-plot", is_flag=True, help="Write no PNG.")
@click.option("--steps", is_flag=True,
              help="Instead: time one target call over 1/5/8 new tokens at past 64/256/1024 (graphs taking turns, "
                   "onnxruntime-genai's in the same rounds when --genai-python is given).")
@click.option("--compare", "compare", multiple=True, type=click.Path(path_type=Path), metavar="NAME=ARTIFACT",
              help="With --steps: another artifact's target graph to time alongside (repeatable).")
@one_line_errors
def bench(artifact, prompts_file, max_new_tokens, repeats, num_draft_tokens, anchors, genai_python, genai_model,
          output, results, provider, threads, shared_threads, as_json, no_plot, steps, compare) -> None:
    """Benchmark target-only and every drafter (fixed K and auto) on a prompt set, plus the anchors."""
    threads = threads or os.cpu_count() or 1  # one count for every system, printed in the report
    if steps:
        _bench_steps(artifact, compare, genai_python, genai_model, repeats, provider, threads, results, as_json)
        return
    from specdec.benchmarks.runner import configurations, group_summary, replay_rows, situation_rows, summarize
    from specdec.data import PROMPTS_FILE
    from specdec.runtime.config import DEFAULT_DRAFT_TOKENS
    from specdec.runtime.engine import Engine
    from specdec.runtime.prompts import load_prompts
    progress = elapsed_progress()
    prompt_path = prompts_file or PROMPTS_FILE
    prompts = load_prompts(prompt_path)
    engine = Engine.load(artifact, provider=provider, threads=threads, shared_threads=shared_threads)
    k = num_draft_tokens or int(engine.manifest.runtime_defaults.num_draft_tokens or DEFAULT_DRAFT_TOKENS)
    configs = configurations(engine, k)
    prompt_ids = {case.id: engine.prompt_ids(case.prompt, case.chat) for case in prompts}
    from specdec.benchmarks.genai_anchor import session_options
    genai_options = session_options(threads)
    runs, anchor_runs, paired = _interleaved_runs(engine, prompts, prompt_ids, configs, max_new_tokens, repeats,
                                                  genai_python, genai_model, genai_options, progress)
    ngram_fixed = next(c.name for c in configs if c.drafter == "ngram" and c.num_draft_tokens != "auto")
    cost = _cost_model(runs, ngram_fixed)
    rows = summarize(runs, cost)
    groups = group_summary(rows)
    replays = replay_rows(runs, prompt_ids, rows, cost, sorted({k, 2 * k}), ngram_fixed)
    situations = situation_rows(runs)
    head_to_head = _head_to_head(runs, anchor_runs, prompts, prompt_ids, paired)
    if anchors:  # PyTorch is slow here: one repeat
        anchor_runs += _transformers_runs(engine, prompt_ids, max_new_tokens, sorted(engine.eos_token_ids), threads,
                                          progress)
    anchor_table = _anchor_table(engine, runs, anchor_runs, rows, prompts, prompt_ids, ngram_fixed,
                                 max_new_tokens) if anchor_runs else []
    meta = _meta(engine, artifact, prompt_path, len(prompts), max_new_tokens, repeats, cost,
                 _settings(engine, threads, genai_options if genai_python else None, anchors))
    document = {"meta": meta, "groups": groups, "rows": rows, "replay": replays, "situations": situations,
                "anchors": anchor_table, "target_vs_genai": head_to_head,
                "anchor_runs": [{**a.__dict__, "tokens_per_second": a.tokens_per_second} for a in anchor_runs]}
    _write_bench(document, output, results, no_plot, as_json, progress)


def _interleaved_runs(engine, prompts, prompt_ids: dict[str, list[int]], configs, max_new_tokens: int, repeats: int,
                      genai_python, genai_model, genai_options: dict, progress) -> tuple[list, list, dict]:
    """Return (specdec's runs, onnxruntime-genai's anchor runs, the paired prefills): with --genai-python the
    two take turns prompt by prompt, and genai's anchor runs and pairs are empty without it."""
    from specdec.benchmarks.runner import run_bench

    runs, anchor_runs = [], []
    # specdec and onnxruntime-genai take turns prompt by prompt, so both see the same machine state
    # (turns a whole repeat long let a burst of other load fall on one side only); genai's worker
    # lives through the whole run, so each side is timed while the other holds its model.
    with contextlib.ExitStack() as stack:
        genai = None
        if genai_python:
            from specdec.benchmarks.genai_anchor import GenaiWorker

            progress(f"onnxruntime-genai anchor: {genai_model}, one worker process for the run")
            genai = stack.enter_context(GenaiWorker(genai_python, genai_model, genai_options))
        for repeat in range(repeats):
            for case in prompts:
                if genai is not None:
                    _settle()  # the two sides take turns here
                runs += run_bench(engine, [case], configs, max_new_tokens, 1, progress, first_repeat=repeat)
                if genai is not None:
                    _settle()
                    progress(f"onnxruntime-genai: repeat {repeat + 1}, {case.id}")
                    anchor_runs += genai.run({case.id: prompt_ids[case.id]}, max_new_tokens,
                                             prefill_samples=GENAI_PREFILL_SAMPLES)
        paired = _paired_prefills(engine, genai, prompt_ids, PAIRED_PREFILL_ROUNDS, progress) if genai else {}
    return runs, anchor_runs, paired


def _cost_model(runs: list, ngram_fixed: str):
    """Return the CostModel of the target calls the runs made (verify cost, rollback cost, t(n) per call length)."""
    from specdec.benchmarks.replay import CostModel
    from specdec.benchmarks.runner import BASELINE, call_costs_of_runs, rollback_cost

    # What a call over n tokens costs, from the speculative runs' own target calls (1-token
    # calls where nothing matched, up to K+1 where something did; auto's reach further), each
    # against the target-only step at the same past length: no separate probe.
    spec_runs = [r for r in runs if r.config.name != BASELINE]
    call_costs, verify_cost, one_token_seconds = call_costs_of_runs(
        spec_runs, [r for r in runs if r.config.name == BASELINE])
    return CostModel(verify_cost, rollback_cost([r for r in runs if r.config.name == ngram_fixed], one_token_seconds),
                     call_costs)


def _head_to_head(runs: list, anchor_runs: list, prompts, prompt_ids: dict[str, list[int]], paired: dict) -> list:
    """Return the report's target-only specdec vs onnxruntime-genai rows (decode speed and prefill per prompt)."""
    from specdec.benchmarks.report import target_vs_genai_rows
    from specdec.benchmarks.runner import BASELINE

    return target_vs_genai_rows(
        {case.id: [(r.stats.decode_tokens_per_second, r.stats.prefill_seconds) for r in runs
                   if r.config.name == BASELINE and r.prompt.id == case.id] for case in prompts},
        anchor_runs, {pid: len(ids) for pid, ids in prompt_ids.items()},
        # Model drafts prefill their own model too; target-only and n-gram runs make the same target call.
        {case.id: [r.stats.prefill_seconds for r in runs if r.prompt.id == case.id and r.config.drafter in ("none", "ngram")]
         for case in prompts}, paired)


def _anchor_table(engine, runs: list, anchor_runs: list, rows: list, prompts, prompt_ids: dict[str, list[int]],
                  ngram_fixed: str, max_new_tokens: int) -> list[dict]:
    """Return the report's anchor rows: each anchor's speed beside the specdec configuration it matches, and
    where its tokens part from specdec's target-only output (with the target's top-2 logit gap there)."""
    from specdec.benchmarks.report import anchor_rows
    from specdec.benchmarks.runner import BASELINE
    from specdec.runtime.diagnostics import top2_logit_gap

    baseline_ids = {r.prompt.id: r.token_ids for r in runs if r.config.name == BASELINE and r.repeat == 0}

    def logit_gap(prompt_id: str, position: int) -> float:
        """The target's top-2 logit gap at the first token where an anchor parts from specdec."""
        return top2_logit_gap(engine, prompt_ids[prompt_id] + baseline_ids[prompt_id][:position])

    return anchor_rows(
        anchor_runs, rows, {case.id: case.group for case in prompts}, baseline_ids,
        {"transformers greedy": BASELINE, "transformers prompt-lookup": ngram_fixed,
         "onnxruntime-genai greedy": BASELINE, "onnxruntime-genai ngram": ngram_fixed},
        max_new_tokens, sorted(engine.eos_token_ids), logit_gap)


def _meta(engine, artifact: Path, prompt_path: Path, prompts: int, max_new_tokens: int, repeats: int, cost,
          settings: dict[str, str]) -> dict:
    """Return the report's header: when, where, what ran (artifact, prompt set, settings) and the call costs."""
    from specdec.data import PROMPT_SET_VERSION, PROMPTS_FILE
    from specdec.models.manifest import sha256_of_file

    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": _machine(),
        "command": " ".join(["specdec"] + sys.argv[1:]),
        "artifact": str(artifact),
        "target": engine.manifest.target.source.split("/")[-1],
        "draft": engine.manifest.draft.source.split("/")[-1] if engine.manifest.draft else "none (n-gram drafting)",
        "target_graph": _target_graph(engine),
        # A version names the shipped set only; any other file is known by its name and hash.
        "prompt_set_version": PROMPT_SET_VERSION if prompt_path == PROMPTS_FILE else None,
        "prompt_set_file": prompt_path.name,
        "prompt_set_sha256": sha256_of_file(prompt_path),
        "prompts": prompts,
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
        "provider": engine.provider,
        "verify_cost": cost.verify_cost,
        "call_costs": {str(n): t for n, t in cost.call_costs.items()},
        "rollback_cost": cost.rollback_cost,
        "calibration_seconds": engine.calibration_seconds,
        "call_costs_source": engine.call_costs_source,
        "versions": _versions(),
        "settings": settings,
    }


def _write_bench(document: dict, output: Path, results: Path | None, no_plot: bool, as_json: bool, progress) -> None:
    """Write bench.json, the plot (beside --results when given) and the Markdown report; echo one of them."""
    from specdec.benchmarks.report import markdown_report

    output.mkdir(parents=True, exist_ok=True)
    (output / "bench.json").write_text(json.dumps(document, indent=2) + "\n")
    rows = document["rows"]
    markdown = markdown_report(document["meta"], document["groups"], rows, document["anchors"], document["replay"],
                               document["situations"], document["target_vs_genai"])
    if not no_plot:
        from specdec.cli.plots import plot_bench

        plot_bench(rows, output / "bench.png")
        where = output / "bench.png"
        if results:  # the plot travels with the report, under the report's name
            where = results.with_suffix(".png")
            shutil.copyfile(output / "bench.png", where)
        markdown += f"\n![speedup per prompt and configuration]({where.name if results else where})\n"
    if results:
        results.write_text(markdown)
    click.echo(json.dumps(document, indent=2) if as_json else markdown)
    progress(f"wrote {output / 'bench.json'}" + ("" if no_plot else f", {output / 'bench.png'}")
             + (f", {results}" if results else ""))


def _settings(engine, threads: int, genai_options: dict | None, transformers: bool) -> dict[str, str]:
    """Return per system the settings that decide its speed, as the report's header prints them."""
    session = engine.target.session.get_session_options()
    pools = (f"one shared intra-op pool of {engine.shared_pool} threads for the target and the draft, spinning"
             if engine.shared_pool else
             f"intra_op_num_threads {session.intra_op_num_threads}, inter_op_num_threads "
             f"{session.inter_op_num_threads or 1}, spinning on (the target; a draft model's session off)")
    out = {"specdec": f"onnxruntime {engine.provider}: {pools}, "
                      f"{str(session.graph_optimization_level).split('.')[-1]}, "
                      f"memory arena {'on' if session.enable_cpu_mem_arena else 'off'}, memory pattern "
                      f"{'on' if session.enable_mem_pattern else 'off'}"}
    if genai_options is not None:
        out["onnxruntime-genai"] = "genai_config.json model.decoder.session_options " + json.dumps(genai_options)
    if transformers:
        out["transformers"] = f"torch.set_num_threads({threads}), fp32, eager"
    return out


def _transformers_runs(engine, prompt_ids, max_new_tokens, eos, threads, progress) -> list:
    try:
        from specdec.benchmarks.anchors import load_torch_model, run_transformers
    except ImportError as err:
        progress(f"skipped {missing_dependency(err, 'the transformers anchor', 'export')}")
        return []
    source = engine.manifest.target.source
    if not Path(source).exists():
        progress(f"transformers anchor skipped: target source '{source}' is not on this machine")
        return []
    progress(f"transformers anchor: loading {source}")
    model = load_torch_model(source, threads)
    return run_transformers(model, prompt_ids, max_new_tokens, eos, progress=progress)


def _bench_steps(artifact, compare, genai_python, genai_model, repeats, provider, threads, results, as_json) -> None:
    from specdec.benchmarks.steps import (NEW_TOKENS, PAST_LENGTHS, STEP_REPEATS_PER_ROUND, median_of_rounds,
                                          ratio_table, round_ratios, steps_table, time_steps)
    from specdec.models.manifest import load_manifest
    from specdec.runtime.session import ModelSession

    progress = elapsed_progress()
    named = [("specdec", Path(artifact))]
    for item in compare:
        name, _, path = str(item).partition("=")
        if not path:
            raise click.BadParameter(f"expected NAME=ARTIFACT, got '{item}'", param_hint="--compare")
        named.append((name, Path(path)))
    # The graphs take turns call by call: without spin=False, one's busy-waiting threads slow the next.
    sessions = {name: ModelSession(path, load_manifest(path).target, provider, threads, spin=False)
                for name, path in named}
    from specdec.benchmarks.genai_anchor import GENAI_SYSTEM, GenaiWorker, session_options
    genai_options = session_options(threads, spin=False)
    rounds = max(3, -(-max(repeats, 9) // STEP_REPEATS_PER_ROUND))
    figures: list[dict] = []
    with contextlib.ExitStack() as stack:
        # Started first: genai's process holds its model while specdec's cells are timed, as specdec's
        # holds its graphs while genai's are (docs/FAIR_ANCHORS.md, "Keeping the comparison fair").
        genai = stack.enter_context(GenaiWorker(genai_python, genai_model, genai_options)) if genai_python else None
        tokens = np.random.default_rng(0).integers(100, 40000, size=max(PAST_LENGTHS) + max(NEW_TOKENS)).tolist()
        for number in range(rounds):
            progress(f"round {number + 1} of {rounds}")
            cells: dict = {}
            # Both sides in every round, who goes first alternating: the machine drifts over minutes.
            sides = [lambda: time_steps(sessions, repeats=STEP_REPEATS_PER_ROUND)]
            if genai is not None:
                sides.append(lambda: genai.steps(tokens, PAST_LENGTHS, NEW_TOKENS, STEP_REPEATS_PER_ROUND))
            for side in (sides if number % 2 == 0 else sides[::-1]):
                cells.update(side())
            figures.append(cells)
    medians = median_of_rounds(figures)
    table = steps_table(medians)
    if genai_python:
        table += "\n\n" + ratio_table(round_ratios(figures, "specdec", GENAI_SYSTEM), "specdec", GENAI_SYSTEM)
    if as_json:
        click.echo(json.dumps([{"graph": g, "past": p, "new_tokens": n, "seconds": t,
                                "rounds": [f[(g, p, n)] for f in figures if (g, p, n) in f]}
                               for (g, p, n), t in medians.items()], indent=2))
    else:
        click.echo(table)
    if results:
        header = (f"# Target step times\n\n- date: {_dt.datetime.now(_dt.timezone.utc).isoformat(timespec='seconds')}\n"
                  f"- machine: {_machine()}\n- command: `{' '.join(['specdec'] + sys.argv[1:])}`\n"
                  f"- {rounds} rounds; in each, {STEP_REPEATS_PER_ROUND} alternating repetitions per cell of every "
                  "specdec graph, and of onnxruntime-genai's (who goes first alternates by round); figures are "
                  "medians of the rounds' medians, and the last table gives specdec / genai per round (median and "
                  f"range); specdec sessions: {threads} intra-op threads, without thread spinning (they take turns); "
                  "onnxruntime-genai in its own process, alive throughout, genai_config session_options "
                  f"{json.dumps(genai_options)}; graphs: "
                  + ", ".join(f"{n} = {p}" for n, p in named) + (", onnxruntime-genai = its builder's graph"
                                                                   if genai_python else "") + "\n\n")
        results.write_text(header + table + "\n")
