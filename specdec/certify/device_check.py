"""The checks a CUDA machine must pass, as one script: `python -m specdec.certify.device_check ART... --provider cuda`.

It needs only the runtime (numpy, onnxruntime-gpu, tokenizers), so it runs on a lent GPU
machine where specdec's exporter cannot be installed. Per artifact it checks that:
- every session runs on the requested provider (read back: onnxruntime-gpu that cannot
  load CUDA falls back to the CPU in silence);
- every node of the target, draft, draft-head, rollback and ragged-rows graphs that touches
  a float tensor ran there, from onnxruntime's profile of a prefill, a verify, a rollback and a
  step (integer-only shape nodes may run on the CPU and are listed; a Memcpy of a float
  tensor fails); the VERBOSE session log's placements and "not assigned" / Memcpy
  warnings are reported, and a session with CPU fallback disabled is tried (reported);
- a shared KV buffer keeps its device address across those steps, and the cache lives on
  the device;
- the provider's logits equal the CPU's within FP16_STEPS fp16 steps of each row's scale
  (device_proofs.logit_bound), with TF32 off for fp32 graphs;
- greedy speculative output equals greedy target-only output on that provider, token for
  token, for each drafter the artifact has, at K=4 and `auto` (a difference is allowed only
  at a near-tie: top two logits within twice the logit bound);
- the batch engine on that provider (KV slots in one device buffer per tensor, bound by
  address): the slots live on the device, every prompt with every drafter submitted at once
  gives its target-only greedy text (same near-tie rule: were a call's outputs not written into
  the bound slots, the texts would part), and the batched and ragged-rows calls are timed by
  rows (an artifact that cannot batch is reported).
With `--reference cpu` it also reports where the provider's greedy text first parts from
the CPU's. It prints one JSON report and exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from specdec.certify import device_proofs as proofs
from specdec.runtime.diagnostics import first_mismatch
from specdec.runtime.engine import Engine, GenerationConfig
from specdec.runtime.providers import CPU, CUDA, CheckSettings, checked_sessions, ort, stderr_into
from specdec.runtime.session import ModelSession

PROMPTS = (
    "Copy this list exactly: red, green, blue, red, green, blue, red, green",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Once upon a time",
)
KV_DEVICE = {"cuda": "cuda", "cpu": "cpu"}  # session device -> OrtValue.device_name(), lower-cased
EXPECTED_PROVIDER = {"cuda": CUDA, "cpu": CPU}
STRICT_KEY = "session.disable_cpu_ep_fallback"


@dataclass
class ArtifactCheck:
    """What one artifact did on one provider."""

    artifact: str
    requested: str
    target_provider: str = ""
    draft_provider: str | None = None
    kv_device: str = ""
    placement: dict = field(default_factory=dict)  # graph role -> nodes per provider, tolerated, log lines
    logits: dict = field(default_factory=dict)  # model role -> max difference from the CPU, in fp16 steps
    kv_addresses_stable: bool | None = None  # None: no shared buffer to check
    strict_sessions: dict = field(default_factory=dict)  # graph -> outcome with CPU fallback disabled
    runs: list[dict] = field(default_factory=list)  # one per prompt and configuration
    throughput: dict = field(default_factory=dict)  # drafter/K -> mean decode tokens/s over the prompts
    reference_mismatches: list[dict] = field(default_factory=list)
    batch: dict = field(default_factory=dict)  # the batch engine's run (check_batch)
    seconds: dict = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


def _tf32_off(artifact: Path) -> CheckSettings:
    """Return settings with TF32 off when any graph of the artifact is fp32 (else none added)."""
    from specdec.models.manifest import load_manifest

    fp32 = any(spec.kv_dtype == "float32" for spec in load_manifest(artifact, check_files=False).graphs())
    return CheckSettings(cuda_options={"use_tf32": "0"} if fp32 else {})


def _models(engine: Engine) -> dict[str, ModelSession]:
    return {"target": engine.target, **({"draft": engine.draft} if engine.draft else {})}


def _exercise(model: ModelSession, ids: list[int]) -> tuple[np.ndarray, list[list[int]], list[str]]:
    """Run a prefill, a 3-token verify, a rollback of 2 and a 1-token step; return (logits [rows, vocab],
    KV buffer addresses after each call, the cache's device)."""
    cache = model.new_cache(len(ids) + 8)
    rows, addresses = [], []
    for step in (ids, ids[:3], None, ids[-1:]):
        if step is None:
            cache.rollback(cache.length - 2)
            continue
        rows.append(model.forward(cache, step))
        addresses.append([t.data_ptr() for t in cache.tensors])
    device = cache.tensors[0].device_name().lower()
    cache.release()
    return np.concatenate(rows), addresses, device


def _exercise_ragged(model: ModelSession, ids: list[int]) -> None:
    """Run one call of the model's ragged-rows graph (its own KV slots): a 3-token row after a prefilled prompt, a
    1-token row, and the idle rows' throwaway tokens, so that its profile shows where its nodes ran."""
    from specdec.runtime.slots import SlotArena

    arena = SlotArena(model, model.spec.ragged_rows, len(ids) + 16)
    first, second = arena.take(), arena.take()
    model.forward(first, ids, logits_rows=1)
    fed = {first.slot: (first, ids[:3]), second.slot: (second, ids[:1])}
    caches, rows, lengths = arena.ragged_rows(fed)
    model.forward_ragged(arena.ragged_binding(), caches, rows, lengths)


def _profiled(session: ort.InferenceSession) -> list[proofs.NodeRun]:
    path = session.end_profiling()
    return proofs.profile_nodes(json.loads(Path(path).read_text())) if path else []


def strict_session_outcome(path: str, provider: str) -> str:
    """Return "accepted" or onnxruntime's reason when `path` is loaded on CUDA alone with CPU fallback
    disabled ("not tried" off CUDA). The CUDA provider puts shape arithmetic on the CPU on purpose,
    so a refusal is reported, not failed: the profile decides."""
    if provider != "cuda":
        return "not tried (CUDA only: onnxruntime refuses the setting with the CPU provider listed)"
    options = ort.SessionOptions()
    options.add_session_config_entry(STRICT_KEY, "1")
    try:
        ort.InferenceSession(path, sess_options=options, providers=[CUDA])
    except Exception as err:  # noqa: BLE001 - the refusal is the finding
        return str(err).splitlines()[0][:300]
    return "accepted"


def check_proofs(check: ArtifactCheck, artifact: Path, provider: str, workdir: Path) -> None:
    """Add placement, logits-vs-CPU, KV-address and TF32 findings (and failures) to `check`."""
    with stderr_into(io.BytesIO()):  # VERBOSE sessions keep logging as they run: kept out of the report's way
        _check_proofs(check, artifact, provider, workdir)


def _check_proofs(check: ArtifactCheck, artifact: Path, provider: str, workdir: Path) -> None:
    settings = _tf32_off(artifact)
    settings.profile_dir, settings.verbose_log = workdir, True
    with checked_sessions(settings):
        engine = Engine.load(artifact, provider=provider)
        for model in _models(engine).values():
            model.ragged_session()  # the batch engine's graph, profiled and logged like the others
    reference = Engine.load(artifact, provider="cpu")
    expected = EXPECTED_PROVIDER.get(engine.target.device, CPU)
    ids = engine.prompt_ids(PROMPTS[0])
    stable = []
    for role, model in _models(engine).items():
        logits, addresses, _ = _exercise(model, ids)
        reference_logits, _, _ = _exercise(_models(reference)[role], ids)
        check.logits[role] = {"max_steps": round(proofs.max_steps(logits, reference_logits), 3),
                              "bound_steps": proofs.FP16_STEPS[model.spec.kv_dtype]}
        for excess in proofs.logit_excess(logits, reference_logits, model.spec.kv_dtype):
            check.failures.append(f"{role} logits differ from the CPU's by {excess['max_diff']:.4g} "
                                  f"({excess['steps']:.1f} fp16 steps) at row {excess['row']}, bound {excess['bound']:.4g}")
        if model.shared_kv:
            moved = sorted({i for a, b in zip(addresses, addresses[1:]) for i in proofs.moved_buffers(a, b)})
            stable.append(not moved)
            if moved:
                check.failures.append(f"{role} KV buffers {moved[:4]} moved on the device between steps")
        check.failures += [f"{role}: {f}" for f in proofs.tf32_failures(model.session.get_provider_options(),
                                                                         model.spec.kv_dtype)]
        if model.ragged_session() is not None:
            _exercise_ragged(model, ids)
    sessions = {f"{role}/{name}": s for role, m in _models(engine).items() for name, s in m.onnx_sessions().items()}
    if getattr(engine, "eagle", None) is not None:
        sessions["eagle/model"] = engine.eagle.session  # not run above: its profile proves what generate ran
        _run(engine, PROMPTS[0], 8, "eagle", 4)
    for name, session in sessions.items():
        failures, tolerated = proofs.placement_failures(_profiled(session), expected)
        log = settings.logs.get(_graph_path(session), "")
        check.placement[name] = {"log_placements": proofs.log_placements(log), "log_warnings": proofs.log_warnings(log),
                                 "tolerated": tolerated}
        check.failures += [f"{name}: {f}" for f in failures]
        check.strict_sessions[name] = strict_session_outcome(_graph_path(session), engine.target.device)
    check.kv_addresses_stable = all(stable) if stable else None


def _graph_path(session: ort.InferenceSession) -> str:
    """Return the file a session was loaded from (as create_session was given it)."""
    return str(getattr(session, "_model_path", "") or "")


def check_artifact(artifact: Path, provider: str, max_new_tokens: int = 32, reference: str | None = None,
                   prompts: tuple[str, ...] = PROMPTS, workdir: Path | None = None) -> ArtifactCheck:
    """Return the ArtifactCheck of `artifact` on `provider`; `failures` lists every check that failed."""
    check = ArtifactCheck(str(artifact), provider)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        check_proofs(check, artifact, provider, Path(workdir or scratch))
    check.seconds["proofs"] = round(time.perf_counter() - start, 2)
    with checked_sessions(_tf32_off(artifact)):
        engine = Engine.load(artifact, provider=provider)
    check.target_provider = engine.target.provider
    check.draft_provider = engine.draft.provider if engine.draft else None
    expected = EXPECTED_PROVIDER.get(provider)
    for role, actual in (("target", check.target_provider), ("draft", check.draft_provider)):
        if expected and actual is not None and actual != expected:
            check.failures.append(f"{role} session runs on {actual}, not {expected}")
    _, _, check.kv_device = _exercise(engine.target, engine.prompt_ids("hello"))
    wanted_device = KV_DEVICE.get(engine.target.device, "")
    if check.kv_device != wanted_device:
        check.failures.append(f"KV cache is on {check.kv_device}, not {wanted_device}")

    start = time.perf_counter()
    drafters = ["ngram"] + (["model"] if engine.draft else []) + (["eagle"] if getattr(engine, "eagle", None) else [])
    reference_engine = Engine.load(artifact, provider=reference) if reference and reference != provider else None
    for prompt in prompts:
        plain_ids, record = _run(engine, prompt, max_new_tokens, "none", None)
        check.runs.append(record)
        for drafter in drafters:
            for k in (4, "auto"):
                ids, record = _run(engine, prompt, max_new_tokens, drafter, k)
                record["greedy_equals_target_only"] = ids == plain_ids
                check.runs.append(record)
                mismatch = first_mismatch(engine, engine.prompt_ids(prompt), plain_ids, ids)
                if mismatch is not None:
                    tie = near_tie_bound(engine, engine.prompt_ids(prompt) + plain_ids[:mismatch["position"]])
                    record["first_mismatch"] = {**mismatch, "near_tie_bound": tie}
                    if mismatch["top2_logit_gap"] > tie:
                        check.failures.append(f"greedy {drafter} K={k} differs from target-only on {prompt[:30]!r} "
                                              f"at token {mismatch['position']}, not a near-tie")
        if reference_engine is not None:
            reference_ids, _ = _run(reference_engine, prompt, max_new_tokens, "none", None)
            mismatch = first_mismatch(reference_engine, reference_engine.prompt_ids(prompt), reference_ids, plain_ids)
            if mismatch is not None:
                check.reference_mismatches.append({"prompt": prompt[:40], **mismatch})
    check.throughput = throughput(check.runs)
    check.seconds["generate"] = round(time.perf_counter() - start, 2)
    start = time.perf_counter()
    targets = {prompt: _run(engine, prompt, max_new_tokens, "none", None)[0] for prompt in prompts}
    check_batch(check, engine, targets, drafters, max_new_tokens)
    check.seconds["batch"] = round(time.perf_counter() - start, 2)
    return check


def check_batch(check: ArtifactCheck, engine: Engine, targets: dict[str, list[int]], drafters: list[str],
                max_new_tokens: int) -> None:
    """Add the batch engine's run on the engine's provider to `check` (and its failures): every prompt of
    `targets` (prompt -> its target-only greedy ids) with every drafter and target-only, submitted at once."""
    from specdec.models.errors import GenerationError
    from specdec.runtime.batch import BatchEngine

    rows = engine.target.spec.ragged_rows or 4
    try:
        batch = BatchEngine(engine, max_batch=rows, kv_capacity=512)
    except GenerationError as err:
        check.batch = {"skipped": str(err)}
        return
    try:
        jobs = [(prompt, drafter) for prompt in targets for drafter in ["none"] + drafters]
        start = time.perf_counter()
        streams = [batch.stream(prompt, GenerationConfig(max_new_tokens=max_new_tokens, drafter=drafter,
                                                         num_draft_tokens=4 if drafter != "none" else None))
                   for prompt, drafter in jobs]
        results = [_drained(stream) for stream in streams]
        seconds = time.perf_counter() - start
        tokens = sum(len(r.token_ids) for r in results)
        check.batch = {
            "kv_device": batch.arena.buffers[0].device_name().lower(), "slots": rows,
            "requests": len(jobs), "tokens_per_second": round(tokens / seconds, 2),
            "ragged_calls": batch.ragged_calls, "draft_ragged_calls": batch.draft_ragged_calls,
            "batched_call_ms": {n: round(t * 1e3, 3) for n, t in batch.time_batch_calls().items()},
            "ragged_call_ms": {n: round(t * 1e3, 3) for n, t in batch.ragged_costs.table().items()},
            "mismatches": [],
        }
        for (prompt, drafter), result in zip(jobs, results):
            mismatch = first_mismatch(engine, engine.prompt_ids(prompt), targets[prompt], result.token_ids)
            if mismatch is None:
                continue
            tie = near_tie_bound(engine, engine.prompt_ids(prompt) + targets[prompt][:mismatch["position"]])
            check.batch["mismatches"].append({"prompt": prompt[:40], "drafter": drafter, **mismatch,
                                              "near_tie_bound": tie})
            if mismatch["top2_logit_gap"] > tie:
                check.failures.append(f"batched greedy {drafter} differs from target-only on {prompt[:30]!r} at "
                                      f"token {mismatch['position']}, not a near-tie")
        wanted = KV_DEVICE.get(engine.target.device, "")
        if check.batch["kv_device"] != wanted:
            check.failures.append(f"batch engine KV slots are on {check.batch['kv_device']}, not {wanted}")
    finally:
        batch.shutdown()


def _drained(stream):
    """Return a stream's GenerationResult once every piece is read."""
    for _ in stream:
        pass
    return stream.result


def near_tie_bound(engine: Engine, context: list[int]) -> float:
    """Return the top-2 logit gap under which rounding may flip the greedy token after `context`:
    twice the logit bound (each of the two logits may move by it)."""
    row = engine.target.forward(engine.target.new_cache(len(context)), context)[-1]
    return 2 * proofs.logit_bound(row, engine.target.spec.kv_dtype)


def throughput(runs: list[dict]) -> dict[str, float]:
    """Return {"<drafter> K=<k>": mean decode tokens/s over the runs of that configuration}."""
    groups: dict[str, list[float]] = {}
    for run in runs:
        groups.setdefault(f"{run['drafter']} K={run['num_draft_tokens']}", []).append(run["decode_tokens_per_second"])
    return {name: round(sum(values) / len(values), 2) for name, values in groups.items()}


def _run(engine: Engine, prompt: str, max_new_tokens: int, drafter: str,
         k: int | str | None) -> tuple[list[int], dict]:
    """Return the greedy output's token ids and a record of the run."""
    result = engine.generate(prompt, GenerationConfig(max_new_tokens=max_new_tokens, drafter=drafter,
                                                      num_draft_tokens=k))
    stats = result.stats
    return result.token_ids, {
        "prompt": prompt[:40],
        "drafter": drafter,
        "num_draft_tokens": str(k) if k else "0",
        "decode_tokens_per_second": round(stats.decode_tokens_per_second, 2),
        "tokens_per_target_call": round(stats.tokens_per_target_call, 3),
        "alpha": round(stats.alpha, 3),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the checks on each artifact, print the JSON report; return 0 if all passed, else 1."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifacts", nargs="+", type=Path, help="artifact folders to check")
    parser.add_argument("--provider", default="cuda", choices=["cuda", "cpu", "auto"],
                        help="provider to check (default: cuda)")
    parser.add_argument("--reference", default=None, choices=["cpu"],
                        help="also decode on this provider and report where greedy output first differs")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens per generation (default: 32)")
    parser.add_argument("--output", type=Path, default=None, help="also write the JSON report here")
    args = parser.parse_args(argv)

    report = {
        "onnxruntime": ort.__version__,
        "available_providers": ort.get_available_providers(),
        "checks": [],
    }
    failed = False
    for artifact in args.artifacts:
        try:
            check = check_artifact(artifact, args.provider, args.max_new_tokens, args.reference)
        except Exception as err:  # noqa: BLE001 - one broken artifact must not hide the others' results
            check = ArtifactCheck(str(artifact), args.provider, failures=[f"{type(err).__name__}: {err}"])
        failed = failed or bool(check.failures)
        report["checks"].append(asdict(check))
    report["passed"] = not failed
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        args.output.write_text(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
