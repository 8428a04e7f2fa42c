"""The artifact contract: `specdec.json`, written by the exporter and read by the runtime.

An artifact folder holds:

    specdec.json            this manifest
    target/model.onnx       target graph (+ model.onnx_data when weights are external)
    target/kv_slice.onnx    tiny graph that crops the target's KV cache on the device
                            (concat graphs only: a shared buffer rolls back by its length)
    draft/...               same for the draft model (absent with --draft none)
    eagle-<sha>/            `specdec distill`'s draft head (optional)
    phrases-<sha>.npz       `specdec phrases`' table of the target's usual continuations (optional)
    tokenizer/tokenizer.json, tokenizer_config.json, ...

Loading a manifest checks every field's presence and type and names the first bad one.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Collection
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from specdec.models.errors import ArtifactError, ManifestError

MANIFEST_FILENAME = "specdec.json"
MANIFEST_FORMAT = "specdec-artifact"
# Bump when the runtime can no longer read older artifacts the same way.
# v2 added GraphSpec.optimization; v1 artifacts load as plain graphs.
# v3 added GraphSpec.kv_buffer ("shared": graphs an older runtime cannot drive) and the
# length inputs that go with it; v1/v2 artifacts load as "concat".
# v4 added GraphSpec.logits_rows_name, a required input an older runtime would not bind.
# v5 added GraphSpec.min_rows: an older runtime would make 1-row calls to an int4 target and
# leave its greedy output under speculation.
# v6 added GraphSpec.attention_pad_rows: the graph writes one position past each call, which an
# older runtime would not reserve in the KV buffer.
# v7 added GraphSpec.greedy_head: its graph has an input (lm_head_row_start) an older runtime would not bind.
# v8 added GraphSpec.long_call_name: a required input (which attention kernel a call takes).
# v9 added GraphSpec.head_row_start_name: a tapped graph's LM head reads from that row on (required input).
MANIFEST_VERSION = 9
SUPPORTED_MANIFEST_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8, 9)
KV_BUFFERS = ("concat", "shared")
FLOAT_DTYPES = ("fp32", "fp16")  # what `specdec export --dtype` may ask for
WEIGHT_DTYPES = ("fp32", "fp16", "int8", "int4")  # GraphSpec.weights_dtype; `--weights`
TRACE_DEVICES = ("cpu", "cuda")  # where PyTorch traces and validates a model (`--device`)


@dataclass(frozen=True)
class GraphSpec:
    """One exported ONNX decoder graph and everything the runtime needs to drive it."""

    role: str  # "target" or "draft"
    files: list[str]  # graph file first, then external-data files; relative to the artifact
    sha256: dict[str, str]  # relative path -> hex digest, for every file in `files` and kv_slice_file
    # graph with inputs (past..., keep) that crops each past along the sequence axis; None for
    # a shared buffer (kv_buffer "shared"), which rolls back by its length alone
    kv_slice_file: str | None
    model_type: str
    family: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str  # numpy dtype name of past/present tensors: "float32" or "float16"
    input_ids_name: str
    attention_mask_name: str | None  # None: the graph has no mask input (kv_buffer "shared")
    position_ids_name: str | None  # None: the graph derives positions itself
    past_names: list[list[str]]  # per layer: [key input, value input]
    present_names: list[list[str]]  # per layer: [key output, value output]
    logits_name: str
    max_positions: int
    vocab_size: int  # rows of the LM head; may exceed the tokenizer (padding)
    weights_dtype: str  # "fp32" or "fp16"
    source: str  # hub id, folder or GGUF path it was exported from
    revision: str | None = None
    # What the exporter's optimization stage did: applied steps, fused operators, graph
    # sha256 before/after, or a note on why the plain graph was kept ({} in v1 artifacts).
    optimization: dict[str, Any] = field(default_factory=dict)
    # How the graph keeps its KV cache. "concat": present = past + new positions, a new
    # tensor each step (rollback crops with kv_slice_file). "shared": past and present are
    # one preallocated buffer per tensor, [batch, kv_heads, capacity, head_dim], written in
    # place; the graph reads `seqlens_name` (int32 [batch], total length - 1; graphs exported
    # before the batch engine declare [1] and run at batch 1 only) and
    # `total_length_name` (int32 scalar), and a rollback is only a shorter length.
    kv_buffer: str = "concat"
    seqlens_name: str | None = None
    total_length_name: str | None = None
    # int64 [1] input: the lm_head runs over only this many trailing positions (0: all of them).
    # None: the graph computes every row (artifacts before v4, or a graph the rewrite did not fit).
    logits_rows_name: str | None = None
    # Output holding the state that feeds the LM head (after the final norm), [batch, seq, hidden],
    # for a drafter that reads the target's features (`specdec distill` adds it); None: no such output.
    hidden_name: str | None = None
    # Decoder layers whose normed inputs follow the last feature in `hidden_name` (EAGLE-3's lower taps):
    # its width is hidden * (1 + len(hidden_layers)). Empty: the last feature only.
    hidden_layers: list[int] = field(default_factory=list)
    # Fewest tokens (and logits rows) any call may have (v5 int4 targets; the exporter now writes
    # attention_pad_rows instead, same numbers): the runtime pads a shorter call with throwaway
    # positions past the cache's length (shared KV buffer only), so no call has a 1-row attention.
    min_rows: int = 1
    # Throwaway query rows the graph's attention appends to every call (specdec/exporter/attention_rows.py),
    # so no token goes through the op's 1-row path: the graph writes that many positions past the
    # call in the shared KV buffer, which must have room for them (max_positions leaves it).
    attention_pad_rows: int = 0
    # `specdec export --greedy-head`: an 8-bit copy of the LM head in the graph that greedy calls read
    # instead of the fp32 one (specdec/exporter/greedy_head.py, specdec/runtime/greedy_head.py). Keys: weights, norms
    # (artifact-relative files, in sha256), row_start_name / approx_row_start_name (inputs: 0 runs that
    # head, a huge value skips it), approx_name (the 8-bit logits), input_name (the rows both heads
    # read); None: no such head.
    greedy_head: dict[str, Any] | None = None
    # bool [1] input choosing each attention's kernel (specdec/exporter/long_call_attention.py): true takes
    # onnxruntime's causal-softmax kernel, faster for a prefill; the runtime sets it for calls longer
    # than any verify call. None: the graph has one kernel.
    long_call_name: str | None = None
    # int64 [1] input of a tapped graph without a greedy head (`specdec distill`): its LM head reads the
    # kept rows from this index on, so a hidden-state call (every row kept, for the features) computes
    # only the logits asked for. None: the head reads every kept row (or greedy_head's inputs do this).
    head_row_start_name: str | None = None
    # The batch engine's graph (specdec/exporter/ragged_rows.py): ragged_rows sequences of any token
    # counts in one call, flattened along the tokens and split per row by the int64 [rows] input
    # row_tokens_name; each row's KV is its own input/output (`<past name>.<row>`). Listed in sha256.
    # None: the batch engine verifies drafts in batch-1 calls.
    ragged_file: str | None = None
    ragged_rows: int = 0
    row_tokens_name: str | None = None

    @property
    def kv_capacity_limit(self) -> int:
        """Return the most positions a shared KV buffer of this graph may need: max_positions + attention_pad_rows."""
        return self.max_positions + self.attention_pad_rows

    @property
    def graph_file(self) -> str:
        """Return the path of the ONNX graph, relative to the artifact."""
        return self.files[0]

    @property
    def pads_calls(self) -> bool:
        """Return whether no call of this graph runs one query row alone (an attention pad, or min_rows > 1: int4
        and --exact-steps), so that a token scores alike in calls of every length."""
        return self.attention_pad_rows > 0 or self.min_rows > 1

    @property
    def serving_slots(self) -> int:
        """Return the KV slots a batch engine serving this target takes by default: twice the ragged-rows graph's
        rows (a light load stays in those rows, where drafts are verified together; a heavy one fills the rest
        with batched decode calls), those rows alone where every step must be a ragged call (int4 and
        --exact-steps: their plain graph batches no 1-token rows), 8 without that graph (an older export)."""
        if not self.ragged_rows:
            return 8
        return self.ragged_rows if self.pads_calls else 2 * self.ragged_rows

    def slots_refusal(self, slots: int) -> str | None:
        """Return why a batch engine of `slots` KV slots cannot run this target, as far as the manifest tells (a
        padded graph batches only through its ragged-rows graph, so its slots must be those rows), else None."""
        if self.pads_calls and self.ragged_rows and slots != self.ragged_rows:
            return (f"this artifact's target graph batches only through its ragged-rows graph of {self.ragged_rows} "
                    f"rows: use --max-batch {self.ragged_rows}")
        return None


@dataclass(frozen=True)
class TokenizerSpec:
    """The tokenizer both models share, and its special tokens."""

    files: list[str]
    sha256: dict[str, str]
    vocab_size: int  # ids the tokenizer can produce; logits beyond this are masked
    eos_token_ids: list[int]
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    chat_template: str | None = None

    @property
    def tokenizer_json(self) -> str:
        """Return the relative path of the `tokenizers` JSON file."""
        return next(f for f in self.files if f.endswith("tokenizer.json"))


@dataclass(frozen=True)
class Provenance:
    """Where an artifact came from and what built it."""

    exporter_version: str
    export_date: str
    library_versions: dict[str, str] = field(default_factory=dict)
    command: str | None = None


DRAFTER_KINDS = ("model", "ngram", "eagle", "ngram+model", "ngram+eagle", "none")  # what a stored default drafter may be
FEATURE_DRAFT_KINDS = ("eagle",)  # trained drafts that read the target's hidden states


@dataclass(frozen=True)
class FeatureDraftSpec:
    """A draft head trained by `specdec distill` on the target's own features (EAGLE-style).

    Its graph takes the target's hidden states and the next tokens and proposes over a
    subset of the vocabulary (`subset_file`, int64 ids); `target_graph_sha256` names the
    target graph it was trained against, so a draft moved onto another target is refused.
    """

    kind: str  # one of FEATURE_DRAFT_KINDS
    files: list[str]  # draft graph first, then the vocabulary subset (.npy); relative to the artifact
    sha256: dict[str, str]
    hidden_size: int
    num_kv_heads: int
    head_dim: int
    vocab_subset: int  # ids the draft can propose (q = 0 elsewhere)
    target_graph_sha256: str
    training: dict[str, Any] = field(default_factory=dict)  # data size, minutes, seed, steps, held-out acceptance
    # The batch engine's graph of the head: one round of up to ragged_rows requests' calls in one call, each row
    # equal to its batch-1 call (specdec/exporter/distill/ragged_head.py); listed in sha256. None: heads distilled
    # before it, whose calls run one request at a time.
    ragged_file: str | None = None
    ragged_rows: int = 0

    @property
    def graph_file(self) -> str:
        """Return the path of the draft head's ONNX graph, relative to the artifact."""
        return self.files[0]

    @property
    def subset_file(self) -> str:
        """Return the path of the vocabulary subset (.npy of int64 ids), relative to the artifact."""
        return self.files[1]


@dataclass(frozen=True)
class PhraseTableSpec:
    """`specdec phrases`' table of the target's own usual continuations (specdec/runtime/phrases.py).

    Only token ids are in it, so it fits any graph of the same tokenizer; `built` records what
    made it (answers, tokens, minutes, seed, the counting settings, the target graph's sha256).
    """

    files: list[str]  # the table (.npz), relative to the artifact
    sha256: dict[str, str]
    built: dict[str, Any] = field(default_factory=dict)

    @property
    def table_file(self) -> str:
        """Return the path of the table (.npz), relative to the artifact."""
        return self.files[0]


@dataclass(frozen=True)
class RuntimeDefaults:
    """What the runtime starts from when the caller does not say: written by the exporter and `specdec tune`."""

    num_draft_tokens: int | str | None = None  # K, or "auto"; None: the runtime's own default
    drafter: str | None = None  # one of DRAFTER_KINDS; None: the draft model if there is one, else n-gram
    verify_cost: float = 0.0  # v: each verified token beyond the first, in 1-token target calls
    target_call_costs: tuple[float, ...] = ()  # t(n) / t(1) for n = 1, 2, ... as `specdec tune` timed it
    tuned: dict[str, Any] = field(default_factory=dict)  # what tune measured (alpha, c), for people
    other: dict[str, Any] = field(default_factory=dict)  # keys this version does not know, kept as written

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON form: only the fields that are set, then the unknown keys."""
        known = {"num_draft_tokens": self.num_draft_tokens, "drafter": self.drafter,
                 "verify_cost": self.verify_cost or None,
                 "target_call_costs": list(self.target_call_costs) or None, "tuned": self.tuned or None}
        return {**{key: value for key, value in known.items() if value is not None}, **self.other}


@dataclass(frozen=True)
class Manifest:
    """The whole `specdec.json`."""

    target: GraphSpec
    draft: GraphSpec | None
    tokenizer: TokenizerSpec
    provenance: Provenance
    # Per-model figures from the exporter's numerical validation.
    validation: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Defaults the runtime uses when the caller does not say (`specdec tune` writes here).
    runtime_defaults: RuntimeDefaults = field(default_factory=RuntimeDefaults)
    version: int = MANIFEST_VERSION
    feature_draft: FeatureDraftSpec | None = None  # `specdec distill`'s trained draft head, if any
    phrase_table: PhraseTableSpec | None = None  # `specdec phrases`' table for the n-gram drafter, if any

    def graphs(self) -> list[GraphSpec]:
        """Return the target spec, then the draft spec if there is one."""
        return [self.target] + ([self.draft] if self.draft else [])

    def to_dict(self) -> dict[str, Any]:
        """Return the JSON-ready form of the manifest."""
        body = asdict(self)
        body.pop("version")
        if self.feature_draft is None:
            body.pop("feature_draft")  # artifacts without one read as before
        if self.phrase_table is None:
            body.pop("phrase_table")
        body["runtime_defaults"] = self.runtime_defaults.to_dict()
        return {"format": MANIFEST_FORMAT, "version": self.version, **body}


# ---------------------------------------------------------------- reading, checked


def _get(data: dict, key: str, kinds: tuple, where: str, optional: bool = False) -> Any:
    path = f"{where}.{key}" if where else key
    if not isinstance(data, dict):
        raise ManifestError(f"{MANIFEST_FILENAME}: '{where}' must be an object")
    if key not in data or (data[key] is None and optional):
        if optional:
            return None
        raise ManifestError(f"{MANIFEST_FILENAME}: missing field '{path}'")
    value = data[key]
    # bool is an int in Python; a boolean where a count belongs is still wrong.
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = "/".join(k.__name__ for k in kinds)
        raise ManifestError(
            f"{MANIFEST_FILENAME}: field '{path}' should be {names}, got {type(value).__name__}"
        )
    return value


# Each GraphSpec field's JSON types, in the dataclass's order: the order a manifest's fields are checked in.
_GRAPH_FIELDS: dict[str, tuple] = {
    "role": (str,), "files": (list,), "sha256": (dict,), "kv_slice_file": (str,), "model_type": (str,),
    "family": (str,), "num_layers": (int,), "num_kv_heads": (int,), "head_dim": (int,), "kv_dtype": (str,),
    "input_ids_name": (str,), "attention_mask_name": (str,), "position_ids_name": (str,), "past_names": (list,),
    "present_names": (list,), "logits_name": (str,), "max_positions": (int,), "vocab_size": (int,),
    "weights_dtype": (str,), "source": (str,), "revision": (str,), "optimization": (dict,), "kv_buffer": (str,),
    "seqlens_name": (str,), "total_length_name": (str,), "logits_rows_name": (str,), "hidden_name": (str,),
    "hidden_layers": (list,), "min_rows": (int,), "attention_pad_rows": (int,), "greedy_head": (dict,),
    "long_call_name": (str,), "head_row_start_name": (str,), "ragged_file": (str,), "ragged_rows": (int,),
    "row_tokens_name": (str,),
}
# Fields without a default whose None means something (see GraphSpec): a manifest may leave them out or null.
_GRAPH_NULLABLE = frozenset({"kv_slice_file", "attention_mask_name", "position_ids_name"})
# Fields a manifest may leave out or null: those, and every field with a default (added by later versions).
_GRAPH_OPTIONAL = _GRAPH_NULLABLE | {
    f.name for f in fields(GraphSpec) if f.default is not MISSING or f.default_factory is not MISSING}


def _graph_from_dict(data: Any, where: str) -> GraphSpec:
    values = _fields(data, where, _GRAPH_FIELDS, _GRAPH_OPTIONAL)
    # Absent or null, a field with a default takes GraphSpec's (kv_buffer "concat", min_rows 1, optimization {}, ...).
    spec = GraphSpec(**{key: value for key, value in values.items() if value is not None or key in _GRAPH_NULLABLE})
    if not spec.files:
        raise ManifestError(f"{MANIFEST_FILENAME}: '{where}.files' is empty")
    for name, pairs in (("past_names", spec.past_names), ("present_names", spec.present_names)):
        if len(pairs) != spec.num_layers or any(len(p) != 2 for p in pairs):
            raise ManifestError(
                f"{MANIFEST_FILENAME}: '{where}.{name}' must hold {spec.num_layers} [key, value] pairs"
            )
    if spec.kv_buffer not in KV_BUFFERS:
        raise ManifestError(f"{MANIFEST_FILENAME}: '{where}.kv_buffer' must be concat or shared, got {spec.kv_buffer}")
    if spec.kv_buffer == "shared" and not (spec.seqlens_name and spec.total_length_name):
        raise ManifestError(f"{MANIFEST_FILENAME}: '{where}' has a shared KV buffer but no seqlens/total length inputs")
    if spec.kv_buffer == "concat" and not spec.attention_mask_name:
        raise ManifestError(f"{MANIFEST_FILENAME}: missing field '{where}.attention_mask_name'")
    if spec.kv_buffer == "concat" and not spec.kv_slice_file:
        raise ManifestError(f"{MANIFEST_FILENAME}: missing field '{where}.kv_slice_file'")
    if spec.min_rows < 1 or (spec.min_rows > 1 and spec.kv_buffer != "shared"):
        raise ManifestError(f"{MANIFEST_FILENAME}: '{where}.min_rows' must be 1, or more with a shared KV buffer "
                            f"(padding positions are dropped by length), got {spec.min_rows}")
    if spec.attention_pad_rows not in (0, 1) or (spec.attention_pad_rows and spec.kv_buffer != "shared"):
        raise ManifestError(f"{MANIFEST_FILENAME}: '{where}.attention_pad_rows' must be 0, or 1 with a shared KV "
                            f"buffer, got {spec.attention_pad_rows}")
    if spec.greedy_head is not None:
        missing = [k for k in ("weights", "norms", "row_start_name", "approx_row_start_name", "approx_name", "input_name")
                   if k not in spec.greedy_head]
        if missing:
            raise ManifestError(f"{MANIFEST_FILENAME}: '{where}.greedy_head' lacks {', '.join(missing)}")
    if spec.kv_dtype not in ("float32", "float16"):
        raise ManifestError(f"{MANIFEST_FILENAME}: '{where}.kv_dtype' must be float32 or float16, got {spec.kv_dtype}")
    return spec


def _fields(data: Any, where: str, kinds: dict[str, tuple], optional: Collection[str] = ()) -> dict[str, Any]:
    """Return {field: value} for the fields of one manifest object, each type-checked in the order of `kinds`;
    an `optional` field absent or null is None."""
    return {key: _get(data, key, types, where, key in optional) for key, types in kinds.items()}


def _tokenizer_from_dict(data: Any) -> TokenizerSpec:
    spec = TokenizerSpec(**_fields(data, "tokenizer", {
        "files": (list,), "sha256": (dict,), "vocab_size": (int,), "eos_token_ids": (list,), "bos_token_id": (int,),
        "pad_token_id": (int,), "chat_template": (str,)}, optional={"bos_token_id", "pad_token_id", "chat_template"}))
    if not any(f.endswith("tokenizer.json") for f in spec.files):
        raise ManifestError(f"{MANIFEST_FILENAME}: 'tokenizer.files' has no tokenizer.json")
    return spec


def manifest_from_dict(data: Any) -> Manifest:
    """Return a Manifest built from parsed JSON, or raise ManifestError naming the first bad field."""
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        raise ManifestError(f"{MANIFEST_FILENAME}: not a specdec manifest (no \"format\": \"{MANIFEST_FORMAT}\")")
    version = _get(data, "version", (int,), "")
    if version not in SUPPORTED_MANIFEST_VERSIONS:
        raise ManifestError(
            f"{MANIFEST_FILENAME}: manifest version {version} is not supported by this specdec "
            f"(reads {', '.join(map(str, SUPPORTED_MANIFEST_VERSIONS))}); re-export the artifact with this version"
        )
    prov = _get(data, "provenance", (dict,), "")
    draft = data.get("draft")
    return Manifest(
        target=_graph_from_dict(_get(data, "target", (dict,), ""), "target"),
        draft=None if draft is None else _graph_from_dict(draft, "draft"),
        tokenizer=_tokenizer_from_dict(_get(data, "tokenizer", (dict,), "")),
        provenance=Provenance(
            exporter_version=_get(prov, "exporter_version", (str,), "provenance"),
            export_date=_get(prov, "export_date", (str,), "provenance"),
            library_versions=_get(prov, "library_versions", (dict,), "provenance", True) or {},
            command=_get(prov, "command", (str,), "provenance", True),
        ),
        validation=_get(data, "validation", (dict,), "", True) or {},
        runtime_defaults=_runtime_defaults_from_dict(_get(data, "runtime_defaults", (dict,), "", True) or {}),
        version=version,
        feature_draft=_feature_draft_from_dict(data["feature_draft"]) if data.get("feature_draft") else None,
        phrase_table=_phrase_table_from_dict(data["phrase_table"]) if data.get("phrase_table") else None,
    )


def _phrase_table_from_dict(data: Any) -> PhraseTableSpec:
    where = "phrase_table"
    spec = PhraseTableSpec(files=_get(data, "files", (list,), where), sha256=_get(data, "sha256", (dict,), where),
                           built=_get(data, "built", (dict,), where, True) or {})
    if len(spec.files) != 1 or not isinstance(spec.files[0], str) or spec.files[0] not in spec.sha256:
        raise ManifestError(f"{MANIFEST_FILENAME}: '{where}.files' must hold the table's path, with its sha256")
    return spec


def _feature_draft_from_dict(data: Any) -> FeatureDraftSpec:
    where = "feature_draft"
    spec = FeatureDraftSpec(**_fields(data, where, {
        "kind": (str,), "files": (list,), "sha256": (dict,), "hidden_size": (int,), "num_kv_heads": (int,),
        "head_dim": (int,), "vocab_subset": (int,), "target_graph_sha256": (str,)}), training=_get(
        data, "training", (dict,), where, True) or {}, ragged_file=_get(data, "ragged_file", (str,), where, True),
        ragged_rows=_get(data, "ragged_rows", (int,), where, True) or 0)
    if spec.kind not in FEATURE_DRAFT_KINDS:
        raise ManifestError(f"{MANIFEST_FILENAME}: '{where}.kind' must be one of {', '.join(FEATURE_DRAFT_KINDS)}, "
                            f"got {spec.kind!r}")
    if len(spec.files) != 2:
        raise ManifestError(f"{MANIFEST_FILENAME}: '{where}.files' must hold [draft graph, vocabulary subset]")
    if spec.ragged_file is not None and (spec.ragged_file not in spec.sha256 or spec.ragged_rows < 2):
        raise ManifestError(f"{MANIFEST_FILENAME}: '{where}.ragged_file' needs its sha256 and 'ragged_rows' >= 2")
    return spec


def is_call_cost_table(values: Any) -> bool:
    """Return whether `values` is a list of positive numbers: t(n) / t(1) for n = 1, 2, ...

    The one check for a call-cost table, wherever one is read (the manifest, the runtime's cache).
    """
    return isinstance(values, list) and all(
        isinstance(c, (int, float)) and not isinstance(c, bool) and c > 0 for c in values)


def _runtime_defaults_from_dict(data: dict) -> RuntimeDefaults:
    """Return the runtime defaults after checking every field the runtime reads (unknown keys pass through)."""
    where = "runtime_defaults"
    k = data.get("num_draft_tokens")
    if k is not None and k != "auto" and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
        raise ManifestError(f"{MANIFEST_FILENAME}: field '{where}.num_draft_tokens' should be an integer >= 1 "
                            f"or 'auto', got {k!r}")
    drafter = _get(data, "drafter", (str,), where, True)
    if drafter is not None and drafter not in DRAFTER_KINDS:
        raise ManifestError(f"{MANIFEST_FILENAME}: field '{where}.drafter' should be one of "
                            f"{', '.join(DRAFTER_KINDS)}, got {drafter!r}")
    verify_cost = _get(data, "verify_cost", (int, float), where, True)
    if verify_cost is not None and verify_cost < 0:
        raise ManifestError(f"{MANIFEST_FILENAME}: field '{where}.verify_cost' should be >= 0, got {verify_cost}")
    costs = _get(data, "target_call_costs", (list,), where, True)
    if costs is not None and not is_call_cost_table(costs):
        raise ManifestError(f"{MANIFEST_FILENAME}: field '{where}.target_call_costs' should be a list of "
                            f"positive numbers (a call over n tokens in 1-token calls, n = 1, 2, ...)")
    tuned = _get(data, "tuned", (dict,), where, True)
    known = {"num_draft_tokens", "drafter", "verify_cost", "target_call_costs", "tuned"}
    return RuntimeDefaults(num_draft_tokens=k, drafter=drafter, verify_cost=float(verify_cost or 0.0),
                           target_call_costs=tuple(float(c) for c in costs or ()), tuned=tuned or {},
                           other={key: value for key, value in data.items() if key not in known})


def load_manifest(artifact_dir: str | os.PathLike, check_files: bool = True) -> Manifest:
    """Return the validated manifest of an artifact folder.

    With `check_files`, every file the manifest lists must exist and match its sha256.
    Raises ArtifactError or ManifestError with a message naming the problem.
    """
    folder = Path(artifact_dir)
    if not folder.is_dir():
        raise ArtifactError(f"artifact folder '{folder}' does not exist (build one with `specdec export`)")
    path = folder / MANIFEST_FILENAME
    if not path.is_file():
        raise ArtifactError(f"'{folder}' has no {MANIFEST_FILENAME}: not a specdec artifact")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ManifestError(f"{path}: not valid JSON ({err})") from None
    manifest = manifest_from_dict(data)
    if check_files:
        verify_checksums(folder, manifest)
    return manifest


def write_manifest(artifact_dir: str | os.PathLike, manifest: Manifest) -> Path:
    """Write `specdec.json` into a folder; return its path."""
    path = Path(artifact_dir) / MANIFEST_FILENAME
    path.write_text(json.dumps(manifest.to_dict(), indent=2, sort_keys=False) + "\n", encoding="utf-8")
    return path


def update_runtime_defaults(artifact_dir: str | os.PathLike, updates: dict[str, Any]) -> Manifest:
    """Merge `updates` into the artifact's runtime defaults, rewriting specdec.json atomically; return the new manifest."""
    folder = Path(artifact_dir)
    manifest = load_manifest(folder, check_files=False)
    updated = replace(manifest, runtime_defaults=_runtime_defaults_from_dict(
        {**manifest.runtime_defaults.to_dict(), **updates}))
    temporary = folder / (MANIFEST_FILENAME + ".tmp")
    temporary.write_text(json.dumps(updated.to_dict(), indent=2) + "\n", encoding="utf-8")
    os.replace(temporary, folder / MANIFEST_FILENAME)
    return updated


def sha256_of_file(path: str | os.PathLike) -> str:
    """Return the hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_checksums(artifact_dir: str | os.PathLike, manifest: Manifest) -> None:
    """Raise ArtifactError if a file listed in the manifest is missing or its sha256 differs."""
    folder = Path(artifact_dir)
    listed: dict[str, str] = dict(manifest.tokenizer.sha256)
    for graph in manifest.graphs():
        listed.update(graph.sha256)
    if manifest.feature_draft is not None:
        listed.update(manifest.feature_draft.sha256)
    if manifest.phrase_table is not None:
        listed.update(manifest.phrase_table.sha256)
    for rel, expected in listed.items():
        path = folder / rel
        if not path.is_file():
            raise ArtifactError(f"artifact file '{rel}' is missing from '{folder}'; re-export the artifact")
        actual = sha256_of_file(path)
        if actual != expected:
            raise ArtifactError(
                f"artifact file '{rel}' does not match its sha256 in {MANIFEST_FILENAME} "
                f"(expected {expected[:12]}…, found {actual[:12]}…): the file changed; re-export the artifact"
            )
