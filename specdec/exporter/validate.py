"""Numerical validation of an exported graph against the PyTorch model it came from."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specdec.models.manifest import GraphSpec
from specdec.runtime.session import ModelSession

VALIDATION_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Speculative decoding lets a small model",
)
# Max |logit difference| allowed, by weights dtype: fp32 graphs should match to rounding;
# quantized weights move logits by design, so they are held to a looser bound and judged
# mostly on greedy agreement (figures measured on SmolLM2-135M, see the README).
DEFAULT_ATOL = {"fp32": 1e-2, "fp16": 1e-1, "int8": 4.0, "int4": 4.0}
# Share of greedy continuation tokens that must equal PyTorch's (1.0: all, near-ties excepted).
MIN_GREEDY_AGREEMENT = {"fp32": 1.0, "fp16": 1.0, "int8": 0.75, "int4": 0.6}


@dataclass(frozen=True)
class ValidationReport:
    """Figures from comparing the ONNX graph with PyTorch."""

    prompts: int
    max_logit_diff_prefill: float  # whole prompt in one call (the verify path)
    max_logit_diff_step: float  # one token at a time on the cache (the decode path)
    greedy_tokens: int  # continuation tokens compared
    greedy_agreement: float  # share of continuation tokens where ONNX argmax == PyTorch argmax
    greedy_mismatches_outside_ties: int  # mismatches where PyTorch's top-2 gap exceeds atol
    atol: float
    min_agreement: float  # 1.0: every token outside near-ties must agree
    passed: bool
    # the whole prompt through the long-call attention kernel (a graph with long_call_name), in the prefill bound
    max_logit_diff_long_call: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """Return the report as a JSON-ready dict."""
        return asdict(self)


def validate_graph(artifact_dir: Path, spec: GraphSpec, torch_model: Any, tokenizer: Any,
                   atol: float, continuation: int = 8, min_agreement: float = 1.0) -> ValidationReport:
    """Return how closely the exported graph matches PyTorch on a few prompts.

    For each prompt: logits of the whole prompt in one call (all rows, and the last row
    alone as the runtime's prefill asks for it), then `continuation` greedy
    steps one token at a time through the runtime's own session and KV cache, each step's
    logits compared with PyTorch's over the same tokens.
    """
    import torch

    session = ModelSession(artifact_dir, spec, provider="cpu")
    prefill_diff = step_diff = 0.0
    long_diff: float | None = None
    agree = total = outside_ties = 0
    for prompt in VALIDATION_PROMPTS:
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"][:32] or [0]
        cache = session.new_cache()
        onnx_logits = session.forward(cache, ids)
        with torch.no_grad():
            torch_logits = torch_model(torch.tensor([ids])).logits[0].float().numpy()
        vocab = onnx_logits.shape[-1]
        prefill_diff = max(prefill_diff, float(np.abs(onnx_logits - torch_logits[:, :vocab]).max()))
        # The runtime's prefill asks for the last row only, which takes the graph's trimmed path.
        last_row = session.forward(session.new_cache(), ids, logits_rows=1)[-1]
        prefill_diff = max(prefill_diff, float(np.abs(last_row - torch_logits[-1, :vocab]).max()))
        if spec.long_call_name:
            # the validation prompts are short: make their prefill take that kernel, then put the session back
            usual_rows, session.long_call_rows = session.long_call_rows, 0
            long_rows = session.forward(session.new_cache(), ids)
            session.long_call_rows = usual_rows
            long_diff = max(long_diff or 0.0, float(np.abs(long_rows - torch_logits[:, :vocab]).max()))
            prefill_diff = max(prefill_diff, long_diff)
        tokens = list(ids)
        for step in range(continuation):
            if len(tokens) >= spec.max_positions:
                break
            with torch.no_grad():
                reference = torch_model(torch.tensor([tokens])).logits[0, -1].float().numpy()[:vocab]
            onnx_row = onnx_logits[-1]
            step_diff = max(step_diff, float(np.abs(onnx_row - reference).max()))
            ref_token, onnx_token = int(np.argmax(reference)), int(np.argmax(onnx_row))
            total += 1
            if ref_token == onnx_token:
                agree += 1
            else:
                top2 = np.sort(reference)[-2:]
                if top2[1] - top2[0] > atol:
                    outside_ties += 1
            # Follow PyTorch's choice so both sides keep seeing the same tokens.
            tokens.append(ref_token)
            if step + 1 < continuation:
                onnx_logits = session.forward(cache, [ref_token])
    agreement = agree / max(total, 1)
    greedy_ok = outside_ties == 0 if min_agreement >= 1.0 else agreement >= min_agreement
    passed = prefill_diff <= atol and step_diff <= atol and greedy_ok
    return ValidationReport(
        prompts=len(VALIDATION_PROMPTS),
        max_logit_diff_prefill=prefill_diff,
        max_logit_diff_step=step_diff,
        greedy_tokens=total,
        greedy_agreement=agreement,
        greedy_mismatches_outside_ties=outside_ties,
        atol=atol,
        min_agreement=min_agreement,
        passed=passed,
        max_logit_diff_long_call=long_diff,
    )


def steps_and_call(session: ModelSession, prompt: list[int], steps: int = 8,
                   capacity: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Return ([steps, vocab] logits of greedy 1-token steps after `prompt`, the same tokens' rows from one call).

    The first is the target-only path, the second the verify path, each on a fresh cache of
    `capacity` positions (None: the default; it grows as needed).
    """
    cache = session.new_cache(capacity)
    row = session.forward(cache, prompt, logits_rows=1)[-1]
    tokens, step_rows = [], []
    for _ in range(steps):
        tokens.append(int(np.argmax(row)))
        row = session.forward(cache, [tokens[-1]], logits_rows=1)[-1]
        step_rows.append(row)
    cache = session.new_cache(capacity)
    session.forward(cache, prompt, logits_rows=1)
    return np.array(step_rows), session.forward(cache, tokens)


def step_call_difference(session: ModelSession, prompts: list[list[int]], steps: int = 8) -> float:
    """Return the max |logit difference| between 1-token steps and the same tokens scored in one call.

    Per prompt: `steps_and_call`. Speculative greedy output equals target-only output to the
    bit only where this is 0: a graph with `attention_pad_rows` must give 0; others report how
    far the two paths drift (fp32 SmolLM2: ~4e-5).
    """
    worst = 0.0
    for ids in prompts:
        ids = ids[: max(1, min(len(ids), session.spec.max_positions - steps - 1))]
        step_rows, call_rows = steps_and_call(session, ids, steps)
        worst = max(worst, float(np.abs(call_rows - step_rows).max()))
    return worst


def ragged_rows_difference(session: ModelSession, prompts: list[list[int]], hidden: bool = False) -> float:
    """Return the max |logit difference| between one call of the ragged-rows graph and the same rows scored
    by batch-1 calls of the plain graph (0 is what the batch engine's exactness rests on); with `hidden`, the
    hidden rows a draft head reads count too.

    Row r of the graph gets a prompt (cycling through `prompts`) prefilled into its own KV slot, then
    1 + r % 5 new tokens in the one ragged call, but for the last row, which takes none (a free slot's row);
    each row's caches are rolled back and the same tokens scored alone.
    """
    from specdec.runtime.slots import SlotArena

    rows = session.spec.ragged_rows
    capacity = max(len(ids) for ids in prompts) + 16
    arena = SlotArena(session, rows, capacity)
    caches = [arena.take() for _ in range(rows)]
    for row, cache in enumerate(caches):
        session.forward(cache, prompts[row % len(prompts)], logits_rows=1)
    lengths = [cache.length for cache in caches]
    vocab = session.spec.vocab_size
    new = [[(31 * row + 7 * j + 1) % vocab for j in range(1 + row % 5)] for row in range(rows - 1)] + [[]]
    together = session.forward_ragged(arena.ragged_binding(), caches[:-1] + [None], new, lengths, hidden=hidden)
    logits, states = together if hidden else (together, None)
    worst = 0.0
    for row, cache in enumerate(caches[:-1]):
        cache.rollback(lengths[row])
        alone = session.forward(cache, new[row], logits_rows=len(new[row]), hidden=hidden)
        if hidden:
            alone, alone_states = alone
            worst = max(worst, float(np.abs(alone_states - states[row]).max()))
        worst = max(worst, float(np.abs(alone - logits[row]).max()))
    return worst


def greedy_head_check(session: ModelSession, prompts: list[list[int]]) -> dict[str, Any]:
    """Return how the artifact's 8-bit greedy head did on every position of `prompts`, against the fp32 head.

    Keys: positions, argmax_equal (every position's argmax the fp32 head's), bound_holds (every
    token's fp32 logit within its bound of the 8-bit one), max_error_over_bound, candidates_median,
    candidates_max. A head for which either is False must not ship.
    """
    from specdec.runtime.greedy_head import MAX_ROWS, argmax_candidates, logit_bounds

    head = session.greedy_head
    if head is None:
        raise ValueError("the graph has no greedy head")
    positions = 0
    argmax_equal = True
    worst = 0.0
    counts: list[int] = []
    vocab = session.vocab_limit
    for ids in prompts:
        ids = ids[: session.spec.max_positions]
        full_cache, greedy_cache = session.new_cache(), session.new_cache()
        # In calls of at most MAX_ROWS tokens: longer greedy calls read the fp32 head.
        for start in range(0, len(ids), MAX_ROWS):
            chunk = ids[start:start + MAX_ROWS]
            full = session.forward(full_cache, chunk)
            greedy = session.forward(greedy_cache, chunk, greedy=True)
            argmax_equal &= bool((np.argmax(full, axis=-1) == np.argmax(greedy, axis=-1)).all())
            hidden, approx = greedy_cache.last_greedy_rows  # of the greedy call above: the heads' input and 8-bit logits
            approx = approx.astype(np.float64)
            bounds = logit_bounds(hidden, head.weight_norms[:vocab], head.weight_errors[:vocab])
            worst = max(worst, float((np.abs(full.astype(np.float64) - approx) / bounds).max()))
            counts.extend(len(argmax_candidates(a, b)) for a, b in zip(approx, bounds))
        positions += len(ids)
    return {"positions": positions, "argmax_equal": argmax_equal, "bound_holds": worst <= 1.0,
            "max_error_over_bound": worst, "candidates_median": float(np.median(counts)),
            "candidates_max": int(max(counts))}
