"""`specdec export`: load, export, check tokenizers, validate, write the artifact atomically."""

from __future__ import annotations

import datetime as _dt
import shutil
import sys
import tempfile
from dataclasses import dataclass, field, replace
from importlib import metadata
from pathlib import Path
from typing import Callable

import onnx

from specdec.models.errors import ExportError
from specdec.models.manifest import (
    FLOAT_DTYPES,
    TRACE_DEVICES,
    GraphSpec,
    Manifest,
    Provenance,
    RuntimeDefaults,
    TokenizerSpec,
    sha256_of_file,
    write_manifest,
)
from specdec.exporter.onnx_export import (GraphLayout, export_onnx, external_data_files, read_layout,
                                         reread_kv_dtype_and_files)
from specdec.exporter.kv_slice import write_kv_slice_graph
from specdec.exporter.logits_rows import LOGITS_ROWS_NAME
from specdec.exporter.half_precision import convert_graph_to_fp16
from specdec.exporter.optimize import optimize_graph
from specdec.exporter.shared_kv import SEQLENS_NAME, TOTAL_LENGTH_NAME
from specdec.exporter.sources import LoadedSource, load_source
from specdec.exporter.staging import check_output_path, staged_folder
from specdec.exporter.tokenizer_check import check_tokenizers_compatible
from specdec.exporter.quantize import DRAFT_ACCURACY_LEVEL, WEIGHT_CHOICES, quantize_graph, target_precision
from specdec.exporter.validate import (DEFAULT_ATOL, MIN_GREEDY_AGREEMENT, VALIDATION_PROMPTS, greedy_head_check,
                                      ragged_rows_difference, step_call_difference, validate_graph)
from specdec.exporter.agreement import AGREEMENT_FLOOR, float_answers, teacher_forced_agreement
from specdec.exporter.attention_rows import ATTENTION_PAD_ROWS, pad_attention_file
from specdec.exporter.greedy_head import FOLDER as GREEDY_HEAD_FOLDER, write_greedy_head
from specdec.exporter.long_call_attention import LONG_CALL_NAME, add_long_call_attention_file
from specdec.exporter.ragged_rows import ROW_TOKENS_NAME, write_ragged_graph
from specdec.runtime.session import ModelSession

QUANTIZED_DRAFTS = ("int8", "int4")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


@dataclass
class ExportConfig:
    """What `specdec export` was asked to do."""

    target: str  # hub id, local folder, or .gguf file
    draft: str | None  # same kinds, or None for a target-only artifact
    output: Path
    # float dtype of the exported graphs: fp32 | fp16 (on the CPU: exported in fp32, then converted)
    dtype: str = "fp32"
    weights: str | None = None  # None: as dtype; int8 | int4: quantize the MatMul weights after export
    device: str = "cpu"  # where optimum traces the model: cpu | cuda
    opset: int | None = None  # None: optimum's default for the architecture
    trust_remote_code: bool = False
    force: bool = False  # replace an existing output folder
    atol: float | None = None  # max logit difference in validation; None: per-weights default
    min_agreement: float | None = None  # greedy agreement validation needs; None: per-weights default
    optimize: bool = True  # run the optimization stage (onnxruntime fusions) where the family has one
    shared_kv: bool = True  # in that stage, one preallocated KV buffer per tensor where the family allows it
    # a float target's attention over 2+ query rows, so steps and verify calls score alike to the bit
    # (int4 targets always get it; see specdec/exporter/attention_rows.py)
    exact_steps: bool = False
    # an 8-bit copy of an fp32 target's LM head that greedy calls read instead (specdec/exporter/greedy_head.py)
    greedy_head: bool = False
    # fp32 shared-KV graphs: each attention in an If choosing onnxruntime's causal kernel for long calls
    # (specdec/exporter/long_call_attention.py); off: one kernel, no If for steps to pay
    long_call_attention: bool = True
    # fp32 shared-KV targets: a second graph taking this many sequences of any token counts in one call, so
    # the batch engine verifies several requests' drafts together (specdec/exporter/ragged_rows.py); 0: none
    batch_rows: int = 8
    revision: str | None = None
    command: str | None = None  # the command line, recorded in provenance
    library_versions: dict[str, str] = field(default_factory=dict)


Progress = Callable[[str], None]


def check_config(config: ExportConfig) -> ExportConfig:
    """Return the config with --weights fp32/fp16 folded into dtype; raise ExportError for settings
    that can never work, before any slow step."""
    if config.weights is not None and config.weights not in WEIGHT_CHOICES:
        raise ExportError(f"--weights must be fp32, fp16, int8 or int4, got '{config.weights}'")
    if config.weights in ("fp32", "fp16"):
        if config.dtype != "fp32" and config.dtype != config.weights:
            raise ExportError(f"--weights {config.weights} contradicts --dtype {config.dtype}; give one of them")
        config = replace(config, dtype=config.weights, weights=None)
    if config.weights and config.dtype != "fp32":
        raise ExportError("--weights int8/int4 quantize an fp32 export; drop --dtype fp16")
    if config.greedy_head and (config.weights or config.dtype != "fp32"):
        raise ExportError("--greedy-head is for fp32 targets: drop --weights / --dtype fp16")
    if config.exact_steps and not (config.optimize and config.shared_kv):
        raise ExportError("--exact-steps rewrites the shared KV buffer's attention: "
                          "drop --no-optimize / --no-shared-kv")
    if config.batch_rows < 0 or config.batch_rows == 1:
        raise ExportError(f"--batch-rows must be 0 (none) or at least 2, got {config.batch_rows}")
    if config.draft and config.draft.startswith("quantized:") and \
            config.draft.split(":", 1)[1] not in QUANTIZED_DRAFTS:
        raise ExportError(f"--draft {config.draft}: expected quantized:int8 or quantized:int4")
    if config.dtype not in FLOAT_DTYPES:
        raise ExportError(f"--dtype must be fp32 or fp16, got '{config.dtype}'")
    if config.device not in TRACE_DEVICES:
        raise ExportError(f"--device must be cpu or cuda, got '{config.device}'")
    if config.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ExportError("--device cuda was given but PyTorch sees no CUDA GPU; use --device cpu")
    check_output_path(config.output, config.force)
    return config


def _versions() -> dict[str, str]:
    versions = {"python": sys.version.split()[0]}
    for package in ("specdec", "torch", "transformers", "optimum-onnx", "onnx", "onnxruntime", "tokenizers"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return versions


@dataclass
class _Rewrites:
    """What the stages after the ONNX export left in a role's folder, for its GraphSpec."""

    layout: GraphLayout  # the graph's names, KV dtype and files as they are now
    optimization: dict  # the manifest's record of every stage
    kv_buffer: str  # shared | concat
    inputs: set[str]  # the graph's inputs now (a rewrite may drop or add some)
    pad_rows: int = 0  # attention pad rows (a target's only)
    head_record: dict | None = None  # the 8-bit greedy head's record, paths relative to the artifact
    ragged_file: str | None = None  # the ragged-rows graph, relative to the artifact


def _export_one(role: str, loaded: LoadedSource, staging: Path, config: ExportConfig,
                progress: Progress) -> GraphSpec:
    """Export, rewrite and hash one role's graph under `staging/role`; return its GraphSpec."""
    folder = staging / role
    # optimum traces fp16 only on a GPU; on the CPU the fp32 graph is converted after optimization.
    convert_to_fp16 = config.dtype == "fp16" and config.device == "cpu"
    arch = loaded.architecture
    num_layers = arch.num_layers(loaded.config)
    layout = _exported_layout(role, loaded, folder, config, "fp32" if convert_to_fp16 else config.dtype, progress)
    done = _rewrite_graph(role, loaded, folder, layout, config, convert_to_fp16, progress)
    layout, shared, ragged_file, head_record = done.layout, done.kv_buffer == "shared", done.ragged_file, done.head_record
    kv_heads, head_dim = arch.num_kv_heads(loaded.config), arch.head_dim(loaded.config)
    files = [f"{role}/{name}" for name in layout.files]
    kv_slice_file = None  # a shared buffer rolls back by its length: nothing to crop
    if not shared:
        kv_slice = write_kv_slice_graph(folder / "kv_slice.onnx", 2 * num_layers, kv_heads, head_dim, layout.kv_dtype)
        kv_slice_file = f"{role}/{kv_slice.name}"
    hashed = files + ([kv_slice_file] if kv_slice_file else []) + ([ragged_file] if ragged_file else []) + \
        ([head_record[key] for key in ("weights", "norms")] if head_record else [])
    return GraphSpec(
        role=role,
        files=files,
        sha256={rel: sha256_of_file(staging / rel) for rel in hashed},
        kv_slice_file=kv_slice_file,
        model_type=loaded.config["model_type"],
        family=arch.family,
        num_layers=num_layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        kv_dtype=layout.kv_dtype,
        input_ids_name=layout.input_ids_name,
        attention_mask_name=layout.attention_mask_name if layout.attention_mask_name in done.inputs else None,
        position_ids_name=layout.position_ids_name,
        past_names=layout.past_names,
        present_names=layout.present_names,
        logits_name=layout.logits_name,
        # the pad rows are written one position past the call: they need positions of their own
        max_positions=arch.max_positions(loaded.config) - done.pad_rows,
        vocab_size=int(loaded.config["vocab_size"]),
        weights_dtype=config.weights or config.dtype,
        source=loaded.source,
        revision=loaded.revision,
        optimization=done.optimization,
        kv_buffer=done.kv_buffer,
        seqlens_name=SEQLENS_NAME if shared else None,
        total_length_name=TOTAL_LENGTH_NAME if shared else None,
        logits_rows_name=LOGITS_ROWS_NAME if LOGITS_ROWS_NAME in done.inputs else None,
        attention_pad_rows=done.pad_rows,
        greedy_head=head_record,
        long_call_name=LONG_CALL_NAME if LONG_CALL_NAME in done.inputs else None,
        ragged_file=ragged_file,
        ragged_rows=config.batch_rows if ragged_file else 0,
        row_tokens_name=ROW_TOKENS_NAME if ragged_file else None,
    )


def _exported_layout(role: str, loaded: LoadedSource, folder: Path, config: ExportConfig, dtype: str,
                     progress: Progress) -> GraphLayout:
    """Export the source to ONNX in `dtype`, keep only the graph and its weights in `folder`; return its layout."""
    progress(f"{role}: exporting to ONNX with optimum (text-generation-with-past)")
    from_hub = not Path(loaded.export_path).exists()
    graph_path = export_onnx(loaded.export_path, folder / "onnx", config.opset, config.device, dtype,
                             config.trust_remote_code, revision=loaded.revision if from_hub else None)
    layout = read_layout(graph_path, loaded.architecture.num_layers(loaded.config))
    # Keep only the graph and its weights; optimum also writes configs we do not need.
    for name in layout.files:
        shutil.move(str(graph_path.parent / name), str(folder / name))
    shutil.rmtree(graph_path.parent)
    return layout


def _rewrite_graph(role: str, loaded: LoadedSource, folder: Path, layout: GraphLayout, config: ExportConfig,
                   convert_to_fp16: bool, progress: Progress) -> _Rewrites:
    """Optimize, quantize, pad, wrap and convert the exported graph in `folder` as `config` asks, and add its
    greedy head and ragged-rows graph; return what the stages did."""
    graph = folder / layout.files[0]
    if config.optimize:
        progress(f"{role}: optimizing the graph")
        # Quantization packs its own MatMulNBits; packing the float weights first would leave it nothing to fuse.
        optimization = optimize_graph(graph, loaded.architecture, loaded.config, config.shared_kv,
                                      pack_projections=not config.weights).as_dict()
    else:
        optimization = {"applied": [], "note": "--no-optimize"}
    kv_buffer = optimization.pop("kv_buffer", "concat")
    shared = kv_buffer == "shared"
    # A rewrite may drop inputs (the shared buffer drops the mask): bind only what the graph still has.
    done = _Rewrites(layout, optimization, kv_buffer,
                     {i.name for i in onnx.load(str(graph), load_external_data=False).graph.input})
    pad_attention = config.exact_steps
    if config.weights:
        progress(f"{role}: quantizing MatMul weights to {config.weights}")
        level, needs_pad = target_precision(config.weights, shared)
        pad_attention = pad_attention or needs_pad
        optimization["quantization"] = quantize_graph(graph, config.weights, level)
    if role == "target" and pad_attention:  # a draft's numbers only shape proposals: never padded
        if shared:
            progress(f"{role}: attention over two query rows at least (steps score like verify calls)")
            done.pad_rows = ATTENTION_PAD_ROWS
            optimization["attention_pad"] = {"layers": pad_attention_file(graph), "rows": done.pad_rows}
        else:
            progress(f"{role}: no shared KV buffer (GroupQueryAttention) here: steps keep their own attention path")
    if (shared and config.optimize and config.long_call_attention and config.dtype == "fp32" and not config.weights
            and not pad_attention):
        # float32 attention only (the flash/causal choice is a float32 CPU kernel matter), and not in graphs that
        # promise a token scores alike in calls of any length (the attention pad; int4 at level 4 turns the
        # kernels' last-bit difference into ~0.3 in logits): one kernel there.
        wrapped = add_long_call_attention_file(graph)
        if wrapped:
            progress(f"{role}: a causal attention kernel for long calls (prefills), chosen per call")
            optimization["long_call_attention"] = {"layers": wrapped, "input": LONG_CALL_NAME,
                                                   "sha256_after": sha256_of_file(graph)}
            done.inputs.add(LONG_CALL_NAME)
    if role == "target" and config.greedy_head:
        progress(f"{role}: an 8-bit copy of the LM head for greedy calls")
        done.head_record = write_greedy_head(graph, folder / GREEDY_HEAD_FOLDER, layout.logits_name)
        done.head_record.update({key: f"{role}/{done.head_record[key]}" for key in ("weights", "norms")})
    if convert_to_fp16:
        progress(f"{role}: converting the graph to fp16")
        optimization["half_precision"] = convert_graph_to_fp16(graph)
        done.layout = reread_kv_dtype_and_files(graph, layout)
    # fp32, fp16 (the CUDA provider's) or int4 weights (MatMulNBits' rows are independent of the call's rows,
    # docs/INT4.md; int8's not measured); validated bit-equal to batch-1 calls below
    if config.batch_rows and shared and config.weights in (None, "int4"):
        _add_ragged_graph(role, folder, config.batch_rows, done, progress)
    return done


def _add_ragged_graph(role: str, folder: Path, rows: int, done: _Rewrites, progress: Progress) -> None:
    """Write the ragged-rows graph of `folder`'s graph for `rows` sequences per call and record it in `done`;
    where the graph cannot have one, say so and leave `done` as it is."""
    graph = folder / done.layout.files[0]
    try:
        ragged_path, layers = write_ragged_graph(graph, rows, SEQLENS_NAME)
    except ValueError as err:
        progress(f"{role}: no ragged-rows graph ({err}); the batch engine verifies each request alone")
        return
    progress(f"{role}: a ragged-rows graph for the batch engine ({rows} sequences per call"
             + (", drafts included)" if role == "target" else ")"))
    done.layout = reread_kv_dtype_and_files(graph, done.layout)  # the weights moved to a data file
    done.ragged_file = f"{role}/{ragged_path.name}"
    done.optimization["ragged_rows"] = {"rows": rows, "layers": layers, "sha256_after": sha256_of_file(graph)}


def _without_ragged_graph(spec: GraphSpec, staging: Path) -> GraphSpec:
    """Delete `spec`'s ragged-rows graph from the staged artifact; return the spec without it (the weights stay:
    the plain graph reads the same data file)."""
    (staging / spec.ragged_file).unlink()
    optimization = {**spec.optimization, "ragged_rows": {**spec.optimization.get("ragged_rows", {}),
                                                         "left_out": "differs from batch-1 calls on this CPU"}}
    return replace(spec, ragged_file=None, ragged_rows=0, row_tokens_name=None, optimization=optimization,
                   sha256={rel: digest for rel, digest in spec.sha256.items() if rel != spec.ragged_file})


def _quantized_copy(target: GraphSpec, staging: Path, weights: str, progress: Progress) -> GraphSpec:
    """Return the spec of a draft that is the target graph with its weights quantized."""
    progress(f"draft: quantizing a copy of the target to {weights}")
    folder = staging / "draft"
    shutil.copytree(staging / "target", folder)
    graph = folder / Path(target.graph_file).name
    record = quantize_graph(graph, weights, DRAFT_ACCURACY_LEVEL)  # the weights now inside the graph file
    kept = {graph.name} | ({Path(target.kv_slice_file).name} if target.kv_slice_file else set())
    for stale in (p for p in folder.iterdir() if p.name not in kept):  # the target's data file, ragged graph, head
        shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
    ragged = {}
    if target.ragged_file:
        progress(f"draft: a ragged-rows graph for the batch engine ({target.ragged_rows} sequences per call)")
        ragged_path, _ = write_ragged_graph(graph, target.ragged_rows, SEQLENS_NAME)
        ragged = dict(ragged_file=f"draft/{ragged_path.name}", ragged_rows=target.ragged_rows,
                      row_tokens_name=ROW_TOKENS_NAME)
    files = [f"draft/{graph.name}"] + [f"draft/{name}" for name in external_data_files(
        onnx.load(str(graph), load_external_data=False))]
    kv_slice = f"draft/{Path(target.kv_slice_file).name}" if target.kv_slice_file else None
    hashed = files + ([kv_slice] if kv_slice else []) + ([ragged["ragged_file"]] if ragged else [])
    return replace(
        target,
        role="draft",
        files=files,
        sha256={rel: sha256_of_file(staging / rel) for rel in hashed},
        kv_slice_file=kv_slice,
        weights_dtype=weights,
        source=f"quantized:{weights} of {target.source}",
        optimization={**target.optimization, "quantization": record},
        **{"ragged_file": None, "ragged_rows": 0, "row_tokens_name": None, **ragged},
    )


def _validate_quantized(staging: Path, spec: GraphSpec, loaded: LoadedSource, config: ExportConfig,
                        answers: dict, progress: Progress) -> dict:
    """Return the teacher-forced agreement report of a quantized graph; raise ExportError below the floor."""
    floor = config.min_agreement if config.min_agreement is not None else AGREEMENT_FLOOR[spec.weights_dtype]
    progress(f"{spec.role}: validating {spec.weights_dtype} greedy choices against PyTorch's (teacher-forced)")
    if id(loaded.model) not in answers:
        answers[id(loaded.model)] = float_answers(loaded.model, loaded.tokenizer)
    report = teacher_forced_agreement(staging, spec, answers[id(loaded.model)], floor)
    progress(f"{spec.role}: greedy agreement {report.agreement:.1%} over {report.tokens} answer tokens "
             f"(floor {floor:.0%}); max |logit diff| {report.max_logit_diff:.2g}, not bounded for {spec.weights_dtype}")
    if not report.passed:
        raise ExportError(
            f"{spec.role} graph failed validation: its greedy choices agree with PyTorch's at "
            f"{report.agreement:.1%} of {report.tokens} answer positions, below the {spec.weights_dtype} floor "
            f"{floor:.0%} (a broken quantization, or lower the floor with --min-agreement)")
    return report.as_dict()


def _write_tokenizer(loaded: LoadedSource, staging: Path) -> TokenizerSpec:
    folder = staging / "tokenizer"
    loaded.tokenizer.save_pretrained(str(folder))
    files = [f"tokenizer/{name}" for name in TOKENIZER_FILES if (folder / name).is_file()]
    tokenizer = loaded.tokenizer
    eos = list(dict.fromkeys(
        [t for t in [tokenizer.eos_token_id, *loaded.generation_eos] if isinstance(t, int)]
    ))
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
    return TokenizerSpec(
        files=files,
        sha256={rel: sha256_of_file(staging / rel) for rel in files},
        vocab_size=len(tokenizer),
        eos_token_ids=eos,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        chat_template=template,
    )


def run_export(config: ExportConfig, progress: Progress = print) -> Manifest:
    """Build the artifact described by `config`; return its manifest.

    Raises ExportError on bad input or failed validation; nothing is left at the output
    path unless the whole export succeeded.
    """
    config = check_config(config)
    with tempfile.TemporaryDirectory(prefix="specdec-export-") as scratch, \
            staged_folder(config.output, config.force) as staging:
        target, draft, quantized_draft = _load_sources(config, Path(scratch), progress)
        tokenizer_spec = _write_tokenizer(target, staging)
        target_spec = _export_one("target", target, staging, config, progress)
        draft_spec = _export_one("draft", draft, staging, config, progress) if draft else None
        if quantized_draft:
            draft, draft_spec = target, _quantized_copy(target_spec, staging, quantized_draft, progress)

        validation = {}
        answers = {}  # float answers per source model: a quantized draft reuses the target's
        for loaded, spec in ((target, target_spec), (draft, draft_spec)):
            if spec is None:
                continue
            if spec.weights_dtype in AGREEMENT_FLOOR:
                validation[spec.role] = _validate_quantized(staging, spec, loaded, config, answers, progress)
            else:
                validation[spec.role] = _validate_float(staging, spec, loaded, config, progress)
        prompts = [target.tokenizer(p, add_special_tokens=False)["input_ids"][:32] or [0] for p in VALIDATION_PROMPTS]
        target_spec, checked = _check_step_calls(staging, target_spec, prompts, validation, progress)
        draft_spec = _check_ragged_graphs(staging, target_spec, draft_spec, checked, prompts, validation, progress)
        if target_spec.greedy_head:
            _check_greedy_head(checked, prompts, validation, progress)
        manifest = Manifest(
            target=target_spec,
            draft=draft_spec,
            tokenizer=tokenizer_spec,
            provenance=Provenance(
                exporter_version=_versions().get("specdec", "unknown"),
                export_date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                library_versions={**_versions(), **config.library_versions},
                command=config.command,
            ),
            validation=validation,
            runtime_defaults=RuntimeDefaults(num_draft_tokens=4),
        )
        write_manifest(staging, manifest)
        progress(f"wrote {config.output}")
    return manifest


def _load_sources(config: ExportConfig, work: Path,
                  progress: Progress) -> tuple[LoadedSource, LoadedSource | None, str | None]:
    """Return (the loaded target, the loaded draft or None, the quantized draft's weights or None), the draft's
    tokenizer checked against the target's."""
    progress(f"target: loading {config.target}")
    target = load_source(config.target, work / "target", config.trust_remote_code, config.revision)
    draft = None
    quantized_draft = config.draft.split(":", 1)[1] if config.draft and config.draft.startswith("quantized:") \
        else None
    if config.draft and not quantized_draft:
        progress(f"draft: loading {config.draft}")
        draft = load_source(config.draft, work / "draft", config.trust_remote_code, config.revision)
        progress("checking draft and target tokenizers match")
        check_tokenizers_compatible(target.tokenizer, draft.tokenizer)
    return target, draft, quantized_draft


def _validate_float(staging: Path, spec: GraphSpec, loaded: LoadedSource, config: ExportConfig,
                    progress: Progress) -> dict:
    """Return the validation report of a float graph against PyTorch; raise ExportError where it fails."""
    atol = config.atol if config.atol is not None else DEFAULT_ATOL[spec.weights_dtype]
    progress(f"{spec.role}: validating ONNX against PyTorch")
    report = validate_graph(staging, spec, loaded.model, loaded.tokenizer, atol,
                            min_agreement=config.min_agreement if config.min_agreement is not None
                            else MIN_GREEDY_AGREEMENT[spec.weights_dtype])
    progress(
        f"{spec.role}: max |logit diff| prefill {report.max_logit_diff_prefill:.2e}, "
        f"step {report.max_logit_diff_step:.2e} (atol {atol:g}); greedy agreement "
        f"{report.greedy_agreement:.0%} over {report.greedy_tokens} tokens"
        + (f"; long-call kernel {report.max_logit_diff_long_call:.2e}"
           if report.max_logit_diff_long_call is not None else "")
    )
    if not report.passed:
        raise ExportError(
            f"{spec.role} graph failed validation: max logit diff "
            f"{max(report.max_logit_diff_prefill, report.max_logit_diff_step):.3g} vs atol {atol:g}, "
            f"greedy agreement {report.greedy_agreement:.0%}, "
            f"{report.greedy_mismatches_outside_ties} greedy mismatches outside near-ties"
        )
    return report.as_dict()


def _check_step_calls(staging: Path, target_spec: GraphSpec, prompts: list[list[int]], validation: dict,
                      progress: Progress) -> tuple[GraphSpec, ModelSession]:
    """Return (the target spec, with min_rows 2 where this CPU needs it, a session of it) after checking that
    1-token steps score as one call does; record the difference in `validation`, raise ExportError where an
    attention-padded target's still differ."""
    checked = ModelSession(staging, target_spec, provider="cpu")  # one session for this and the later checks
    drift = step_call_difference(checked, prompts)
    validation["target"]["step_vs_call_max_diff"] = drift
    progress(f"target: 1-token steps against the same tokens in one call: max |logit diff| {drift:.2e}"
             + (" (must be 0 with the attention pad)" if target_spec.attention_pad_rows else ""))
    if target_spec.attention_pad_rows and drift != 0.0 and target_spec.kv_buffer == "shared":
        # Some CPUs' MatMul kernels also round a 1-row call differently (MatMulNBits on AVX2-only
        # CPUs): then every call gets a second, throwaway row (min_rows), checked the same way.
        padded = replace(target_spec, min_rows=2)
        checked = ModelSession(staging, padded, provider="cpu")
        unpadded, drift = drift, step_call_difference(checked, prompts)
        validation["target"].update(step_vs_call_max_diff=drift, step_vs_call_max_diff_one_row=unpadded)
        progress(f"target: this CPU's 1-row calls still differ by {unpadded:.2e}: every call gets 2 rows "
                 f"at least (min_rows 2); max |logit diff| now {drift:.2e}")
        target_spec = padded
    if target_spec.attention_pad_rows and drift != 0.0:
        raise ExportError(f"target graph: 1-token steps and verify calls still differ by {drift:.3g} in logits "
                          "after the attention pad; speculative greedy output would not be exact")
    return target_spec, checked


def _check_ragged_graphs(staging: Path, target_spec: GraphSpec, draft_spec: GraphSpec | None, checked: ModelSession,
                         prompts: list[list[int]], validation: dict, progress: Progress) -> GraphSpec | None:
    """Check each ragged-rows graph against batch-1 calls (`checked`: the target's session) and record it in
    `validation`; return the draft spec, without its ragged graph where this CPU's differs. Raise ExportError
    where the target's differs."""
    for spec in (target_spec, draft_spec):
        if spec is not None and spec.ragged_file:
            session = checked if spec is target_spec else ModelSession(staging, spec, provider="cpu")
            ragged_diff = ragged_rows_difference(session, prompts)
            if ragged_diff != 0.0 and spec is draft_spec:
                # MatMulNBits on AVX2-only CPUs rounds a 1-row call apart from a multi-row one; a draft's
                # ragged rows must equal its batch-1 calls (a seeded request drafts alike at any load), so
                # there its calls stay batch-1 and the graph goes.
                progress(f"draft: this CPU's ragged-rows graph differs from batch-1 calls by {ragged_diff:.2e}: "
                         "left out (the batch engine runs each request's draft calls alone)")
                validation["draft"]["ragged_rows_left_out_diff"] = ragged_diff
                draft_spec = _without_ragged_graph(spec, staging)
                continue
            validation[spec.role]["ragged_rows_max_diff"] = ragged_diff
            progress(f"{spec.role}: ragged-rows graph against batch-1 calls: max |logit diff| {ragged_diff:.2e}")
            if ragged_diff != 0.0:
                raise ExportError(f"{spec.role} graph: the ragged-rows graph differs from batch-1 calls by "
                                  f"{ragged_diff:.3g} in logits; export with --batch-rows 0")
    return draft_spec


def _check_greedy_head(checked: ModelSession, prompts: list[list[int]], validation: dict, progress: Progress) -> None:
    """Check that the target's 8-bit greedy head bounds its fp32 head and record it in `validation`; raise
    ExportError where it does not."""
    check = greedy_head_check(checked, prompts)
    validation["target"]["greedy_head"] = check
    progress(f"target: 8-bit greedy head over {check['positions']} positions: argmax equal to the fp32 "
             f"head's {check['argmax_equal']}, |error| / bound at most {check['max_error_over_bound']:.3f}, "
             f"{check['candidates_median']:.0f} candidates (median), {check['candidates_max']} at most")
    if not (check["argmax_equal"] and check["bound_holds"]):
        raise ExportError("target graph: the 8-bit greedy head does not bound the fp32 head "
                          f"(|error| / bound {check['max_error_over_bound']:.3g}, argmax equal "
                          f"{check['argmax_equal']}); export without --greedy-head")
