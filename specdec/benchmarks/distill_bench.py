"""Bench of a distilled artifact: target-only vs the trained head (and prompt lookup), alternating, one run.

    python -m specdec.benchmarks.distill_bench ART [--plain PLAIN_ART] [--repeats 2] [--json]

Per prompt of specdec/data/prompts.jsonl and prompts-heldout.jsonl: decode tok/s of each
configuration over target-only's in the same repeat (configurations alternate inside a
repeat, so a busy machine slows all alike), per-token acceptance (alpha), acceptance per
draft position, the draft's cost c, and Theorem 3.8's speedup for the measured alpha and c.
With --plain, also the target step of the untapped graph against the tapped one (the hidden
output's cost).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import click
import numpy as np

from specdec.data import HELDOUT_PROMPTS_FILE, PROMPTS_FILE
from specdec.runtime.engine import Engine, GenerationConfig

GREEDY = {"open": [("eagle K=1", dict(drafter="eagle", num_draft_tokens=1)),
                   ("eagle K=3", dict(drafter="eagle", num_draft_tokens=3)),
                   ("eagle auto", dict(drafter="eagle", num_draft_tokens="auto"))],
          "grounded": [("ngram auto", dict(drafter="ngram", num_draft_tokens="auto")),
                       ("ngram+eagle auto", dict(drafter="ngram+eagle", num_draft_tokens="auto"))]}
SAMPLED = [("eagle K=1 T=0.7", dict(drafter="eagle", num_draft_tokens=1, temperature=0.7)),
           ("eagle K=3 T=0.7", dict(drafter="eagle", num_draft_tokens=3, temperature=0.7))]


def _prompts() -> list[dict]:
    rows = []
    for path in (PROMPTS_FILE, HELDOUT_PROMPTS_FILE):
        for line in path.read_text().splitlines():
            if line.strip():
                rows.append({**json.loads(line), "set": path.name})
    return rows


def _positions(iterations, width: int = 8) -> tuple[np.ndarray, np.ndarray]:
    reached, accepted = np.zeros(width, int), np.zeros(width, int)
    for it in iterations:
        if it.drafted:
            tried = min(len(it.drafted), it.num_accepted + 1, width)
            reached[:tried] += 1
            accepted[:min(it.num_accepted, width)] += 1
    return reached, accepted


def run(artifact: Path, repeats: int, max_new_tokens: int, threads: int | None, progress) -> dict:
    """Return per-prompt, per-configuration figures (medians over repeats) and the summary."""
    engine = Engine.load(artifact, provider="cpu", threads=threads)
    rows = []
    reached_all, accepted_all = np.zeros(8, int), np.zeros(8, int)
    for prompt in _prompts():
        ids = engine.prompt_ids(prompt["prompt"], chat=prompt.get("chat", True))
        if len(ids) + max_new_tokens + 40 > engine.max_positions:  # a tiny test model's 512 positions
            progress(f"{prompt['id']}: skipped, {len(ids)} tokens is too long for {engine.max_positions} positions")
            continue
        configs = [("target-only", {}), *GREEDY[prompt["group"]]]
        if prompt["group"] == "open":
            configs += [("target-only T=0.7", dict(temperature=0.7)), *SAMPLED]
        figures: dict[str, list] = {name: [] for name, _ in configs}
        for repeat in range(repeats):
            for name, settings in configs:
                iterations = []
                result = engine.generate(ids, GenerationConfig(max_new_tokens=max_new_tokens, seed=repeat,
                                                               drafter=settings.get("drafter", "none"),
                                                               **{k: v for k, v in settings.items() if k != "drafter"}),
                                         on_iteration=iterations.append)
                s = result.stats
                reached, accepted = _positions(iterations)
                if settings.get("drafter") == "eagle" and settings.get("num_draft_tokens") == 3 \
                        and "temperature" not in settings:  # per-position acceptance at a fixed K
                    reached_all += reached
                    accepted_all += accepted
                figures[name].append({"tps": s.decode_tokens_per_second, "alpha": s.alpha, "c": s.cost_ratio,
                                      "theory": s.theoretical_speedup, "ids": result.token_ids})
        base = {"greedy": figures["target-only"], "sampled": figures.get("target-only T=0.7")}
        row = {"id": prompt["id"], "group": prompt["group"], "set": prompt["set"], "configs": {}}
        for name, runs in figures.items():
            reference = base["sampled" if "T=0.7" in name else "greedy"]
            speedups = [r["tps"] / b["tps"] for r, b in zip(runs, reference)]
            row["configs"][name] = {
                "decode_tps": statistics.median(r["tps"] for r in runs), "speedup": statistics.median(speedups),
                "alpha": statistics.median(r["alpha"] for r in runs), "c": statistics.median(r["c"] for r in runs),
                "theory": statistics.median(r["theory"] for r in runs),
                "greedy_equal": None if "T=0.7" in name else all(r["ids"] == b["ids"] for r, b in zip(runs, reference))}
        rows.append(row)
        progress(f"{prompt['id']}: " + ", ".join(f"{n} {c['speedup']:.2f}x a={c['alpha']:.2f}"
                                                 for n, c in row["configs"].items() if n not in ("target-only",)))
    per_position = [round(a / r, 3) if r else None for a, r in zip(accepted_all, reached_all)]
    summary = {}
    for group in ("open", "grounded"):
        names = {n for r in rows if r["group"] == group for n in r["configs"]}
        if not names:
            continue
        summary[group] = {n: {"median_speedup": statistics.median(r["configs"][n]["speedup"] for r in rows
                                                                   if r["group"] == group),
                              "min_speedup": min(r["configs"][n]["speedup"] for r in rows if r["group"] == group),
                              "median_alpha": statistics.median(r["configs"][n]["alpha"] for r in rows
                                                                if r["group"] == group),
                              "median_theory": statistics.median(r["configs"][n]["theory"] for r in rows
                                                                 if r["group"] == group),
                              "median_c": statistics.median(r["configs"][n]["c"] for r in rows if r["group"] == group)}
                          for n in sorted(names) if n != "target-only"}
    equal = all(c["greedy_equal"] in (None, True) for r in rows for c in r["configs"].values())
    return {"artifact": str(artifact), "repeats": repeats, "max_new_tokens": max_new_tokens, "threads": threads,
            "rows": rows, "summary": summary, "greedy_equal_everywhere": equal,
            "eagle_greedy_acceptance_per_position": per_position}


def step_cost(plain: Path, tapped: Path, threads: int | None, rounds: int = 30) -> dict:
    """Return median 1-token target step times of the untapped and tapped graphs, alternating calls."""
    engines = {"plain": Engine.load(plain, provider="cpu", threads=threads),
               "tapped": Engine.load(tapped, provider="cpu", threads=threads)}
    times: dict[str, list[float]] = {k: [] for k in engines}
    ids = list(range(100, 164))
    caches = {k: e.target.new_cache(200) for k, e in engines.items()}
    for k, e in engines.items():
        e.target.forward(caches[k], ids)
    for i in range(rounds):
        for k, e in engines.items():
            cache = caches[k]
            t0 = time.perf_counter()
            e.target.forward(cache, [7], hidden=k == "tapped")  # the eagle drafter binds the hidden output
            times[k].append(time.perf_counter() - t0)
            cache.rollback(64)
    med = {k: statistics.median(v) * 1000 for k, v in times.items()}
    return {"plain_ms": med["plain"], "tapped_ms": med["tapped"], "ratio": med["tapped"] / med["plain"], "rounds": rounds}


def _curve_rows(training: dict) -> list[dict]:
    """Return a training record's held-out curve, with the untrained head as its first point where recorded."""
    untrained = training.get("untrained_heldout_acceptance") or {}
    start = [{"step": 0, "train_minutes": 0.0, "tokens": 0, **untrained}] if "first" in untrained else []
    return start + training["curve"]


def plot_curve(runs: list[tuple[str, dict]], path: Path) -> None:
    """Write a PNG of held-out acceptance against pair-tokens seen and training minutes.

    `runs`: (label, a manifest's `training` record). One run: both draft positions; several:
    the first position of each, overlaid, to compare training settings or data.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for ax, key, label in ((axes[0], "tokens", "training pair-tokens seen"), (axes[1], "train_minutes", "training minutes")):
        for run_label, training in runs:
            curve = _curve_rows(training)
            xs = [row.get(key, row.get("tokens_seen")) for row in curve]
            if key == "tokens" and any(x is None for x in xs):  # older curves did not record tokens
                xs = [row["step"] for row in curve]
                label = "training steps"
            positions = (("first", "-o"), ("second", "--s")) if len(runs) == 1 else (("first", "-o"),)
            for name, style in positions:
                legend = f"draft position {name}" if len(runs) == 1 else f"{run_label} (first position)"
                ax.plot(xs, [row[name] for row in curve], style, markersize=3, label=legend)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out greedy agreement (teacher-forced)")
    axes[0].legend(fontsize=8)
    if len(runs) == 1:
        training = runs[0][1]
        data = training.get("data", {})
        fig.suptitle(f"specdec distill: {data.get('answer_tokens', '?')} answer tokens, {training.get('steps')} steps, "
                     f"{training.get('wall_minutes')} min wall, seed {training.get('seed')}")
    else:
        fig.suptitle("specdec distill: held-out acceptance of several runs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


@click.command()
@click.argument("artifact", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--plain", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="The same target without the hidden output, to time a target step against.")
@click.option("--repeats", type=click.IntRange(1, 20), default=2, show_default=True, help="Repeats per prompt.")
@click.option("--max-new-tokens", type=click.IntRange(2, 1024), default=128, show_default=True, help="Tokens per run.")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="onnxruntime threads (default: all cores).")
@click.option("--json", "as_json", is_flag=True, help="Print the JSON document.")
@click.option("--curve", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Only write a PNG of the artifact's held-out acceptance curve (its manifest's training record) "
                   "to this path; no bench runs.")
@click.option("--compare", type=click.Path(exists=True, file_okay=False, path_type=Path), multiple=True,
              help="With --curve: overlay these distilled artifacts' curves (first draft position) on ARTIFACT's.")
def main(artifact: Path, plain: Path | None, repeats: int, max_new_tokens: int, threads: int | None,
         as_json: bool, curve: Path | None, compare: tuple[Path, ...]) -> None:
    """Bench a distilled artifact's trained head against target-only decoding (see the module docstring)."""
    if curve:
        from specdec.models.manifest import load_manifest

        runs = []
        for folder in (artifact, *compare):
            draft = load_manifest(folder).feature_draft
            if draft is None:
                raise click.ClickException(f"{folder} has no trained draft head (run specdec distill)")
            runs.append((folder.name, draft.training))
        plot_curve(runs, curve)
        click.echo(f"wrote {curve}")
        return
    report = run(artifact, repeats, max_new_tokens, threads, lambda m: click.echo(m, err=True))
    if plain:
        report["step_cost"] = step_cost(plain, artifact, threads)
    click.echo(json.dumps(report, indent=1, default=str) if as_json else json.dumps(report["summary"], indent=1))


if __name__ == "__main__":
    main()
