"""`python -m specdec.benchmarks.int4`: int4 against onnxruntime-genai's int4, and the int4 copy as a draft.

One run, alternating within every repeat (order reversed on odd repeats):
  - an fp32 target with its int4 copy as the draft (`specdec export --draft quantized:int4`):
    target-only, the model draft at `auto`, prompt lookup at `auto`, both combined at `auto`;
  - an int4 target (`--weights int4`): target-only and prompt lookup at `auto`;
  - onnxruntime-genai's int4 build (`make anchors-genai-int4`): plain greedy and its n-gram mode,
    in its own venv, with specdec's session settings.
Speedups are per prompt and repeat against the same engine's target-only run of that repeat
(genai: against specdec int4 target-only), then the median over repeats. Also measured: the
teacher-forced agreement of both int4 graphs with the fp32 PyTorch model's greedy answers
(specdec/exporter/agreement.py's prompts), genai's graph driven by onnxruntime directly.
Writes bench JSON, a Markdown report and a plot (docs/INT4.md explains the figures).
"""

from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path

import click
import numpy as np

from specdec.benchmarks.runner import BASELINE, BenchConfig, Run, run_bench
from specdec.console import one_line_errors

FP32_CONFIGS = [BenchConfig(BASELINE, "none"), BenchConfig("int4 draft auto", "model", "auto"),
                BenchConfig("ngram auto", "ngram", "auto"), BenchConfig("ngram+int4 draft auto", "ngram+model", "auto")]
INT4_CONFIGS = [BenchConfig(BASELINE, "none"), BenchConfig("ngram auto", "ngram", "auto")]
GENAI_PLAIN, GENAI_NGRAM = "onnxruntime-genai greedy", "onnxruntime-genai ngram"


def genai_teacher_forced(model_dir: Path, answers, threads: int) -> dict:
    """Return {"agreement", "per_prompt", "tokens"} of genai's graph on PyTorch's answers, each prompt + answer
    in one call (onnxruntime directly: genai's generator takes no teacher-forced batch)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(Path(model_dir) / "model.onnx"), options, providers=["CPUExecutionProvider"])
    pasts = [i.name for i in session.get_inputs() if i.name.startswith("past_key_values")]
    decoder = json.loads((Path(model_dir) / "genai_config.json").read_text(encoding="utf-8"))["model"]["decoder"]
    empty = np.zeros((1, decoder["num_key_value_heads"], 0, decoder["head_size"]), dtype=np.float32)
    per_prompt = []
    for ids, answer, _ in answers:
        tokens = np.array([ids + answer[:-1]], dtype=np.int64)
        feeds = {"input_ids": tokens, "attention_mask": np.ones_like(tokens)}
        feeds.update({name: empty for name in pasts})
        logits = session.run(["logits"], feeds)[0][0, len(ids) - 1:]
        per_prompt.append([int((np.argmax(logits, axis=-1) == np.array(answer)).sum()), len(answer)])
    agreed, total = (sum(column) for column in zip(*per_prompt))
    return {"agreement": agreed / total, "per_prompt": per_prompt, "tokens": total}


def agreement_rows(fp32_artifact: Path, int4_artifact: Path, genai_int4: Path | None, threads: int) -> dict:
    """Return teacher-forced agreement with PyTorch's fp32 greedy answers: specdec int4 and genai int4."""
    import tempfile

    from specdec.exporter.agreement import AGREEMENT_FLOOR, float_answers, teacher_forced_agreement
    from specdec.exporter.sources import load_source
    from specdec.models.manifest import load_manifest

    manifest = load_manifest(int4_artifact, check_files=False)
    source = load_manifest(fp32_artifact, check_files=False).target.source
    with tempfile.TemporaryDirectory(prefix="specdec-int4-") as scratch:
        loaded = load_source(source, Path(scratch))
        answers = float_answers(loaded.model, loaded.tokenizer)
    ours = teacher_forced_agreement(int4_artifact, manifest.target, answers, AGREEMENT_FLOOR["int4"])
    out = {"specdec int4": {"agreement": ours.agreement, "per_prompt": ours.per_prompt, "tokens": ours.tokens}}
    if genai_int4 is not None:
        out["onnxruntime-genai int4"] = genai_teacher_forced(genai_int4, answers, threads)
    return out


def _precision(engine) -> str:
    """Return how the int4 target computes: MatMulNBits accuracy level, and how its steps are kept exact."""
    spec = engine.target.spec
    level = spec.optimization.get("quantization", {}).get("accuracy_level", "?")
    parts = []
    if spec.attention_pad_rows:
        parts.append(f"attention over 2+ query rows (attention_pad_rows {spec.attention_pad_rows})")
    if spec.min_rows > 1:  # the export found 1-row MatMuls rounding apart too: every call padded
        parts.append(f"every call over {spec.min_rows}+ rows (min_rows {spec.min_rows})")
    exact = ", ".join(parts) or "1-row calls as they are"
    return f"MatMulNBits accuracy level {level}, {exact}"


def _median_ratio(runs: list, baseline: dict, key) -> float:
    return statistics.median(key(r) / baseline[(r["repeat"], r["prompt"])] for r in runs)


def _record(run: Run, system: str, call_cost=None) -> dict:
    s = run.stats
    # Theorem 3.8 for this run's alpha, c and drafted lengths, with the engine's measured call costs.
    theory = s.expected_speedup(call_cost) if call_cost is not None and s.drafted else 1.0
    return {"system": system, "config": run.config.name, "repeat": run.repeat, "prompt": run.prompt.id,
            "group": run.prompt.group, "token_ids": run.token_ids, "decode_tps": s.decode_tokens_per_second,
            "alpha": s.alpha, "c": s.cost_ratio, "tokens_per_call": s.tokens_per_target_call,
            "theory": theory, "by_situation": s.by_situation}


def summarize(records: list[dict]) -> list[dict]:
    """Return one row per (system, config, prompt): median decode tok/s, speedup against its baseline, greedy equality.

    Baselines: each system's target-only run of the same prompt and repeat; genai's rows and
    specdec int4 target-only are also set against each other (`vs_genai`).
    """
    base = {(r["system"], r["repeat"], r["prompt"]): r for r in records if r["config"] == BASELINE}
    genai = {(r["repeat"], r["prompt"]): r for r in records if r["config"] == GENAI_PLAIN}
    rows = []
    for key in dict.fromkeys((r["system"], r["config"], r["prompt"]) for r in records):
        group = [r for r in records if (r["system"], r["config"], r["prompt"]) == key]
        system, config, prompt = key
        row = {"system": system, "config": config, "prompt": prompt, "group": group[0]["group"],
               "decode_tps": statistics.median(r["decode_tps"] for r in group),
               "alpha": statistics.median(r["alpha"] for r in group),
               "c": statistics.median(r["c"] for r in group),
               "tokens_per_call": statistics.median(r["tokens_per_call"] for r in group),
               "theory": statistics.median(r.get("theory", 1.0) for r in group)}
        if system != "genai":
            row["speedup"] = statistics.median(r["decode_tps"] / base[(system, r["repeat"], prompt)]["decode_tps"]
                                               for r in group)
            row["greedy_equal"] = all(r["token_ids"] == base[(system, r["repeat"], prompt)]["token_ids"]
                                      for r in group)
        else:
            # genai's n-gram mode against its own plain mode (its exactness: same tokens)
            row["speedup"] = statistics.median(r["decode_tps"] / genai[(r["repeat"], prompt)]["decode_tps"]
                                               for r in group)
            row["greedy_equal"] = all(r["token_ids"] == genai[(r["repeat"], prompt)]["token_ids"] for r in group)
        if system == "int4" and config == BASELINE and genai:
            row["vs_genai"] = statistics.median(r["decode_tps"] / genai[(r["repeat"], prompt)]["decode_tps"]
                                                for r in group)
        rows.append(row)
    return rows


def goals(rows: list[dict]) -> list[tuple[str, str, bool]]:
    """Return (goal, measured, met) for the int4 report's goals."""
    def select(system, config, group=None):
        return [r for r in rows if r["system"] == system and r["config"] == config
                and (group is None or r["group"] == group)]
    out = []
    vs = [r["vs_genai"] for r in select("int4", BASELINE) if "vs_genai" in r]
    if vs:
        geo = math.exp(sum(math.log(v) for v in vs) / len(vs))
        out.append(("specdec int4 target-only decode >= 1.0x genai int4 plain (geomean)", f"{geo:.2f}x", geo >= 1.0))
    combined = select("fp32", "ngram+int4 draft auto")
    draft = select("fp32", "int4 draft auto")
    for name, sel in (("fp32 + int4 draft auto", draft), ("fp32 + ngram+int4 draft auto", combined)):
        if sel:
            open_median = statistics.median(r["speedup"] for r in sel if r["group"] == "open")
            low = min(r["speedup"] for r in sel)
            equal = all(r["greedy_equal"] for r in sel)
            out.append((f"{name}: open median >= 1.4x, every prompt >= 1.0x, greedy equal",
                        f"open median {open_median:.2f}x, lowest {low:.2f}x, greedy equal {equal}",
                        open_median >= 1.4 and low >= 1.0 and equal))
    lookup = select("int4", "ngram auto", "grounded")
    if lookup:
        median = statistics.median(r["speedup"] for r in lookup)
        equal = all(r["greedy_equal"] for r in select("int4", "ngram auto"))
        out.append(("int4 target + prompt lookup: grounded median >= 2x, greedy equal",
                    f"{median:.2f}x, greedy equal {equal}", median >= 2.0 and equal))
    return out


def markdown(doc: dict) -> str:
    """Return the Markdown report of a bench document."""
    lines = ["# int4: specdec against onnxruntime-genai, and the int4 copy as a draft", "",
             f"Generated by `python -m specdec.benchmarks.int4` at {doc['date']}. Setup: {doc['setup']}.", "",
             "## Goals", "", "| goal | measured | met |", "|---|---|---|"]
    lines += [f"| {goal} | {measured} | {'yes' if met else 'NO'} |" for goal, measured, met in doc["goals"]]
    if doc.get("agreement"):
        lines += ["", "## Teacher-forced agreement with the fp32 model's greedy answers", "",
                  "| graph | agreement | per prompt (agreed/compared) |", "|---|---|---|"]
        for name, a in doc["agreement"].items():
            per = ", ".join(f"{x}/{n}" for x, n in a["per_prompt"])
            lines.append(f"| {name} | {a['agreement']:.1%} of {a['tokens']} | {per} |")
    lines += ["", "## Per prompt (medians over repeats)", "",
              "| system | configuration | prompt | group | decode tok/s | speedup | Theorem 3.8 | alpha | c | "
              "tokens/call | greedy equal | vs genai plain |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        vs = f"{r['vs_genai']:.2f}x" if "vs_genai" in r else ""
        lines.append(f"| {r['system']} | {r['config']} | {r['prompt']} | {r['group']} | {r['decode_tps']:.1f} | "
                     f"{r['speedup']:.2f}x | {r.get('theory', 1.0):.2f}x | {r['alpha']:.2f} | {r['c']:.2f} | "
                     f"{r['tokens_per_call']:.2f} | "
                     f"{r['greedy_equal']} | {vs} |")
    lines += ["", "Speedup: decode tokens/s over the same system's target-only run of the same prompt and repeat "
              "(genai n-gram: over genai plain; `vs genai plain`: specdec int4 target-only over genai int4 plain). "
              "c: mean draft call over mean target call. Theorem 3.8: Leviathan et al.'s expected speedup for the "
              "run's alpha, c and drafted lengths, target calls costed by the engine's measured call-cost table."]
    return "\n".join(lines) + "\n"


def plot(doc: dict, path: Path) -> None:
    """Write a bar chart of the speedups per prompt and configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in doc["rows"] if r["config"] != BASELINE or "vs_genai" in r]
    labels = sorted({(r["system"], r["config"]) for r in rows})
    prompts = list(dict.fromkeys(r["prompt"] for r in rows))
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(labels)
    for i, (system, config) in enumerate(labels):
        values = [next((r.get("vs_genai", r["speedup"]) for r in rows if (r["system"], r["config"], r["prompt"])
                        == (system, config, p)), 0.0) for p in prompts]
        name = f"{system} {config}" if config != BASELINE else "int4 target-only vs genai int4"
        ax.bar(np.arange(len(prompts)) + i * width, values, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(np.arange(len(prompts)) + 0.4 - width / 2, prompts)
    ax.set_ylabel("decode speedup")
    ax.set_title(doc["setup"], fontsize=8)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


@click.command()
@click.option("--fp32-artifact", type=click.Path(path_type=Path), required=True,
              help="fp32 target with its int4 copy as the draft (specdec export --draft quantized:int4).")
@click.option("--int4-artifact", type=click.Path(path_type=Path), required=True,
              help="int4 target (specdec export --weights int4 --draft none).")
@click.option("--genai-python", type=click.Path(path_type=Path), default=None,
              help="Python of the onnxruntime-genai venv (make anchors-genai).")
@click.option("--genai-int4", type=click.Path(path_type=Path), default=None,
              help="genai's int4 build (make anchors-genai-int4).")
@click.option("--prompts", "prompts_file", type=click.Path(path_type=Path), default=None,
              help="JSON-lines prompt set (default: specdec/data/prompts.jsonl).")
@click.option("--max-new-tokens", type=click.IntRange(2, 4096), default=128, show_default=True,
              help="Greedy tokens per prompt and run.")
@click.option("--repeats", type=click.IntRange(1, 20), default=2, show_default=True,
              help="Times every (prompt, configuration) runs; medians are reported.")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="Threads for every system (default: all cores).")
@click.option("--agreement/--no-agreement", default=True, show_default=True,
              help="Also measure teacher-forced agreement with the fp32 PyTorch model (needs torch).")
@click.option("--output", type=click.Path(path_type=Path), default=Path("benchmarks/out/int4"), show_default=True,
              help="Folder for bench.json.")
@click.option("--results", type=click.Path(path_type=Path), default=None, help="Also write the Markdown report here.")
@click.option("--plot", "plot_path", type=click.Path(path_type=Path), default=None, help="Write the speedup chart here.")
@click.option("--json", "as_json", is_flag=True, help="Print the JSON document instead of the Markdown report.")
@one_line_errors
def main(fp32_artifact, int4_artifact, genai_python, genai_int4, prompts_file, max_new_tokens, repeats, threads,
         agreement, output, results, plot_path, as_json) -> None:
    """Run the int4 rows side by side, alternating, and report them against the int4 goals."""
    import datetime as _dt

    from specdec.data import PROMPTS_FILE
    from specdec.benchmarks.genai_anchor import GenaiWorker, session_options
    from specdec.console import elapsed_progress
    from specdec.runtime.engine import Engine
    from specdec.runtime.prompts import load_prompts

    threads = threads or os.cpu_count() or 1
    progress = elapsed_progress()
    prompts = load_prompts(prompts_file or PROMPTS_FILE)
    fp32 = Engine.load(fp32_artifact, provider="cpu", threads=threads)
    int4 = Engine.load(int4_artifact, provider="cpu", threads=threads)
    prompt_ids = {case.id: int4.prompt_ids(case.prompt, case.chat) for case in prompts}
    records: list[dict] = []

    def fp32_rows(repeat):
        records.extend(_record(r, "fp32", fp32.target_call_costs.relative)
                       for r in run_bench(fp32, prompts, FP32_CONFIGS, max_new_tokens, 1, progress, first_repeat=repeat))

    def int4_rows(repeat):
        records.extend(_record(r, "int4", int4.target_call_costs.relative)
                       for r in run_bench(int4, prompts, INT4_CONFIGS, max_new_tokens, 1, progress, first_repeat=repeat))

    def genai_rows(repeat):
        if genai is None:
            return
        progress(f"onnxruntime-genai int4: repeat {repeat + 1}")
        for run in genai.run(prompt_ids, max_new_tokens):
            case = next(c for c in prompts if c.id == run.prompt_id)
            records.append({"system": "genai", "config": run.system, "repeat": repeat, "prompt": run.prompt_id,
                            "group": case.group, "token_ids": run.token_ids[:max_new_tokens],
                            "decode_tps": run.decode_tokens_per_second, "alpha": 0.0, "c": 0.0,
                            "tokens_per_call": 0.0, "by_situation": {}})

    # One genai process for the whole run: each side is timed while the other holds its model
    # (docs/FAIR_ANCHORS.md, "Keeping the comparison fair").
    genai = GenaiWorker(genai_python, genai_int4, session_options(threads)) if genai_python else None
    try:
        for repeat in range(repeats):
            steps = [fp32_rows, int4_rows, genai_rows]
            for step in (steps if repeat % 2 == 0 else steps[::-1]):
                step(repeat)
    finally:
        if genai is not None:
            genai.close()
    doc = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "setup": f"{len(prompts)} prompts, {max_new_tokens} greedy tokens, {repeats} alternating repeats, "
                    f"{threads} threads for specdec and genai (genai: specdec's session settings), "
                    f"{os.cpu_count()} cores; int4 target: {_precision(int4)}; load average at the end "
                    f"{os.getloadavg()[0]:.1f}",
           "rows": summarize(records)}
    doc["goals"] = goals(doc["rows"])
    if agreement:
        progress("teacher-forced agreement with PyTorch's fp32 answers")
        doc["agreement"] = agreement_rows(fp32_artifact, int4_artifact, genai_int4, threads)
    output.mkdir(parents=True, exist_ok=True)
    (output / "bench.json").write_text(json.dumps({**doc, "records": records}, indent=1), encoding="utf-8")
    report = markdown(doc)
    if results:
        Path(results).write_text(report, encoding="utf-8")
    if plot_path:
        plot(doc, Path(plot_path))
    click.echo(json.dumps(doc, indent=1) if as_json else report)


if __name__ == "__main__":
    main()
