"""The families people run, as tiny seeded models: each exports, validates, and decodes as transformers does.

Windows are 8 positions and every run generates 48 tokens past a 10-token prompt, so sliding layers
cross their window; prompt lookup at K 4 must change nothing.
"""

from __future__ import annotations

import pytest

from specdec.exporter.pipeline import ExportConfig, run_export
from specdec.runtime.engine import Engine, GenerationConfig

WINDOW = 8
# model_type -> config overrides beyond the shared tiny sizes
FAMILIES = {
    "qwen3": dict(sliding_window=WINDOW, use_sliding_window=True, max_window_layers=1,
                  layer_types=["full_attention", "sliding_attention"]),
    "olmo2": {},
    "granite": dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0),
    "smollm3": dict(sliding_window=WINDOW, no_rope_layer_interval=2),
    # caps low enough that a tiny model's attention scores and logits reach them
    "gemma2": dict(sliding_window=WINDOW, head_dim=16, layer_types=["sliding_attention", "full_attention"],
                   attn_logit_softcapping=0.5, final_logit_softcapping=1.0),
    "gemma3_text": dict(sliding_window=WINDOW, head_dim=16, layer_types=["sliding_attention", "full_attention"]),
    "gpt_neox": dict(rotary_pct=0.5),
    "phi": dict(num_key_value_heads=4, partial_rotary_factor=0.5),
}
SHARED_BUFFER = {"qwen3", "olmo2", "granite", "smollm3", "gpt_neox", "phi"}


def build_family_model(folder, model_type: str, seed: int = 0):
    """Save a tiny random `model_type` model with the test tokenizer in `folder`; return the torch model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from specdec.exporter.tiny_models import build_tokenizer

    tokenizer = build_tokenizer()
    sizes = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                 initializer_range=0.2, pad_token_id=0)
    config = AutoConfig.for_model(model_type, **{**sizes, **FAMILIES.get(model_type, {})})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def torch_greedy(model, ids: list[int], new_tokens: int) -> list[int]:
    """Return transformers' own greedy `generate` of `new_tokens` tokens after `ids`, EOS not special."""
    import copy

    import torch

    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = None  # a random model may emit EOS: go on, as the engine does without EOS ids
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), generation_config=config, max_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_family_exports_validates_and_decodes_as_transformers_does(model_type, tmp_path):
    model = build_family_model(tmp_path / model_type, model_type)
    manifest = run_export(ExportConfig(target=str(tmp_path / model_type), draft=None, output=tmp_path / "art"),
                          progress=lambda m: None)
    assert manifest.target.model_type == model_type and manifest.validation["target"]["passed"]
    assert manifest.target.kv_buffer == ("shared" if model_type in SHARED_BUFFER else "concat")
    if model_type not in SHARED_BUFFER:  # the manifest says why
        assert manifest.target.optimization["kv_buffer_reason"]
    engine = Engine.load(tmp_path / "art", provider="cpu", threads=1)
    engine.eos_token_ids = set()  # all 48 tokens, whatever a random model emits
    ids = engine.prompt_ids("Hello world, hello world, hello")
    assert len(ids) + 48 > 2 * WINDOW
    plain = engine.generate(ids, GenerationConfig(max_new_tokens=48, drafter="none"))
    lookup = engine.generate(ids, GenerationConfig(max_new_tokens=48, drafter="ngram", num_draft_tokens=4,
                                                   ngram_min=1))
    assert plain.token_ids == torch_greedy(model, ids, 48)
    assert lookup.token_ids == plain.token_ids
    assert lookup.stats.drafted > 0


def test_a_qwen3_draft_speculates_for_a_llama_target(tiny_sources, tmp_path):
    """Mixed families, one tokenizer: the tokenizer check lets the pair export, and the output is the target's."""
    target, _ = tiny_sources["llama"]
    build_family_model(tmp_path / "qwen3", "qwen3", seed=1)
    manifest = run_export(ExportConfig(target=str(target), draft=str(tmp_path / "qwen3"), output=tmp_path / "art"),
                          progress=lambda m: None)
    assert (manifest.target.model_type, manifest.draft.model_type) == ("llama", "qwen3")
    engine = Engine.load(tmp_path / "art", provider="cpu", threads=1)
    plain = engine.generate("one two three", GenerationConfig(max_new_tokens=32, drafter="none"))
    speculative = engine.generate("one two three", GenerationConfig(max_new_tokens=32, drafter="model",
                                                                    num_draft_tokens=3))
    assert speculative.token_ids == plain.token_ids and speculative.stats.drafted > 0


def test_export_help_names_every_supported_family():
    from click.testing import CliRunner

    from specdec.cli.main import main
    from specdec.models.architectures import supported_model_types

    text = CliRunner().invoke(main, ["export", "--help"]).output
    assert all(family in text for family in supported_model_types())
    assert set(FAMILIES) | {"llama", "gpt2", "mistral", "qwen2", "phi3"} == set(supported_model_types())
