"""Training data for the draft head: the target's own answers, and its features over them.

Two costs, measured in the issue: the target decoding answers (batched `generate`) is
the expensive part; one teacher-forced pass over prompt + answer to read every
position's LM-head input is several times cheaper per token, and cheaper still is
keeping what decoding computed anyway (FeatureRecorder), which training answers do.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch


@dataclass
class Example:
    """One conversation the head trains on."""

    ids: np.ndarray  # [L] int64: prompt (chat template) + answer
    features: np.ndarray  # [L, hidden] float16: the target's LM-head input at every position
    greedy_next: np.ndarray  # [L] int64: the target's argmax after each position (acceptance is judged on it)
    answer_start: int  # first answer position
    sampled: bool  # the answer was sampled (temperature 0.7), not greedy
    # [L, n * hidden] float16: the normed inputs of the target's layers in DraftConfig.extra_layers (EAGLE-3's
    # low and middle features beside the last one); None when the head reads only the last feature.
    layer_features: np.ndarray | None = None


def chat_ids(tokenizer, prompt: str) -> list[int]:
    """Return the token ids of a one-turn chat prompt, as the runtime's `--chat` builds it."""
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt)["input_ids"]


class FeatureRecorder:
    """Forward hooks that keep, call by call, what the tapped target graph outputs while `generate` decodes.

    Per call: the LM head's input (the base model's last_hidden_state), the normed inputs of
    `layers` (as layer_inputs reads them) and the argmax of the call's last logits row. A
    left-padded batch's prefill is one call of the whole width; each decode step one call of
    one position. Use as a context manager: the hooks go when it exits.
    """

    def __init__(self, model, layers: tuple[int, ...] = ()):
        self.model, self.layers = model, tuple(layers)
        self.last: list[torch.Tensor] = []
        self.lower: dict[int, list[torch.Tensor]] = {layer: [] for layer in self.layers}
        self.argmax: list[torch.Tensor] = []
        self._handles = []

    def __enter__(self) -> "FeatureRecorder":
        base = base_model(self.model)
        self._handles.append(base.register_forward_hook(
            lambda module, args, out: self.last.append(out.last_hidden_state)))
        for layer in self.layers:
            self._handles.append(base.layers[layer].input_layernorm.register_forward_hook(
                lambda module, args, out, keep=self.lower[layer]: keep.append(out)))
        self._handles.append(self.model.get_output_embeddings().register_forward_hook(
            lambda module, args, out: self.argmax.append(out[:, -1].argmax(-1))))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def examples(self, batch: list[list[int]], answers: list[list[int]], sampled: bool) -> list[Example]:
        """Return an Example per (prompt ids, answer ids) of the one left-padded `generate` call recorded.

        The last token of the longest answers was never fed back, so it has no feature: those
        answers lose it (an EOS there predicts nothing the head needs).
        """
        width = max(len(ids) for ids in batch)
        last = torch.cat(self.last, dim=1)  # [B, width + calls - 1, H]
        lower = (torch.cat([torch.cat(self.lower[layer], dim=1) for layer in self.layers], dim=-1)
                 if self.layers else None)
        chosen = torch.stack(self.argmax, dim=1)  # [B, calls]: after the last prompt token, then after each answer token
        fed = last.shape[1] - width  # answer tokens fed back
        head = self.model.get_output_embeddings()
        examples = []
        with torch.no_grad():
            for row, (prompt, answer) in enumerate(zip(batch, answers)):
                keep = min(len(answer), fed)
                start = width - len(prompt)
                length = len(prompt) + keep
                features = last[row, start:start + length]
                prompt_choices = head(features[: len(prompt) - 1]).argmax(-1)  # the prefill kept one logits row
                greedy = torch.cat([prompt_choices, chosen[row, : keep + 1]])
                examples.append(Example(
                    ids=np.asarray(prompt + answer[:keep], np.int64),
                    features=features.float().cpu().numpy().astype(np.float16),
                    greedy_next=greedy.cpu().numpy().astype(np.int64), answer_start=len(prompt), sampled=sampled,
                    layer_features=None if lower is None else
                    lower[row, start:start + length].float().cpu().numpy().astype(np.float16)))
        return examples


class InverseCdfSampler:
    """A transformers logits processor that draws each row's next token from softmax(logits / temperature) by
    inverse-CDF sampling and leaves only that token standing, so that greedy selection takes it.

    The same distribution as `generate(do_sample=True)` at that temperature (top-k/top-p off);
    torch.multinomial over a [128, 49152] batch took ~225 ms a step on a 2-core CPU, this ~30.
    """

    def __init__(self, temperature: float, seed: int, device):
        self.temperature = temperature
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        cdf = torch.softmax(scores.float() / self.temperature, dim=-1).cumsum(-1)
        u = torch.rand(scores.shape[0], 1, generator=self.generator, device=scores.device) * cdf[:, -1:]
        # right=True: the first id whose cdf passes u, so an id of probability 0 (an empty interval) is never drawn.
        token = torch.searchsorted(cdf, u, right=True).clamp_(max=scores.shape[-1] - 1)
        return torch.full_like(scores, float("-inf")).scatter_(1, token, 0.0)


def _decode(model, batch: list[list[int]], eos_ids: list[int], pad: int, max_new_tokens: int, temperature: float,
            seed: int) -> list[list[int]]:
    """Return each row's continuation (left-padded batch, one `generate` call), ending at its first EOS (kept).

    temperature 0: greedy; else sampled at that temperature (top-k/top-p off; InverseCdfSampler).
    """
    from transformers import LogitsProcessorList

    device = next(model.parameters()).device
    width = max(len(ids) for ids in batch)
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in batch], device=device)
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch], device=device)
    sampler = LogitsProcessorList([InverseCdfSampler(temperature, seed, device)] if temperature > 0 else [])
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             do_sample=False, logits_processor=sampler, eos_token_id=eos_ids, pad_token_id=pad)
    rows = []
    for row in out[:, width:].tolist():
        continuation = []
        for token in row:
            continuation.append(token)
            if token in eos_ids:
                break
        rows.append(continuation)
    return rows


def _pad_id(tokenizer, eos_ids: list[int]) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]


def generate_answers(model, tokenizer, prompts: list[str], eos_ids: list[int], max_new_tokens: int,
                     temperature: float, batch_size: int, seed: int, deadline: float | None = None,
                     progress: Callable[[int, int], None] | None = None) -> list[tuple[list[int], list[int]]]:
    """Return [(prompt ids, answer ids)] for each prompt answered before `deadline` (time.monotonic()).

    temperature 0: greedy; else sampled (top-k/top-p off). Answers end at the first EOS (kept).
    """
    pad = _pad_id(tokenizer, eos_ids)
    results = []
    for first in range(0, len(prompts), batch_size):
        if deadline is not None and time.monotonic() > deadline:
            break
        batch = [chat_ids(tokenizer, p) for p in prompts[first:first + batch_size]]
        answers = _decode(model, batch, eos_ids, pad, max_new_tokens, temperature, seed + first)
        results += list(zip(batch, answers))
        if progress:
            progress(len(results), sum(len(a) for _, a in results))
    return results


def decode_examples(model, tokenizer, prompts: list[str], eos_ids: list[int], max_new_tokens: int,
                    temperature: float, seed: int, layers: tuple[int, ...] = ()) -> list[Example]:
    """Return an Example per prompt, answered in one left-padded `generate` call whose own forward passes supply
    the features (FeatureRecorder): no teacher-forced pass. temperature 0: greedy; else sampled."""
    batch = [chat_ids(tokenizer, p) for p in prompts]
    with FeatureRecorder(model, layers) as recorder:
        answers = _decode(model, batch, eos_ids, _pad_id(tokenizer, eos_ids), max_new_tokens, temperature, seed)
    return recorder.examples(batch, answers, sampled=temperature > 0)


_SENTINEL = "\u2063specdec-user-turn\u2063"


def user_turn_prefix(tokenizer) -> list[int]:
    """Return the token ids that open a user turn in the target's chat format (system prompt included).

    Without a chat template: "Question: ", the plainest frame a base model continues with a request.
    """
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False)
        return tokenizer(text.split(_SENTINEL)[0], add_special_tokens=False)["input_ids"]
    return tokenizer("Question: ")["input_ids"]


def write_user_turns(model, tokenizer, count: int, eos_ids: list[int], seed: int, max_new_tokens: int = 64,
                     temperature: float = 1.0) -> list[str]:
    """Return `count` user requests the target writes itself: sampled continuations of a user turn's opening.

    An instruct model asked for nothing writes what its users ask: tasks and topics no template list
    has (Magpie-style self-instruct). Unfiltered ("" for a turn that did not end within
    max_new_tokens): prompts.keep_user_turns picks the usable ones.
    """
    prefix = user_turn_prefix(tokenizer)
    rows = _decode(model, [prefix] * count, eos_ids, _pad_id(tokenizer, eos_ids), max_new_tokens, temperature, seed)
    # A turn cut off by max_new_tokens is no request: "" (keep_user_turns drops it).
    return [tokenizer.decode(row[:-1], skip_special_tokens=True) if row and row[-1] in eos_ids else "" for row in rows]


def generator_dtype(requested: str, device: str) -> torch.dtype:
    """Return the dtype the target decodes its training answers in: bfloat16 or float32.

    "auto": bfloat16 on CUDA and on CPUs with native bf16 matmuls (AVX512-BF16/AMX), where
    it decodes about 2x and teacher-forces 2-4x faster than fp32 (docs/DISTILL.md).
    """
    if requested != "auto":
        return {"bfloat16": torch.bfloat16, "float32": torch.float32}[requested]
    if device.startswith("cuda"):
        return torch.bfloat16
    supported = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    return torch.bfloat16 if supported() else torch.float32


GROUPED_ATTENTION = "specdec_grouped_sdpa"


def _grouped_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers attention function: a 1-token decode step attends with each KV head's query group as rows.

    transformers' sdpa repeats every KV head for its query heads whenever a mask is given (it
    is at batch > 1 with padding), copying the whole cache each step; on CPU that was ~60% of
    batched decoding. Other calls (prefill, teacher forcing) go to transformers' sdpa.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if query.shape[2] != 1 or groups == 1 or dropout:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    batch, heads, _, dim = query.shape
    if attention_mask is not None and attention_mask.ndim == 4:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    # Query head i reads KV head i // groups (transformers' repeat_kv order), so [B, kv, groups, D] lines them up.
    out = torch.nn.functional.scaled_dot_product_attention(query.reshape(batch, key.shape[1], groups, dim), key,
                                                           value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None


def use_grouped_attention(model) -> None:
    """Switch a transformers model to _grouped_sdpa for its decode steps (same results; registered once)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GROUPED_ATTENTION, _grouped_sdpa)
    AttentionMaskInterface.register(GROUPED_ATTENTION, sdpa_mask)
    model.config._attn_implementation = GROUPED_ATTENTION


def base_model(model):
    """Return the transformer under the LM head: its last_hidden_state is the LM head's input (after the final norm)."""
    return getattr(model, model.base_model_prefix)


def layer_inputs(model, hidden_states: tuple, layers: tuple[int, ...]) -> torch.Tensor | None:
    """Return the normed inputs of the target's decoder `layers` concatenated [B, T, n * hidden] (None for none).

    hidden_states: the model's output_hidden_states (entry i is the residual stream entering layer i);
    each is passed through layer i's own input norm, the tensor its attention projections read.
    """
    if not layers:
        return None
    blocks = base_model(model).layers
    return torch.cat([blocks[i].input_layernorm(hidden_states[i]) for i in layers], dim=-1)


def target_features(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                    layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return what the tapped target graph outputs, from one PyTorch pass: (the LM head's input [B, T, H],
    the normed inputs of `layers` [B, T, n * H] or None)."""
    out = base_model(model)(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=bool(layers))
    return out.last_hidden_state, layer_inputs(model, out.hidden_states, layers)


def features_of(model, conversations: list[tuple[list[int], list[int]]], sampled: bool,
                batch_size: int = 8, layers: tuple[int, ...] = ()) -> list[Example]:
    """Return an Example per (prompt ids, answer ids): one teacher-forced pass of the target over each.

    layers: decoder layers whose normed inputs are kept as Example.layer_features.
    """
    device = next(model.parameters()).device
    head = model.get_output_embeddings()
    examples = []
    for first in range(0, len(conversations), batch_size):
        chunk = conversations[first:first + batch_size]
        seqs = [p + a for p, a in chunk]
        width = max(len(s) for s in seqs)
        ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs], device=device)
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], device=device)
        with torch.no_grad():
            hidden, extra = target_features(model, ids, mask, layers)
            greedy = head(hidden).argmax(-1)
        for row, (prompt, answer) in enumerate(chunk):
            length = len(prompt) + len(answer)
            examples.append(Example(
                ids=np.asarray(seqs[row], np.int64), features=hidden[row, :length].float().cpu().numpy().astype(np.float16),
                greedy_next=greedy[row, :length].cpu().numpy().astype(np.int64), answer_start=len(prompt),
                sampled=sampled,
                layer_features=None if extra is None else extra[row, :length].float().cpu().numpy().astype(np.float16)))
    return examples


def frequent_tokens(examples: list[Example], size: int, vocab: int, always: list[int]) -> np.ndarray:
    """Return the `size` ids the target emits most often in `examples` (answers and greedy choices), plus `always`.

    FR-Spec's subset: the draft only proposes these, so its LM head shrinks from vocab rows
    to `size`; ties and unused slots are filled by id order, so the result is deterministic.
    """
    counts = np.zeros(vocab, np.int64)
    for ex in examples:
        np.add.at(counts, ex.ids[ex.answer_start:], 1)
        np.add.at(counts, ex.greedy_next, 1)
    counts[np.asarray(always, np.int64)] = counts.max() + 1
    size = min(size, vocab)
    order = np.lexsort((np.arange(vocab), -counts))  # most frequent first, then lowest id
    return np.sort(order[:size])


def save_examples(path, examples: list[Example]) -> None:
    """Write examples to one .npz file."""
    extra = {} if examples[0].layer_features is None else {
        "layer_features": np.concatenate([e.layer_features for e in examples])}
    np.savez(path, lengths=np.array([len(e.ids) for e in examples]), ids=np.concatenate([e.ids for e in examples]),
             features=np.concatenate([e.features for e in examples]), **extra,
             greedy_next=np.concatenate([e.greedy_next for e in examples]),
             answer_start=np.array([e.answer_start for e in examples]),
             sampled=np.array([e.sampled for e in examples]))


def load_examples(path) -> list[Example]:
    """Return the examples written by save_examples."""
    data = np.load(path)
    # Each data[key] reads the whole array again: read once, or every example's slice keeps its own copy alive.
    ids, features, greedy = data["ids"], data["features"], data["greedy_next"]
    layers = data["layer_features"] if "layer_features" in data.files else None
    bounds = np.concatenate([[0], np.cumsum(data["lengths"])])
    return [Example(ids[a:b], features[a:b], greedy[a:b], int(s), bool(m), None if layers is None else layers[a:b])
            for a, b, s, m in zip(bounds[:-1], bounds[1:], data["answer_start"], data["sampled"])]
