"""Validation of a weight-quantized graph: teacher-forced agreement with the float model's greedy choices.

An int4 graph is a different model: its logits move by several units (SmolLM2-135M: max
|diff| ~15), so the fp32 logit bound cannot judge it. What matters for a quantized target
or draft is how often it picks what the float model picks. The float model (PyTorch)
writes greedy answers to a few chat prompts; the quantized graph reads each prompt and
answer in ONE call, and at every answer position its argmax is compared with the float
model's token. A correct int4 build agrees at 70-75% of positions on SmolLM2
(onnxruntime-genai's int4 build: 72.5%); a wrong scale or a skipped layer falls far below
the floor (docs/INT4.md has the figures).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from specdec.models.manifest import GraphSpec
from specdec.runtime.session import ModelSession

AGREEMENT_PROMPTS = (
    "What are three good habits for staying healthy?",
    "Explain how a bicycle works.",
    "Write a short poem about the sea.",
    "What is the difference between weather and climate?",
    "Give me some tips for learning a new language.",
)
ANSWER_TOKENS = 96  # greedy answer tokens per prompt
# Share of answer positions where the quantized graph's argmax must equal the float model's.
# int4: genai's own int4 build reads 0.725 pooled (0.64-0.80 per prompt) on SmolLM2, so 0.6 passes it.
AGREEMENT_FLOOR = {"int8": 0.85, "int4": 0.6}


@dataclass(frozen=True)
class AgreementReport:
    """Teacher-forced greedy agreement of a quantized graph with the float model it came from."""

    prompts: int
    tokens: int  # answer positions compared
    agreement: float  # share of them where the graph's argmax equals the float model's token
    per_prompt: list[list[int]] = field(default_factory=list)  # [agreed, compared] per prompt
    max_logit_diff: float = 0.0  # over the same positions; reported, not bounded (another model)
    min_agreement: float = 0.0  # the floor
    passed: bool = False
    check: str = "teacher-forced greedy agreement with the float model"

    def as_dict(self) -> dict[str, Any]:
        """Return the report as a JSON-ready dict (stored in the manifest's validation)."""
        return asdict(self)


def count_agreement(choices: np.ndarray, reference: Sequence[int]) -> int:
    """Return how many positions of `choices` ([n] argmax ids) equal `reference` ([n] token ids)."""
    choices = np.asarray(choices)
    if choices.shape != (len(reference),):
        raise ValueError(f"choices {choices.shape} and reference ({len(reference)},) differ in length")
    return int((choices == np.asarray(reference)).sum())


def prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    """Return the token ids of `prompt` as a one-turn chat when the tokenizer has a template, else plain."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    return list(tokenizer(prompt, add_special_tokens=False)["input_ids"]) or [0]


def float_answers(torch_model: Any, tokenizer: Any, prompts: Sequence[str] = AGREEMENT_PROMPTS,
                  answer_tokens: int = ANSWER_TOKENS) -> list[tuple[list[int], list[int], np.ndarray]]:
    """Return (prompt ids, greedy answer ids, float logits [answer, vocab]) per prompt from PyTorch."""
    import torch

    pairs = []
    for prompt in prompts:
        ids = prompt_ids(tokenizer, prompt)
        tokens = list(ids)
        with torch.no_grad():
            past = None
            logits_rows = []
            step = torch.tensor([tokens])
            for _ in range(answer_tokens):
                out = torch_model(step, past_key_values=past, use_cache=True)
                past = out.past_key_values
                row = out.logits[0, -1].float().numpy()
                logits_rows.append(row)
                tokens.append(int(np.argmax(row)))
                if tokens[-1] == getattr(tokenizer, "eos_token_id", None):
                    break
                step = torch.tensor([[tokens[-1]]])
        pairs.append((ids, tokens[len(ids):], np.stack(logits_rows)))
    return pairs


def teacher_forced_agreement(artifact_dir: Path, spec: GraphSpec,
                             answers: list[tuple[list[int], list[int], np.ndarray]],
                             min_agreement: float) -> AgreementReport:
    """Return the graph's agreement with the float answers, each prompt + answer scored in one call."""
    session = ModelSession(artifact_dir, spec, provider="cpu")
    per_prompt = []
    max_diff = 0.0
    for ids, answer, float_logits in answers:
        cache = session.new_cache(len(ids) + len(answer))
        logits = session.forward(cache, ids + answer[:-1])[len(ids) - 1:]  # [answer, vocab]
        vocab = min(logits.shape[-1], float_logits.shape[-1])
        max_diff = max(max_diff, float(np.abs(logits[:, :vocab] - float_logits[:, :vocab]).max()))
        per_prompt.append([count_agreement(np.argmax(logits, axis=-1), answer), len(answer)])
    agreed, total = (sum(column) for column in zip(*per_prompt))
    agreement = agreed / max(total, 1)
    return AgreementReport(prompts=len(answers), tokens=total, agreement=agreement, per_prompt=per_prompt,
                           max_logit_diff=max_diff, min_agreement=min_agreement,
                           passed=total > 0 and agreement >= min_agreement)
