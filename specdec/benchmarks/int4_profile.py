"""`python -m specdec.benchmarks.int4_profile`: where an int4 call's time goes, specdec's graph beside genai's.

onnxruntime's profiler (`SessionOptions.enable_profiling`) on both int4 graphs, same session
settings, one process, taking turns call by call: a 1-token step and a 5-token call at a
fixed past (the context rolled back after each call). specdec's target runs through
`ModelSession.forward` (so an int4 target with min_rows 2 runs its 1-token step as a 2-row
call, as the runtime does); genai's graph (`make anchors-genai-int4`) is driven by
onnxruntime directly, its KV buffers shared in place as genai's runtime binds them.

Per call shape and graph: wall time per call (Python included), the profiler's `model_run`
time, the sum of node kernel times, and the kernel time per operator type; the gaps between
them are the per-call overhead inside onnxruntime but outside the kernels, and outside
onnxruntime (binding, Python). The profiler itself adds to both. Prints Markdown (or --json).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import click
import numpy as np

from specdec.console import one_line_errors

SHAPES = (1, 5)  # tokens per call: a decoding step and a 4-draft verify call


def _profile_events(path: str) -> list[dict]:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def summarize_profile(events: list[dict], skip_runs: int) -> dict:
    """Return {"runs", "model_run_ms", "kernels_ms", "by_op": {op: ms}} per run, averaged over the profile's
    `model_run`s after the first `skip_runs` (the prefill and warm-up), node events assigned to their run."""
    runs = sorted((e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"),
                  key=lambda e: e["ts"])[skip_runs:]
    nodes = [e for e in events if e.get("cat") == "Node" and str(e.get("name", "")).endswith("_kernel_time")]
    by_op: dict[str, float] = defaultdict(float)
    kernels = 0.0
    for node in nodes:
        if any(run["ts"] <= node["ts"] <= run["ts"] + run["dur"] for run in runs):
            by_op[node["args"].get("op_name", "?")] += node["dur"]
            kernels += node["dur"]
    n = max(len(runs), 1)
    return {"runs": len(runs), "model_run_ms": sum(r["dur"] for r in runs) / n / 1000,
            "kernels_ms": kernels / n / 1000,
            "by_op": {op: us / n / 1000 for op, us in sorted(by_op.items(), key=lambda kv: -kv[1])}}


class GenaiGraph:
    """genai's int4 graph under onnxruntime: mask input, past and present bound to one buffer per tensor."""

    def __init__(self, model_dir: Path, threads: int, profile_prefix: str, capacity: int):
        import onnxruntime as ort

        from specdec.benchmarks.genai_anchor import session_options

        options = ort.SessionOptions()
        for key, value in session_options(threads).items():
            if key == "intra_op_num_threads":
                options.intra_op_num_threads = value
            elif key == "inter_op_num_threads":
                options.inter_op_num_threads = value
            elif key.startswith("session."):
                options.add_session_config_entry(key, value)
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
        self.session = ort.InferenceSession(str(Path(model_dir) / "model.onnx"), options,
                                            providers=["CPUExecutionProvider"])
        decoder = json.loads((Path(model_dir) / "genai_config.json").read_text(encoding="utf-8"))["model"]["decoder"]
        shape = (1, decoder["num_key_value_heads"], capacity, decoder["head_size"])
        self.pasts = [i.name for i in self.session.get_inputs() if i.name.startswith("past_key_values")]
        self.buffers = {name: ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float32)) for name in self.pasts}
        self.length = 0

    def forward(self, token_ids: list[int]) -> None:
        """Run `token_ids` after the cached positions; the cache grows by them."""
        binding = self.session.io_binding()
        total = self.length + len(token_ids)
        binding.bind_cpu_input("input_ids", np.array([token_ids], dtype=np.int64))
        binding.bind_cpu_input("attention_mask", np.ones((1, total), dtype=np.int64))
        for name, value in self.buffers.items():
            binding.bind_ortvalue_input(name, value)
            binding.bind_ortvalue_output(name.replace("past_key_values", "present"), value)
        binding.bind_output("logits")
        self.session.run_with_iobinding(binding)
        binding.get_outputs()[0].numpy()
        self.length = total


def profile(int4_artifacts: list[Path], genai_int4: Path | None, past: int, calls: int, threads: int,
            progress) -> dict:
    """Return {graph: {tokens per call: summary with "wall_ms"}} for specdec's int4 targets and genai's int4."""
    from specdec.runtime.engine import Engine
    from specdec.runtime.providers import CheckSettings, checked_sessions

    context = [int(t) for t in np.random.default_rng(0).integers(100, 40000, past)]
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="specdec-int4-profile-") as scratch:
        runners = {}
        for n in SHAPES:
            for index, artifact in enumerate(int4_artifacts):
                folder = Path(scratch) / f"specdec-{index}-{n}"
                folder.mkdir()
                with checked_sessions(CheckSettings(profile_dir=folder)):
                    engine = Engine.load(artifact, provider="cpu", threads=threads, check_files=False)
                cache = engine.target.new_cache(past + 16)
                engine.target.forward(cache, context, logits_rows=1)

                def specdec_call(n=n, engine=engine, cache=cache):
                    engine.target.forward(cache, context[:n], logits_rows=n)
                    cache.rollback(past)
                spec = engine.target.spec
                name = f"specdec {Path(artifact).name} (min_rows {spec.min_rows})"
                runners[(name, n)] = (specdec_call, engine.target.session)
            if genai_int4 is not None:
                graph = GenaiGraph(genai_int4, threads, str(Path(scratch) / f"genai-{n}"), past + 16)
                graph.forward(context)

                def genai_call(n=n, graph=graph):
                    graph.forward(context[:n])
                    graph.length = past
                runners[("genai int4", n)] = (genai_call, graph.session)
        walls: dict = defaultdict(list)
        warmup = 3
        for i in range(calls + warmup):
            order = list(runners.items()) if i % 2 == 0 else list(runners.items())[::-1]
            for key, (call, _) in order:
                start = time.perf_counter()
                call()
                if i >= warmup:
                    walls[key].append((time.perf_counter() - start) * 1000)
        progress(f"{calls} calls per shape and graph timed; reading the profiles")
        for (name, n), (_, session) in runners.items():
            summary = summarize_profile(_profile_events(session.end_profiling()), skip_runs=1 + warmup)
            summary["wall_ms"] = statistics.median(walls[(name, n)])
            summary["wall_mean_ms"] = statistics.fmean(walls[(name, n)])
            out.setdefault(name, {})[n] = summary
    return out


def markdown(doc: dict) -> str:
    """Return the Markdown report of a profile document."""
    lines = ["# int4 calls under onnxruntime's profiler: specdec's graph beside genai's", "",
             f"Generated by `python -m specdec.benchmarks.int4_profile` at {doc['date']}. Setup: {doc['setup']}.", "",
             "| graph | tokens/call | wall ms (median) | wall ms (mean) | model_run ms (mean) | kernels ms (mean) | "
             "in the run, outside kernels | outside the run |", "|---|---|---|---|---|---|---|---|"]
    for name, shapes in doc["graphs"].items():
        for n, s in shapes.items():
            lines.append(f"| {name} | {n} | {s['wall_ms']:.2f} | {s['wall_mean_ms']:.2f} | {s['model_run_ms']:.2f} | "
                         f"{s['kernels_ms']:.2f} | {s['model_run_ms'] - s['kernels_ms']:.2f} | "
                         f"{s['wall_mean_ms'] - s['model_run_ms']:.2f} |")
    ops = list(dict.fromkeys(op for shapes in doc["graphs"].values() for s in shapes.values() for op in s["by_op"]))
    columns = [(name, n) for name, shapes in doc["graphs"].items() for n in shapes]
    lines += ["", "Kernel time per operator type (ms per call):", "",
              "| operator | " + " | ".join(f"{name}, {n} tok" for name, n in columns) + " |",
              "|---|" + "---|" * len(columns)]
    for op in ops:
        cells = [f"{doc['graphs'][name][n]['by_op'].get(op, 0.0):.2f}" for name, n in columns]
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


@click.command()
@click.option("--int4-artifact", "int4_artifacts", type=click.Path(path_type=Path, exists=True, file_okay=False),
              required=True, multiple=True,
              help="specdec int4 target (specdec export --weights int4 --draft none); repeat to compare several.")
@click.option("--genai-int4", type=click.Path(path_type=Path, exists=True, file_okay=False), default=None,
              help="genai's int4 build (make anchors-genai-int4); omitted: specdec's graph only.")
@click.option("--past", type=click.IntRange(1, 4096), default=64, show_default=True,
              help="Cached positions before every profiled call.")
@click.option("--calls", type=click.IntRange(1, 1000), default=48, show_default=True,
              help="Profiled calls per shape and graph (after 3 warm-up calls).")
@click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True, help="Intra-op threads.")
@click.option("--output", type=click.Path(path_type=Path), default=None, help="Also write the Markdown report here.")
@click.option("--json", "as_json", is_flag=True, help="Print the JSON document instead of the Markdown report.")
@one_line_errors
def main(int4_artifacts, genai_int4, past, calls, threads, output, as_json) -> None:
    """Profile 1-token and 5-token calls of specdec's and genai's int4 graphs, taking turns."""
    import datetime as _dt
    import os

    from specdec.console import elapsed_progress

    graphs = profile(list(int4_artifacts), genai_int4, past, calls, threads, elapsed_progress())
    doc = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "setup": f"past {past}, {calls} calls per shape and graph taking turns, {threads} threads, "
                    f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end",
           "graphs": {name: {str(n): s for n, s in shapes.items()} for name, shapes in graphs.items()}}
    report = markdown(doc)
    if output:
        Path(output).write_text(report, encoding="utf-8")
    click.echo(json.dumps(doc, indent=1) if as_json else report)


if __name__ == "__main__":
    main()
