"""What users would run instead, measured on the same prompts: Hugging Face transformers in PyTorch.

Needs the `export` extra (torch, transformers). onnxruntime-genai lives in its own venv
(see specdec/benchmarks/genai_anchor.py), since its builder needs transformers >= 5.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

# Idle seconds before each side's timed work when specdec and an anchor take turns: a call that
# starts within ~10 ms of the other process's runs ~9% slower (that process's onnxruntime threads
# still spin-wait on the two cores), 50 ms later it does not (docs/FAIR_ANCHORS.md, "Keeping the comparison fair");
# without the pause whoever went second paid, and paired ratios fell in two clusters.
SETTLE_SECONDS = 0.1


@dataclass
class AnchorRun:
    """One anchor generation."""

    system: str  # e.g. "transformers greedy"
    prompt_id: str
    token_ids: list[int]  # as the anchor returned them, even beyond max_new_tokens
    seconds: float  # wall time of generate(), prefill included
    max_new_tokens: int | None = None  # what was asked for (None: count every token)
    prefill_seconds: float | None = None  # the prompt's call (time to first token); None: not measured
    decode_seconds: float | None = None  # after the prefill to the last token; None: not measured
    prefill_samples: list[float] = field(default_factory=list)  # more prefills of the prompt, timed before this run

    @property
    def tokens_per_second(self) -> float:
        """Return new tokens per second over the whole call, counting at most max_new_tokens of them.

        transformers' prompt lookup can return a few tokens more than asked for (measured:
        132 for 128); those are not what the user asked for, so they do not raise its rate.
        """
        counted = len(self.token_ids) if self.max_new_tokens is None else min(len(self.token_ids),
                                                                               self.max_new_tokens)
        return counted / self.seconds if self.seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float | None:
        """Return tokens after the first over the time after the prefill, as specdec's decode tokens/s
        (at most max_new_tokens counted); None when the anchor did not time its phases."""
        if not self.decode_seconds:
            return None
        counted = len(self.token_ids) if self.max_new_tokens is None else min(len(self.token_ids),
                                                                               self.max_new_tokens)
        return (counted - 1) / self.decode_seconds


EQUAL, PAST_MAX_NEW_TOKENS, DIFFERS = "equal", "past max_new_tokens", "differs"


@dataclass(frozen=True)
class GreedyAgreement:
    """How an anchor's greedy tokens compare with specdec's target-only greedy tokens for one prompt."""

    kind: str  # EQUAL; PAST_MAX_NEW_TOKENS: equal over all the tokens asked for, then more; DIFFERS
    position: int | None = None  # DIFFERS: index of the first generated token that differs
    extra_tokens: int = 0  # PAST_MAX_NEW_TOKENS: how many tokens beyond max_new_tokens


def greedy_agreement(reference: Sequence[int], anchor: Sequence[int], max_new_tokens: int,
                     eos_token_ids: Sequence[int]) -> GreedyAgreement:
    """Return how `anchor` (an anchor's generated ids) agrees with `reference` (specdec's, same prompt).

    A final end-of-sequence token is left out on both sides: specdec returns it,
    onnxruntime-genai does not. Equal text is not enough (two token sequences can decode
    alike); one that stops early, or goes on after the reference ended, differs where the
    shorter one ends.
    """
    eos = set(eos_token_ids)
    reference, anchor = list(reference), list(anchor)
    for ids in (reference, anchor):
        if ids and ids[-1] in eos:
            ids.pop()
    if anchor == reference:
        return GreedyAgreement(EQUAL)
    if len(reference) == max_new_tokens and anchor[:max_new_tokens] == reference:
        return GreedyAgreement(PAST_MAX_NEW_TOKENS, extra_tokens=len(anchor) - max_new_tokens)
    position = next((i for i, (a, b) in enumerate(zip(reference, anchor)) if a != b),
                    min(len(reference), len(anchor)))
    return GreedyAgreement(DIFFERS, position=position)


def load_torch_model(source: str, threads: int | None = None):
    """Return a transformers model (fp32, eval) for a GGUF file or local folder; torch then runs on
    `threads` intra-op threads (None: every core, as specdec's sessions)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads or os.cpu_count() or 1)
    path = Path(source)
    if source.lower().endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype="float32")
    else:
        model = AutoModelForCausalLM.from_pretrained(source, dtype="float32")
    return model.eval()


def run_transformers(model, prompt_ids: dict[str, list[int]], max_new_tokens: int, eos_token_ids: Sequence[int],
                     prompt_lookup: int = 10, repeats: int = 1,
                     progress: Callable[[str], None] = lambda message: None) -> list[AnchorRun]:
    """Return greedy and prompt-lookup runs of transformers' generate() for every prompt (ids given)."""
    import torch

    runs = []
    first = next(iter(prompt_ids.values()))
    with torch.no_grad():  # warm-up: the first generate() pays one-time costs
        model.generate(torch.tensor([first]), do_sample=False, max_new_tokens=4, pad_token_id=eos_token_ids[0])
    modes = [("transformers greedy", {}), ("transformers prompt-lookup", {"prompt_lookup_num_tokens": prompt_lookup})]
    for repeat in range(repeats):
        for prompt_id, ids in prompt_ids.items():
            for system, extra in (modes if repeat % 2 == 0 else modes[::-1]):
                progress(f"repeat {repeat + 1}, {prompt_id}: {system}")
                inputs = torch.tensor([ids])
                start = time.perf_counter()
                with torch.no_grad():
                    output = model.generate(inputs, attention_mask=torch.ones_like(inputs), do_sample=False,
                                            max_new_tokens=max_new_tokens, eos_token_id=list(eos_token_ids),
                                            pad_token_id=eos_token_ids[0], **extra)
                seconds = time.perf_counter() - start
                runs.append(AnchorRun(system, prompt_id, output[0, len(ids):].tolist(), seconds, max_new_tokens))
    return runs
