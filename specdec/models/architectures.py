"""Per-architecture facts: how to read KV layout from a Hugging Face config.

Each family is one small `ArchitectureSpec`; nothing else in specdec branches on the
model type. The KV layout of every optimum `text-generation-with-past` graph we export is
`[batch, kv_heads, sequence, head_dim]` per layer, one `key` and one `value` tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from specdec.models.errors import ExportError

# optimum's naming for past/present tensors; graphs we export always use these.
PAST_KEY = "past_key_values.{layer}.key"
PAST_VALUE = "past_key_values.{layer}.value"
PRESENT_KEY = "present.{layer}.key"
PRESENT_VALUE = "present.{layer}.value"
KV_SEQUENCE_AXIS = 2


@dataclass(frozen=True)
class ArchitectureSpec:
    """How one model family names its sizes in `config.json`."""

    family: str
    layers_key: str = "num_hidden_layers"
    heads_key: str = "num_attention_heads"
    # None: the family has no grouped-query attention, KV heads == attention heads.
    kv_heads_key: str | None = "num_key_value_heads"
    hidden_key: str = "hidden_size"
    positions_key: str = "max_position_embeddings"
    # Some configs carry an explicit head_dim that differs from hidden / heads.
    head_dim_key: str | None = "head_dim"
    # onnxruntime.transformers optimizer model type whose fusions the exporter applies
    # (None: keep the plain optimum graph). Chosen by measurement, see benchmarks/RESULTS.md.
    ort_fusion_type: str | None = None
    # FusionOptions flags turned off for the family: passes that find nothing in its graphs, since each
    # one walks the whole graph (on SmolLM2 these five cost ~6 s of an export and change no node).
    ort_fusions_off: tuple[str, ...] = ()
    # Rewrite attention into onnxruntime's GroupQueryAttention over one preallocated KV
    # buffer per tensor (specdec/exporter/shared_kv.py). Only for families whose attention is causal
    # softmax attention, full or over a sliding window (no alibi, no softcapping).
    shared_kv_buffer: bool = False
    # Why a family keeps the concat KV cache (shared_kv_buffer False), said in the manifest's optimization record.
    concat_reason: str | None = None
    # Config key of the sliding attention window (None: the family always attends to the whole past).
    sliding_window_key: str | None = None

    def num_layers(self, config: Mapping[str, Any]) -> int:
        """Return the number of transformer layers."""
        return int(_require(config, self.layers_key, self.family))

    def num_kv_heads(self, config: Mapping[str, Any]) -> int:
        """Return the number of key/value heads per layer."""
        if self.kv_heads_key and config.get(self.kv_heads_key) is not None:
            return int(config[self.kv_heads_key])
        return int(_require(config, self.heads_key, self.family))

    def head_dim(self, config: Mapping[str, Any]) -> int:
        """Return the per-head dimension of K and V."""
        if self.head_dim_key and config.get(self.head_dim_key):
            return int(config[self.head_dim_key])
        hidden = int(_require(config, self.hidden_key, self.family))
        heads = int(_require(config, self.heads_key, self.family))
        return hidden // heads

    def layer_windows(self, config: Mapping[str, Any]) -> list[int | None]:
        """Return per layer how many positions a query attends to, itself included (None: the whole past).

        A config with `layer_types` (qwen2 and newer transformers configs) says which layers
        slide; otherwise a set sliding window applies to every layer (mistral).
        """
        layers = self.num_layers(config)
        window = config.get(self.sliding_window_key) if self.sliding_window_key else None
        if not window:
            return [None] * layers
        kinds = config.get("layer_types")
        if isinstance(kinds, list) and len(kinds) == layers:
            return [int(window) if kind == "sliding_attention" else None for kind in kinds]
        if config.get("use_sliding_window") is False:  # qwen2 configs written before layer_types
            return [None] * layers
        first = int(config.get("max_window_layers") or 0)  # qwen2: layers from here on slide
        return [int(window) if layer >= first else None for layer in range(layers)]

    def max_positions(self, config: Mapping[str, Any]) -> int:
        """Return the longest sequence (prompt + generated) the model supports."""
        return int(_require(config, self.positions_key, self.family))


def _require(config: Mapping[str, Any], key: str, family: str) -> Any:
    if config.get(key) is None:
        raise ExportError(f"{family} config has no '{key}'; is this really a {family} model?")
    return config[key]


# onnxruntime's "gpt2" fusion set on optimum's llama graph fuses RMSNorm (+ residual add) into
# SkipSimplifiedLayerNormalization and the rotary embedding into RotaryEmbedding. Measured on
# SmolLM2-135M (2-core CPU, alternating runs, 96 greedy tokens): decode 3.5-6% faster for
# target-only and n-gram speculation, identical greedy output. Other families stay plain
# until measured.
# The shared KV buffer on top (SmolLM2, past 256 / 1024, 2 cores, alternating): a 1-token
# step 26.6 -> 23.5 ms / 31.1 -> 25.3 ms against the concat graph, and rollback becomes free.
_LLAMA_LIKE = ArchitectureSpec(family="llama", ort_fusion_type="gpt2", shared_kv_buffer=True,
                               ort_fusions_off=("enable_gelu", "enable_bias_gelu", "enable_embed_layer_norm",
                                                "enable_bias_skip_layer_norm", "enable_qordered_matmul"))

# model_type (config.json) -> spec. Extend here, and only here, to support a family.
_ARCHITECTURES: dict[str, ArchitectureSpec] = {
    "gpt2": ArchitectureSpec(
        family="gpt2",
        layers_key="n_layer",
        heads_key="n_head",
        kv_heads_key=None,
        hidden_key="n_embd",
        positions_key="n_positions",
        head_dim_key=None,
        concat_reason="learned positions in a graph the shared-buffer rewrite was not written for",
    ),
    "llama": _LLAMA_LIKE,
    # Same attention as llama, over a sliding window where the config sets one; the shared
    # buffer is checked exact against PyTorch past the window (tests/exporter/test_windows.py),
    # its speed measured on llama only. No onnxruntime fusions until measured for them.
    "mistral": ArchitectureSpec(family="mistral", shared_kv_buffer=True, sliding_window_key="sliding_window"),
    "qwen2": ArchitectureSpec(family="qwen2", shared_kv_buffer=True, sliding_window_key="sliding_window"),
    "phi3": ArchitectureSpec(family="phi3", concat_reason="not measured with the shared buffer yet"),
    # The families below attend as llama does from the rotated Q/K on (per-head q/k norms, multipliers, layers
    # without rotary, partial rotary and biases all come before), so the shared buffer takes them; each is
    # checked against transformers' own generate past its window (tests/exporter/test_families.py).
    "qwen3": ArchitectureSpec(family="qwen3", shared_kv_buffer=True, sliding_window_key="sliding_window"),
    "olmo2": ArchitectureSpec(family="olmo2", shared_kv_buffer=True),
    "granite": ArchitectureSpec(family="granite", shared_kv_buffer=True),
    "smollm3": ArchitectureSpec(family="smollm3", shared_kv_buffer=True, sliding_window_key="sliding_window"),
    "gpt_neox": ArchitectureSpec(family="gpt_neox", kv_heads_key=None, shared_kv_buffer=True),
    "phi": ArchitectureSpec(family="phi", shared_kv_buffer=True),
    # Concat graphs: gemma2 soft-caps its attention logits, which GroupQueryAttention's softmax would not;
    # gemma3's rewritten graph failed validation (logits 0.72 off, with or without windows: its
    # query_pre_attn_scalar scale is the suspect, not yet confirmed).
    "gemma2": ArchitectureSpec(family="gemma2", sliding_window_key="sliding_window",
                               concat_reason="its attention logits are soft-capped, which GroupQueryAttention's "
                                             "softmax does not do"),
    "gemma3_text": ArchitectureSpec(family="gemma3_text", sliding_window_key="sliding_window",
                                    concat_reason="the shared-buffer rewrite does not validate on it yet"),
}


def supported_model_types() -> list[str]:
    """Return the config `model_type` values specdec can export, sorted."""
    return sorted(_ARCHITECTURES)


def architecture_for(model_type: str) -> ArchitectureSpec:
    """Return the spec for a config `model_type`, or raise ExportError naming the supported ones."""
    try:
        return _ARCHITECTURES[model_type]
    except KeyError:
        raise ExportError(
            f"unknown architecture '{model_type}': specdec supports "
            f"{', '.join(supported_model_types())}"
        ) from None
