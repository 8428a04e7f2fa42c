"""`specdec distill ART`: tap the target's features, make data, train the head, write it into the artifact.

Nothing in the artifact changes until the very end: new files get new names (the tapped
target graph, an `eagle-<hash>/` folder), and the rewritten specdec.json replaces the old
one in one rename, the commit point. Files no manifest names any more are removed after.
Work that --resume picks up (the data, the last checkpoint) lives beside the artifact in
`.<name>.distill/`.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import itertools
import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np

from specdec.models.errors import ExportError, SpecdecError
from specdec.models.manifest import (MANIFEST_FILENAME, MANIFEST_VERSION, FeatureDraftSpec, GraphSpec, Manifest,
                                     RuntimeDefaults, load_manifest, sha256_of_file)
from specdec.exporter.distill.hidden_tap import HIDDEN_OUTPUT, add_hidden_output, compare_hidden
from specdec.exporter.distill.prompts import (HELDOUT_TOPICS, bench_prompts, heldout_prompts, keep_user_turns,
                                              training_prompts)
from specdec.runtime.theory import best_draft_length

Progress = Callable[[str], None]
MIN_EXPECTED_SPEEDUP = 1.05  # a head must be expected to beat target-only by this much to become the default drafter
HIDDEN_ATOL = {"fp32": 1e-3, "fp16": 5e-2}  # max |hidden difference| ONNX vs PyTorch (quantized graphs: recorded only)


@dataclass
class DistillConfig:
    """What `specdec distill` was asked to do; the CLI maps its flags here."""

    artifact: Path
    minutes: float = 60.0  # the whole run's budget: data, training, export
    seed: int = 0
    resume: bool = False  # keep the data and checkpoint of the last run and train on
    prompts: int | None = None  # training prompts to answer; None: as many as the data share of the budget allows
    steps: int | None = None  # training steps in all; None: as many as the budget allows
    data_share: float = 0.45  # of the budget spent making data (the target answering prompts)
    sampled_share: float = 0.5  # of the answers sampled at temperature 0.7 rather than greedy
    self_written_share: float = 0.5  # of the training prompts written by the target itself (the rest: templates)
    heldout: int = 16  # held-out prompts (topics no training prompt has), answered greedily
    max_new_tokens: int = 192  # per answer
    generate_batch: int = 128  # bigger batches decode more tokens per second (docs/DISTILL.md)
    generate_dtype: str = "auto"  # the answers' decoder: auto (bf16 where native), bfloat16, float32
    subset_size: int = 8192  # FR-Spec: ids the head can propose
    # Target decoder layers whose normed inputs the head reads beside the last feature (EAGLE-3); () : none.
    feature_layers: tuple[int, ...] = ()
    head_weights: str = "int8"  # the exported head's MatMul weights: int8 (MatMulNBits) or fp32
    device: str = "auto"  # auto: CUDA when PyTorch sees one, else the CPU
    threads: int | None = None  # PyTorch and onnxruntime threads (None: all cores)
    eval_prompts: int = 4  # held-out prompts decoded with the runtime at the end (acceptance per position)
    eval_tokens: int = 96  # tokens per such prompt
    settings: dict = field(default_factory=dict)  # TrainSettings overrides


def work_dir(artifact: Path) -> Path:
    """Return the folder beside the artifact that keeps data and checkpoints for --resume."""
    return artifact.resolve().parent / f".{artifact.name}.distill"


def _device(requested: str) -> str:
    import torch

    if requested == "cuda" and not torch.cuda.is_available():
        raise ExportError("--device cuda was given but PyTorch sees no CUDA GPU; use --device cpu")
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def check_config(config: DistillConfig) -> Manifest:
    """Return the artifact's manifest; raise ExportError for a run that cannot work, before any slow step."""
    if not config.minutes > 0:
        raise ExportError(f"--minutes must be > 0, got {config.minutes}")
    if config.steps is not None and config.steps < 1:
        raise ExportError(f"--steps must be >= 1, got {config.steps}")
    if config.prompts is not None and config.prompts < 1:
        raise ExportError(f"--prompts must be >= 1, got {config.prompts}")
    if config.subset_size < 2:
        raise ExportError(f"--vocab-subset must be >= 2, got {config.subset_size}")
    manifest = load_manifest(config.artifact)
    bad = [layer for layer in config.feature_layers if not 0 <= layer < manifest.target.num_layers]
    if bad or len(set(config.feature_layers)) != len(config.feature_layers):
        raise ExportError(f"--feature-layers must name distinct layers 0..{manifest.target.num_layers - 1} of the "
                          f"target, got {','.join(map(str, config.feature_layers))}")
    if config.resume and not (work_dir(config.artifact) / "data.json").is_file():
        raise ExportError(f"nothing to resume: {work_dir(config.artifact)} holds no data (run without --resume)")
    if manifest.target.weights_dtype not in ("fp32", "fp16", "int8", "int4"):
        raise ExportError(f"unsupported target weights {manifest.target.weights_dtype}")
    return manifest


def tapped_graph_name(graph_file: str, layers: tuple[int, ...]) -> str:
    """Return the file name of the tapped copy of `graph_file`: model.hidden.onnx, model.hidden-2-15.onnx, ..."""
    source = Path(graph_file)
    stem = source.name.split(".hidden")[0].removesuffix(".onnx")
    return str(source.with_name(stem + ".hidden" + "".join(f"-{layer}" for layer in layers) + ".onnx"))


def _tap_target(artifact: Path, manifest: Manifest, model, tokenizer, layers: tuple[int, ...],
                progress: Progress) -> tuple[GraphSpec, dict]:
    """Return the target spec with a hidden-state output (a new graph file) and its validation against PyTorch.

    The output holds the LM head's input, then the normed inputs of `layers`; a graph already
    tapped for the same layers is kept, one tapped for others is tapped again into a new file,
    and the LM head reads from a row-start input (add_head_row_start).
    """
    import torch

    from specdec.exporter.distill.data import chat_ids, target_features
    from specdec.runtime.session import ModelSession

    spec = manifest.target
    # Kept where its LM head can skip rows too (a graph tapped before v9 is tapped again for that), and its
    # ragged-rows graph is tapped as well (before, the batch engine could not run a head).
    if spec.hidden_name and tuple(spec.hidden_layers) == tuple(layers) and (spec.head_row_start_name or spec.greedy_head) \
            and (not spec.ragged_file or _has_output(artifact / spec.ragged_file, HIDDEN_OUTPUT)):
        return spec, manifest.validation.get("target_hidden", {})
    source = Path(spec.graph_file)
    tapped = tapped_graph_name(spec.graph_file, layers)
    what = "the LM head's input" + (f" and the normed inputs of layers {', '.join(map(str, layers))}" if layers else "")
    progress(f"target: adding the hidden-state output ({what}) as {tapped}")
    _, row_start = add_hidden_output(artifact / source, artifact / tapped, spec.logits_name, layers)
    renamed = {spec.graph_file: str(tapped)}
    if spec.ragged_file:  # the batch engine's graph: the head reads every row's features from it
        renamed[spec.ragged_file] = tapped_graph_name(spec.ragged_file, layers)
        progress(f"target: adding the same output to the ragged-rows graph as {renamed[spec.ragged_file]}")
        add_hidden_output(artifact / spec.ragged_file, artifact / renamed[spec.ragged_file], spec.logits_name, layers)
    files = [renamed.get(f, f) for f in spec.files]
    sha = {renamed.get(k, k): (sha256_of_file(artifact / renamed[k]) if k in renamed else v)
           for k, v in spec.sha256.items()}
    spec = replace(spec, files=files, sha256=sha, hidden_name=HIDDEN_OUTPUT, hidden_layers=list(layers),
                   head_row_start_name=row_start or spec.head_row_start_name,
                   ragged_file=renamed.get(spec.ragged_file, spec.ragged_file))
    session = ModelSession(artifact, spec, "cpu")
    worst = 0.0
    for prompt in ("The capital of France is", "Write a haiku about autumn leaves."):
        ids = chat_ids(tokenizer, prompt)
        _, onnx_hidden = session.forward(session.new_cache(len(ids)), ids, hidden=True)
        with torch.no_grad():
            last, lower = target_features(model, torch.tensor([ids]), layers=layers)
            reference = (last if lower is None else torch.cat([last, lower], dim=-1))[0].float().numpy()
        worst = max(worst, compare_hidden(onnx_hidden, reference))
    atol = HIDDEN_ATOL.get(spec.weights_dtype)
    report = {"max_hidden_diff": worst, "atol": atol, "passed": atol is None or worst <= atol}
    progress(f"target: hidden state vs PyTorch max |diff| {worst:.2e}" + (f" (atol {atol:g})" if atol else ""))
    if atol is not None and worst > atol:
        for tapped_file in renamed.values():
            (artifact / tapped_file).unlink(missing_ok=True)
        raise ExportError(f"the tapped hidden state differs from PyTorch's by {worst:.3g} > {atol:g}: "
                          "the tap is not the LM head's input")
    if spec.ragged_file and session.device == "cpu":
        from specdec.exporter.validate import ragged_rows_difference

        prompts = [chat_ids(tokenizer, p) for p in ("The capital of France is", "Write a haiku about autumn.")]
        report["ragged_rows_max_diff"] = ragged_rows_difference(session, prompts, hidden=True)
        progress(f"target: ragged-rows graph's logits and hidden rows vs batch-1 calls max |diff| "
                 f"{report['ragged_rows_max_diff']:.2e}")
        if report["ragged_rows_max_diff"] != 0.0:
            for tapped_file in renamed.values():
                (artifact / tapped_file).unlink(missing_ok=True)
            raise ExportError("the tapped ragged-rows graph does not score rows as batch-1 calls do "
                              f"(max |diff| {report['ragged_rows_max_diff']:.3g})")
    return spec, report


def _has_output(graph: Path, name: str) -> bool:
    """Return whether the ONNX graph at `graph` has an output called `name` (its weights not read)."""
    import onnx

    return any(o.name == name for o in onnx.load(str(graph), load_external_data=False).graph.output)


def _takes_turn(index: int, share: float) -> bool:
    """Return whether turn `index` of an alternation goes to the side that gets `share` of the turns (evenly spread)."""
    if share <= 0 or share >= 1:
        return share >= 1
    return (index * share) % 1.0 >= 1.0 - share - 1e-9


def _feature_reader(config: DistillConfig, model):
    """Return the copy of the target that decodes training answers and reads their features (generator_dtype)."""
    import copy

    from specdec.exporter.distill.data import generator_dtype, use_grouped_attention

    reader = copy.deepcopy(model).to(generator_dtype(config.generate_dtype, str(next(model.parameters()).device)))
    use_grouped_attention(reader)
    return reader


def _make_data(config: DistillConfig, manifest: Manifest, model, tokenizer, deadline: float, work: Path,
               progress: Progress) -> dict:
    """Answer prompts with the target and read its features over them; write train/heldout .npz; return sizes.

    Training prompts come in chunks of `generate_batch`: templated ones, and (a
    `self_written_share` of the chunks) user turns the target wrote itself, filtered by
    keep_user_turns against the bench's prompts and the held-out topics, templates filling
    what the filter dropped.

    Training answers are decoded by a copy of the target in `generator_dtype` (bf16 where the
    hardware has it; its feature error is far below the +-0.1 training noise), which keeps the
    features its own forward passes computed (decode_examples: no teacher-forced pass).
    Held-out features and greedy choices, which acceptance is judged on, are read by the fp32
    target in a teacher-forced pass.
    """
    from specdec.exporter.distill.data import (decode_examples, features_of, generate_answers, save_examples,
                                               write_user_turns)

    eos = list(manifest.tokenizer.eos_token_ids)
    started = time.monotonic()
    generator = _feature_reader(config, model)
    dtype = next(generator.parameters()).dtype
    progress(f"data: answers decoded in {str(dtype).removeprefix('torch.')}, batches of {config.generate_batch}; "
             "held-out features read by the fp32 target")
    templated = iter(training_prompts(100_000, config.seed))
    avoid, seen = bench_prompts(), set()
    examples = []
    batch = config.generate_batch
    chunk_index = tokens = written = kept = 0
    seconds = {"generate": 0.0, "features": 0.0}  # features: the held-out set's teacher-forced pass
    heldout = generate_answers(generator, tokenizer, heldout_prompts(config.heldout, config.seed), eos,
                               config.max_new_tokens, 0.0, config.generate_batch, config.seed)
    layers = tuple(config.feature_layers)
    middle = time.monotonic()
    held = features_of(model, heldout, sampled=False, layers=layers)
    seconds["features"] += time.monotonic() - middle
    last_chunk = 0.0
    while config.prompts is None or len(examples) < config.prompts:
        # Stop before a batch that would end past the deadline (the last one's time predicts it).
        if config.prompts is None and examples and time.monotonic() + last_chunk > deadline:
            break
        chunk_started = time.monotonic()
        size = batch if config.prompts is None else min(batch, config.prompts - len(examples))
        sampled = _takes_turn(chunk_index, config.sampled_share)
        prompts = []
        if _takes_turn(chunk_index // 2, config.self_written_share):  # pairs of chunks: greedy and sampled answers
            turns = write_user_turns(generator, tokenizer, size, eos, config.seed + 7919 * (chunk_index + 1))
            prompts = keep_user_turns(turns, avoid, HELDOUT_TOPICS, seen)
            written, kept = written + len(turns), kept + len(prompts)
        prompts += list(itertools.islice(templated, size - len(prompts)))  # templates fill what was dropped
        if not prompts:
            break
        new = decode_examples(generator, tokenizer, prompts, eos, config.max_new_tokens, 0.7 if sampled else 0.0,
                              config.seed + batch * chunk_index, layers)
        chunk_index += 1
        examples += new
        last_chunk = time.monotonic() - chunk_started
        seconds["generate"] += last_chunk
        tokens += sum(len(e.ids) - e.answer_start for e in new)
        rate = tokens / max(time.monotonic() - started, 1e-9)
        progress(f"data: {len(examples)} answers ({kept} to prompts the target wrote), {tokens} answer tokens "
                 f"({rate:.0f} tok/s, features included)")
    del generator
    if not examples:
        raise ExportError("no training data was made within the data share of the budget (the held-out answers "
                          "took it): give more --minutes, or --prompts N")
    save_examples(work / "train.npz", examples)
    save_examples(work / "heldout.npz", held)
    data_seconds = time.monotonic() - started
    meta = {**_data_record(examples, held, kept, written),
            "generate_dtype": str(dtype).removeprefix("torch."), "train_features_dtype": str(dtype).removeprefix("torch."),
            "generate_batch": batch, "feature_layers": list(layers),
            "generate_seconds": round(seconds["generate"], 1), "features_seconds": round(seconds["features"], 1),
            "data_seconds": round(data_seconds, 1),
            "answer_tokens_per_second": round(tokens / max(data_seconds, 1e-9), 1)}
    (work / "data.json").write_text(json.dumps(meta, indent=2))
    return meta


def _data_record(examples: list, held: list, kept: int, written: int) -> dict:
    """Return the data record's counts: training prompts and answers (greedy, sampled), the prompts the target
    wrote (`kept` of `written` turns), answer tokens and positions, held-out prompts and answer tokens."""
    return {"prompts": len(examples), "greedy_answers": sum(not e.sampled for e in examples),
            "sampled_answers": sum(e.sampled for e in examples),
            "self_written_prompts": kept, "self_written_turns_drafted": written,
            "answer_tokens": int(sum(len(e.ids) - e.answer_start for e in examples)),
            "positions": int(sum(len(e.ids) for e in examples)),
            "heldout_prompts": len(held), "heldout_answer_tokens": int(sum(len(e.ids) - e.answer_start for e in held))}


def _refeature(config: DistillConfig, model, work: Path, meta: dict, progress: Progress) -> dict:
    """Read the target's features of config.feature_layers over the conversations already in `work`.

    One teacher-forced pass (no decoding: minutes where the data took most of the budget),
    by the same readers as _make_data; rewrites train/heldout .npz, drops the checkpoint (the
    head's input changed) and returns the updated data record.
    """
    from specdec.exporter.distill.data import features_of, load_examples, save_examples

    layers = tuple(config.feature_layers)
    progress(f"resume: reading the features of layers {list(layers) or 'none'} beside the last over the same "
             f"{meta['prompts']} conversations (the data held {meta.get('feature_layers') or 'none'})")
    started = time.monotonic()
    readers = {"train.npz": _feature_reader(config, model), "heldout.npz": model}
    for name, reader in readers.items():
        old = load_examples(work / name)
        conversations = [(e.ids[: e.answer_start].tolist(), e.ids[e.answer_start:].tolist()) for e in old]
        new = features_of(reader, conversations, sampled=False, layers=layers)
        save_examples(work / name, [replace(n, sampled=o.sampled) for n, o in zip(new, old)])
    (work / "checkpoint.pt").unlink(missing_ok=True)
    meta = {**meta, "feature_layers": list(layers), "refeature_seconds": round(time.monotonic() - started, 1)}
    (work / "data.json").write_text(json.dumps(meta, indent=2))
    return meta


def run_distill(config: DistillConfig, progress: Progress = print) -> Manifest:
    """Train a draft head for the artifact's target and write it into the artifact; return the new manifest.

    Raises ExportError (or another SpecdecError) on bad input; the artifact is unchanged unless
    the run completes.
    """
    import torch

    from specdec.exporter.distill.data import load_examples
    from specdec.exporter.distill.train import TrainSettings, TrainState, heldout_acceptance, resolved_settings, train_head
    from specdec.exporter.sources import load_source

    manifest = check_config(config)
    start = time.monotonic()
    deadline = start + config.minutes * 60
    artifact = Path(config.artifact)
    device = _device(config.device)
    if config.threads:
        torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    work = work_dir(artifact)
    if not config.resume:
        shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="specdec-distill-") as scratch:
        progress(f"target: loading {manifest.target.source} into PyTorch")
        loaded = load_source(manifest.target.source, Path(scratch) / "target", False, manifest.target.revision)
        model, tokenizer = loaded.model.to(device).eval(), loaded.tokenizer
        target_spec, hidden_report = _tap_target(artifact, manifest, model.cpu(), tokenizer,
                                                 tuple(config.feature_layers), progress)
        model.to(device)
        meta = _training_data(config, manifest, model, tokenizer, work, start, progress)
        examples, heldout = load_examples(work / "train.npz"), load_examples(work / "heldout.npz")
        # A run stopped after its data was made resumes with that data and no checkpoint.
        saved = work / "checkpoint.pt"
        checkpoint = torch.load(saved, weights_only=False) if config.resume and saved.is_file() else None
        head, subset, draft_config = _new_head(config, manifest, model, examples, checkpoint, device)
        del model
        settings = resolved_settings(TrainSettings(**config.settings), device)
        state, optimizer_state = TrainState(), None
        if checkpoint:
            head.load_state_dict(checkpoint["head"])
            state = TrainState(**checkpoint["state"])
            optimizer_state = checkpoint["optimizer"]
        untrained = heldout_acceptance(head, heldout, device) if not checkpoint else checkpoint["untrained"]
        fit_sample = examples[:: max(1, len(examples) // 32)]  # how well it fits its own data, beside held-out
        untrained_fit = heldout_acceptance(head, fit_sample, device) if not checkpoint else checkpoint.get("untrained_fit", {})
        progress(f"train: held-out greedy agreement before training {untrained['first']:.3f} "
                 f"(subset {len(subset)} ids covers {untrained['subset_coverage']:.1%} of the target's choices)")
        reserve = 0.08 * config.minutes * 60 + 20  # export and the runtime check at the end
        state, optimizer_state = train_head(head, examples, heldout, settings, state, config.seed,
                                            None if config.steps else deadline - reserve, config.steps,
                                            optimizer_state, _training_report(progress))
        final = heldout_acceptance(head, heldout, device)
        fit = heldout_acceptance(head, fit_sample, device)
        state.curve.append({"step": state.step, "train_minutes": round(state.seconds / 60, 3),
                            "tokens": state.tokens_seen, **{k: round(v, 4) if isinstance(v, float) else v for k, v in final.items()}})
        progress(f"train: done, {state.step} steps; held-out acceptance first {final['first']:.3f}, "
                 f"second {final['second']:.3f} (untrained {untrained['first']:.3f})")
        torch.save({"head": head.state_dict(), "optimizer": optimizer_state, "state": asdict(state),
                    "subset": subset, "untrained": untrained, "untrained_fit": untrained_fit}, work / "checkpoint.pt")
        training = {
            "seed": config.seed, "steps": state.step, "planned_steps": state.planned_steps,
            "plan_history": state.plan_history,
            "train_minutes": round(state.seconds / 60, 2),
            "wall_minutes": round((time.monotonic() - start) / 60, 2), "device": device,
            "data": meta, "settings": asdict(settings), "draft_config": draft_config.as_dict(),
            "heldout_acceptance": final, "untrained_heldout_acceptance": untrained, "curve": state.curve,
            "train_fit": fit, "untrained_train_fit": untrained_fit,
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "reproduce": _reproduce_command(config, meta["prompts"], state.step, settings.compute_dtype),
        }
        return _write_head(artifact, manifest, target_spec, hidden_report, head.cpu(), subset, training, config,
                           progress)


def _training_data(config: DistillConfig, manifest: Manifest, model, tokenizer, work: Path, start: float,
                   progress: Progress) -> dict:
    """Return the data record of the run's training data in `work`: the last run's with --resume (its features
    read again where --feature-layers changed), else made now within the data share of the budget."""
    if not config.resume:
        return _make_data(config, manifest, model, tokenizer, start + config.data_share * config.minutes * 60,
                          work, progress)
    meta = json.loads((work / "data.json").read_text())
    progress(f"resume: {meta['prompts']} conversations from {work}")
    if tuple(meta.get("feature_layers", ())) != tuple(config.feature_layers):
        meta = _refeature(config, model, work, meta, progress)
    return meta


def _new_head(config: DistillConfig, manifest: Manifest, model, examples: list, checkpoint: dict | None,
              device: str):
    """Return (a draft head initialised from the target `model`, on `device`, its vocabulary subset, its
    DraftConfig); the subset is the checkpoint's when resuming, else the examples' most frequent ids."""
    import torch

    from specdec.exporter.distill.data import frequent_tokens
    from specdec.exporter.distill.draft_model import DraftHead, draft_config_for

    vocab = min(manifest.tokenizer.vocab_size, manifest.target.vocab_size)
    if checkpoint:
        subset = checkpoint["subset"]
    else:
        subset = frequent_tokens(examples, config.subset_size, vocab, manifest.tokenizer.eos_token_ids)
    draft_config = draft_config_for(model.config, len(subset), vocab, tuple(config.feature_layers))
    head = DraftHead(draft_config, torch.from_numpy(subset))
    head.init_from_target(model.cpu())
    head.to(device)
    return head, subset, draft_config


def _training_report(progress: Progress) -> Callable:
    """Return train_head's report callback: one progress line per held-out evaluation."""
    def report(state, row):
        if row:
            progress(f"train: step {state.step}, {state.tokens_seen} pair-tokens, {state.seconds / 60:.1f} min; "
                     f"held-out acceptance first {row['first']:.3f} second {row['second']:.3f} (loss {row['loss']})")

    return report


def _reproduce_command(config: DistillConfig, prompts: int, steps: int, compute_dtype: str) -> str:
    """Return the `specdec distill` command line that repeats this run's data and training."""
    return (f"specdec distill ART --seed {config.seed} --prompts {prompts} --steps {steps}"
            f" --generate-batch {config.generate_batch} --train-dtype {compute_dtype}"
            + (f" --feature-layers {','.join(map(str, config.feature_layers))}"
               if config.feature_layers else "")
            + (f" --self-written-share {config.self_written_share:g}"
               if config.self_written_share != DistillConfig.self_written_share else ""))


def _write_head(artifact: Path, manifest: Manifest, target_spec: GraphSpec, hidden_report: dict, head,
                subset: np.ndarray, training: dict, config: DistillConfig, progress: Progress) -> Manifest:
    from specdec.exporter.distill.draft_model import export_draft_onnx
    from specdec.exporter.distill.ragged_head import RAGGED_HEAD_FILE, export_ragged_head
    from specdec.exporter.quantize import DRAFT_ACCURACY_LEVEL, quantize_graph

    staging = Path(tempfile.mkdtemp(prefix=".eagle-", dir=artifact))
    rows = target_spec.ragged_rows if target_spec.ragged_file else 0
    try:
        export_draft_onnx(head, staging / "draft.onnx")
        if rows:
            export_ragged_head(head, staging / RAGGED_HEAD_FILE, rows)
        # A head call reads its weights from memory after every target call has flushed the caches:
        # int8 reads a third as many bytes (docs/DISTILL.md). Its q is whatever it outputs, so exactness holds.
        if config.head_weights == "int8":
            quantized = quantize_graph(staging / "draft.onnx", "int8", DRAFT_ACCURACY_LEVEL)
            if rows:
                quantize_graph(staging / RAGGED_HEAD_FILE, "int8", DRAFT_ACCURACY_LEVEL)
            training = {**training, "head_weights": {k: v for k, v in quantized.items() if not k.startswith("sha256")}}
        else:
            training = {**training, "head_weights": {"weights": "fp32"}}
        if rows:
            rows = _checked_ragged_head(staging, rows, head, progress)
        np.save(staging / "subset.npy", subset.astype(np.int64))
        digest = hashlib.sha256((staging / "draft.onnx").read_bytes()).hexdigest()[:12]
        folder = f"eagle-{digest}"
        if (artifact / folder).exists():
            shutil.rmtree(artifact / folder)
        os.replace(staging, artifact / folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    files = [f"{folder}/draft.onnx", f"{folder}/subset.npy"]
    ragged_file = f"{folder}/{RAGGED_HEAD_FILE}" if rows else None
    spec = FeatureDraftSpec(
        kind="eagle", files=files,
        sha256={f: sha256_of_file(artifact / f) for f in files + ([ragged_file] if ragged_file else [])},
        hidden_size=head.config.hidden_size, num_kv_heads=head.config.num_kv_heads, head_dim=head.config.head_dim,
        vocab_subset=len(subset), target_graph_sha256=target_spec.sha256[target_spec.graph_file], training=training,
        ragged_file=ragged_file, ragged_rows=rows)
    # Written by this version (a tapped graph may have inputs an older runtime would not bind).
    updated = replace(manifest, version=MANIFEST_VERSION, target=target_spec, feature_draft=spec,
                      validation={**manifest.validation, "target_hidden": hidden_report})
    try:
        runtime = runtime_acceptance(artifact, updated, config, progress)
    except BaseException:
        shutil.rmtree(artifact / folder, ignore_errors=True)
        raise
    spec = replace(spec, training={**training, "runtime_heldout": runtime})
    # The head becomes the default drafter only where it is expected to pay; else `auto` keeps its old choice.
    pays = runtime.get("expected_speedup", 0.0) > MIN_EXPECTED_SPEEDUP
    # ... at the K the check found best: the exporter's default K (4) runs a weak head past its break-even.
    defaults = (replace(manifest.runtime_defaults, drafter="eagle", num_draft_tokens=runtime["best_k"]) if pays
                else manifest.runtime_defaults)
    updated = replace(updated, feature_draft=spec, runtime_defaults=defaults)
    temporary = artifact / (MANIFEST_FILENAME + ".tmp")
    temporary.write_text(json.dumps(updated.to_dict(), indent=2) + "\n", encoding="utf-8")
    os.replace(temporary, artifact / MANIFEST_FILENAME)  # the commit point
    _remove_unlisted(artifact, manifest, updated)
    progress(f"wrote the draft head into {artifact} ({folder}); default drafter: {updated.runtime_defaults.drafter or 'auto'}"
             + ("" if pays else f" (the head's expected speedup {runtime.get('expected_speedup', 0.0):.2f}x does not pay; "
                                "use it with --drafter eagle)"))
    return updated


def _checked_ragged_head(staging: Path, rows: int, head, progress: Progress) -> int:
    """Return `rows` where the staged ragged head's rows equal batch-1 calls of the staged head to the bit (at 1
    and 2 threads), else delete it and return 0: its requests then draft one call each, as before."""
    from specdec.exporter.distill.ragged_head import RAGGED_HEAD_FILE, ragged_head_difference

    difference = max(ragged_head_difference(staging / "draft.onnx", staging / RAGGED_HEAD_FILE, rows,
                                            head.feature_width, head.config.vocab_size, threads=threads)
                     for threads in (1, 2))
    if difference == 0.0:
        progress(f"draft head: ragged-rows graph of {rows} rows, every row equal to its batch-1 call")
        return rows
    progress(f"draft head: the ragged-rows graph's rows differ from batch-1 calls (max |diff| {difference:.3g}); "
             "left out: under load each request's head calls run alone")
    (staging / RAGGED_HEAD_FILE).unlink()
    return 0


def _remove_unlisted(artifact: Path, old: Manifest, new: Manifest) -> None:
    """Delete files the old manifest listed (and earlier eagle folders) that the new one does not."""
    listed = ({f for g in new.graphs() for f in g.files} | {g.ragged_file for g in new.graphs() if g.ragged_file}
              | set(new.feature_draft.files if new.feature_draft else []))
    for graph in old.graphs():
        for rel in graph.files[:1] + ([graph.ragged_file] if graph.ragged_file else []):
            if rel not in listed:
                (artifact / rel).unlink(missing_ok=True)
    keep = {Path(f).parts[0] for f in listed}
    for folder in artifact.glob("eagle-*"):
        if folder.name not in keep:
            shutil.rmtree(folder, ignore_errors=True)


def runtime_acceptance(artifact: Path, manifest: Manifest, config: DistillConfig, progress: Progress) -> dict:
    """Return acceptance measured with the runtime (greedy, K = 4) on held-out prompts: overall and per draft
    position, c, and the K Theorem 3.8 expects to pay best under this machine's measured target call costs."""
    from specdec.runtime.calibration import calibrate
    from specdec.runtime.call_costs import TargetCallCosts
    from specdec.runtime.engine import Engine, GenerationConfig

    engine = Engine(artifact, manifest, "cpu", config.threads)
    prompts = heldout_prompts(config.eval_prompts, config.seed + 7)
    if not prompts:
        return {}
    reached = np.zeros(4, np.int64)
    accepted = np.zeros(4, np.int64)
    drafted = kept = tests = draft_calls = iterations = 0
    draft_seconds = target_seconds = 0.0
    for prompt in prompts:
        def count(iteration):
            nonlocal drafted, kept, tests
            if iteration.drafted:
                drafted += len(iteration.drafted)
                kept += iteration.num_accepted
                tests += iteration.acceptance_tests
                tried = min(len(iteration.drafted), iteration.num_accepted + 1)
                reached[:tried] += 1
                accepted[:iteration.num_accepted] += 1
        stats = engine.generate(prompt, GenerationConfig(max_new_tokens=config.eval_tokens, num_draft_tokens=4,
                                                         drafter="eagle", chat=True), on_iteration=count).stats
        draft_calls, iterations = draft_calls + stats.draft_calls, iterations + stats.iterations
        draft_seconds, target_seconds = draft_seconds + stats.draft_seconds, target_seconds + stats.target_seconds
    per_position = [round(float(a) / int(r), 4) if r else None for a, r in zip(accepted, reached)]
    # Theorem 3.8's alpha: accepted drafts over acceptance tests (drafts after a rejection were never tested).
    alpha = kept / max(tests, 1)
    costs = TargetCallCosts(prior=calibrate(engine.target, engine.prompt_ids(prompts[0], chat=True), 17,
                                            config.threads).call_costs).table(17)
    one_token = target_seconds / iterations / costs[5] if iterations else 0.0  # the checks' calls verify 5 tokens
    cost = (draft_seconds / draft_calls) / one_token if draft_calls and one_token else 1.0
    best_k, speedup = best_draft_length(min(alpha, 0.999), cost, 16, call_cost=costs.__getitem__)
    result = {"prompts": len(prompts), "num_draft_tokens": 4, "alpha": round(alpha, 4),
              "drafts_accepted_share": round(kept / max(drafted, 1), 4), "per_position": per_position,
              "cost_ratio": round(cost, 4), "target_call_costs": [round(c, 3) for c in costs[1:6]],
              "best_k": best_k, "expected_speedup": round(speedup, 4)}
    progress(f"runtime check (held-out, greedy, K=4): {kept}/{drafted} drafts accepted, per position {per_position}; "
             f"alpha {alpha:.3f}, c {cost:.3f}: best K {best_k}, expected {speedup:.2f}x")
    return result
