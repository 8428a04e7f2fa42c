"""The draft head (PyTorch): one decoder layer over the target's features, EAGLE-style.

Pair j = (f_j, t_{j+1}): the target's LM-head input at position j and the token that
followed. fc([f_j ; embed(t_{j+1})]) -> one llama-style decoder layer (its own KV cache)
-> a norm -> f^_{j+1}, the draft's guess of the target's next feature; the LM head over a
vocabulary subset (FR-Spec: the target's most frequent output tokens) turns it into
logits. The next draft step feeds f^_{j+1} back with the drafted token.

Initialised so that it starts as a useful draft: the layer and final norm copied from the
target's last layer (llama-like targets), fc passing the feature through, the copied
layer's output projections scaled by 0.1 (measured in the issue's probe: without the
input norm and this init it did not learn).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class DraftConfig:
    """Sizes of the draft head, read from the target's config."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    norm_eps: float
    vocab_size: int  # the target's full vocabulary (input ids range)
    subset_size: int  # ids the draft can propose
    # Target layers whose normed inputs are fused into the target-fed feature (EAGLE-3's low/middle taps).
    extra_layers: tuple[int, ...] = ()

    def as_dict(self) -> dict:
        """Return the config as a JSON-ready dict."""
        return asdict(self)


def draft_config_for(target_config, subset_size: int, vocab_size: int,
                     extra_layers: tuple[int, ...] = ()) -> DraftConfig:
    """Return a DraftConfig matching the target's attention shapes (any HF causal LM config)."""
    get = lambda *keys, default=None: next((getattr(target_config, k) for k in keys  # noqa: E731
                                            if getattr(target_config, k, None) is not None), default)
    hidden = int(get("hidden_size", "n_embd"))
    heads = int(get("num_attention_heads", "n_head"))
    kv_heads = int(get("num_key_value_heads", default=heads))
    head_dim = int(get("head_dim", default=hidden // heads))
    return DraftConfig(
        hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate_size=int(get("intermediate_size", "n_inner", default=4 * hidden) or 4 * hidden),
        rope_theta=float(get("rope_theta", default=10000.0)),
        norm_eps=float(get("rms_norm_eps", "layer_norm_epsilon", default=1e-6)),
        vocab_size=vocab_size, subset_size=subset_size, extra_layers=tuple(extra_layers),
    )


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DraftHead(nn.Module):
    """forward(hidden, input_ids, position_ids, past_key, past_value) -> (logits, feature, present_key, present_value).

    hidden [B, T, feature_width]: the target's feature, then the normed inputs of
    config.extra_layers (a drafted feature comes with zeros there); input_ids [B, T] the next tokens;
    position_ids [B, T]; past_key/past_value [B, kv_heads, P, head_dim]. Returns logits
    [B, T, subset], feature [B, T, H], and the presents [B, kv_heads, P + T, head_dim].
    Attention is causal over past + new (right padding in training needs no mask).
    """

    def __init__(self, config: DraftConfig, subset_ids: torch.Tensor):
        super().__init__()
        c = self.config = config
        # full vocabulary id -> row of the subset embedding; ids outside the subset read the last row.
        index = torch.full((c.vocab_size,), c.subset_size, dtype=torch.long)
        index[subset_ids] = torch.arange(c.subset_size)
        self.register_buffer("subset_index", index)
        self.register_buffer("subset_ids", subset_ids.clone().long())
        self.embed = nn.Embedding(c.subset_size + 1, c.hidden_size)
        self.fc = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        # feature + fuse(extra): zero-initialised, so the head starts as the last-feature-only one; the
        # head's own features are fed with extra = 0 (no bias), so they pass unchanged.
        self.fuse = nn.Linear(len(c.extra_layers) * c.hidden_size, c.hidden_size, bias=False) \
            if c.extra_layers else None
        self.input_norm = RMSNorm(c.hidden_size, c.norm_eps)
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.post_norm = RMSNorm(c.hidden_size, c.norm_eps)
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        self.final_norm = RMSNorm(c.hidden_size, c.norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.subset_size, bias=False)
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim))
        self.register_buffer("inv_freq", inv)

    def init_from_target(self, target) -> None:
        """Copy what fits from the target: embeddings and LM head rows, and for llama-like targets
        the last layer and the final norm; fc starts as the pass-through of the feature."""
        c = self.config
        with torch.no_grad():
            embed = target.get_input_embeddings().weight
            self.embed.weight[: c.subset_size] = embed[self.subset_ids]
            self.embed.weight[c.subset_size] = embed.mean(0)
            self.lm_head.weight.copy_(target.get_output_embeddings().weight[self.subset_ids])
            if self.fuse is not None:
                self.fuse.weight.zero_()
            self.fc.weight.zero_()
            self.fc.weight[:, : c.hidden_size] = torch.eye(c.hidden_size)
            self.fc.weight[:, c.hidden_size:] = torch.eye(c.hidden_size)
            layers = getattr(getattr(target, "model", None), "layers", None)
            if layers is not None and hasattr(layers[-1], "self_attn") and hasattr(layers[-1].self_attn, "q_proj"):
                last = layers[-1]
                for mine, theirs in ((self.q_proj, last.self_attn.q_proj), (self.k_proj, last.self_attn.k_proj),
                                     (self.v_proj, last.self_attn.v_proj), (self.o_proj, last.self_attn.o_proj),
                                     (self.gate_proj, last.mlp.gate_proj), (self.up_proj, last.mlp.up_proj),
                                     (self.down_proj, last.mlp.down_proj)):
                    if mine.weight.shape == theirs.weight.shape:
                        mine.weight.copy_(theirs.weight)
                self.input_norm.weight.copy_(last.input_layernorm.weight)
                self.post_norm.weight.copy_(last.post_attention_layernorm.weight)
                self.final_norm.weight.copy_(target.model.norm.weight)
            self.o_proj.weight.mul_(0.1)
            self.down_proj.weight.mul_(0.1)
        self.embed.weight.requires_grad_(False)  # the target's own token geometry; 1 row learns nothing useful
        self.lm_head.weight.requires_grad_(False)  # keeps the draft's output in the target's space

    @property
    def feature_width(self) -> int:
        """Return the width of the `hidden` input: the last feature, then the extra layers' normed inputs."""
        return self.config.hidden_size * (1 + len(self.config.extra_layers))

    def forward(self, hidden, input_ids, position_ids, past_key, past_value, last_logits_only: bool = False):
        """Return (logits over the subset, features, present key, present value) for the pairs fed.

        last_logits_only: logits for the last pair only (what a draft call reads); training scores every pair.
        """
        residual, q, k, v = self.project(hidden, input_ids, position_ids)
        attended, key, value = self.attend(q, k, v, past_key, past_value)
        feature = self.finish(residual, attended)
        return self.lm_head(feature[:, -1:] if last_logits_only else feature), feature, key, value

    def project(self, hidden, input_ids, position_ids):
        """Return (the residual [B, T, H], q [B, heads, T, d], k and v [B, kv_heads, T, d]) of the pairs fed,
        rotary positions applied: every pair on its own, so a ragged call runs it once over all rows' pairs."""
        c = self.config
        batch, new = input_ids.shape
        if self.fuse is not None:
            hidden = hidden[..., : c.hidden_size] + self.fuse(hidden[..., c.hidden_size:])
        x = self.fc(torch.cat([hidden, self.embed(self.subset_index[input_ids])], dim=-1))
        h = self.input_norm(x)
        q = self.q_proj(h).view(batch, new, c.num_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(batch, new, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(batch, new, c.num_kv_heads, c.head_dim).transpose(1, 2)
        angles = position_ids[:, None, :, None].float() * self.inv_freq  # [B, 1, T, d/2]
        cos = torch.cat([angles.cos(), angles.cos()], dim=-1)
        sin = torch.cat([angles.sin(), angles.sin()], dim=-1)
        return x, q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

    def attend(self, q, k, v, past_key, past_value):
        """Return (attention output [B, T, heads * d], present key, present value): causal over past + new."""
        c = self.config
        batch, new = q.shape[0], q.shape[2]
        key = torch.cat([past_key, k], dim=2)
        value = torch.cat([past_value, v], dim=2)
        groups = c.num_heads // c.num_kv_heads
        key_all = key.repeat_interleave(groups, dim=1)
        value_all = value.repeat_interleave(groups, dim=1)
        past = key.shape[2] - new
        scores = torch.matmul(q, key_all.transpose(-1, -2)) / math.sqrt(c.head_dim)  # [B, heads, T, P+T]
        query_pos = torch.arange(new, device=q.device)[:, None] + past
        key_pos = torch.arange(key.shape[2], device=q.device)[None, :]
        scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
        attn = torch.matmul(torch.softmax(scores, dim=-1), value_all)
        return attn.transpose(1, 2).reshape(batch, new, c.num_heads * c.head_dim), key, value

    def finish(self, residual, attended):
        """Return the features [B, T, H]: output projection, MLP and final norm, every pair on its own."""
        x = residual + self.o_proj(attended)
        h = self.post_norm(x)
        x = x + self.down_proj(nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))
        return self.final_norm(x)


class _DraftCall(nn.Module):
    """The head as the runtime calls it: a call that catches up on n committed pairs needs one row of logits,
    and the LM head over 8,192 ids is most of the head's arithmetic."""

    def __init__(self, head: DraftHead):
        super().__init__()
        self.head = head

    def forward(self, hidden, input_ids, position_ids, past_key, past_value):
        return self.head(hidden, input_ids, position_ids, past_key, past_value, last_logits_only=True)


INPUT_NAMES = ["hidden", "input_ids", "position_ids", "past_key", "past_value"]
OUTPUT_NAMES = ["logits", "feature", "present_key", "present_value"]


def export_draft_onnx(model: DraftHead, path, opset: int = 17) -> None:
    """Write the draft head as an ONNX graph (inputs INPUT_NAMES, outputs OUTPUT_NAMES) at `path`.

    Its logits are the last pair's only ([1, 1, subset]); features and the present cache cover every pair.
    """
    c = model.config
    model = model.eval().to("cpu")
    example = (torch.zeros(1, 2, model.feature_width), torch.zeros(1, 2, dtype=torch.long),
               torch.tensor([[3, 4]]), torch.zeros(1, c.num_kv_heads, 3, c.head_dim),
               torch.zeros(1, c.num_kv_heads, 3, c.head_dim))
    axes = {"hidden": {1: "new"}, "input_ids": {1: "new"}, "position_ids": {1: "new"},
            "past_key": {2: "past"}, "past_value": {2: "past"}, "feature": {1: "new"},
            "present_key": {2: "total"}, "present_value": {2: "total"}}
    with torch.no_grad():
        torch.onnx.export(_DraftCall(model), example, str(path), input_names=INPUT_NAMES, output_names=OUTPUT_NAMES,
                          dynamic_axes=axes, opset_version=opset, dynamo=False)
