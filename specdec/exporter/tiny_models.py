"""Tiny random draft/target pairs for tests and demos, built offline in seconds.

Every pair shares one small byte-level BPE tokenizer trained here with the `tokenizers`
library on a fixed text, so ids are stable. Weights come from a seeded torch generator:
the same seed gives the same models.
"""

from __future__ import annotations

from pathlib import Path

CORPUS = """\
Speculative decoding drafts a few tokens with a small model and verifies them with a large one.
The quick brown fox jumps over the lazy dog. The lazy dog sleeps in the sun all day long.
def add(a, b):
    return a + b
Once upon a time there was a little robot who liked to count: one, two, three, four, five.
Memory bandwidth, not arithmetic, limits how fast a language model can decode one token.
Hello world! How are you today? I am fine, thank you. What is the capital of France? Paris.
Les modèles de langue aiment le café. Über allen Gipfeln ist Ruh. 東京は日本の首都です。
"""
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
FAMILIES = ("llama", "gpt2")


def build_tokenizer(vocab_size: int = 400):
    """Return a transformers fast tokenizer: byte-level BPE trained on CORPUS (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _config(family: str, role: str, vocab_size: int):
    from transformers import GPT2Config, LlamaConfig

    big = role == "target"
    # Sizes both families share, by transformers' common names (GPT2Config maps them onto n_embd, n_layer, ...).
    shared = dict(vocab_size=vocab_size, hidden_size=64 if big else 32, num_hidden_layers=2 if big else 1,
                  num_attention_heads=4 if big else 2, max_position_embeddings=512,
                  initializer_range=0.2)  # peaked logits: few near-ties in greedy tests
    if family == "llama":
        return LlamaConfig(**shared, intermediate_size=128 if big else 64, num_key_value_heads=2 if big else 1,
                           tie_word_embeddings=False)
    if family == "gpt2":
        return GPT2Config(**shared)
    raise ValueError(f"no tiny model for family '{family}'; choose from {FAMILIES}")


def build_tiny_model(folder: Path, family: str, role: str, seed: int, pad_vocab_to: int | None = None) -> Path:
    """Write a tiny random model + the shared tokenizer as a Hugging Face folder; return the folder.

    `pad_vocab_to` makes the embedding larger than the tokenizer (as real models pad to a
    multiple of 64), to exercise vocabulary masking.
    """
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = build_tokenizer()
    vocab = max(len(tokenizer), pad_vocab_to or 0)
    config = _config(family, role, vocab)
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.eval()
    folder = Path(folder)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def build_tiny_pair(folder: Path, family: str, seed: int = 0) -> tuple[Path, Path]:
    """Write a (target, draft) pair for `family` under `folder`; return their folders.

    The gpt2 draft pads its vocabulary to a multiple of 64, like many real checkpoints.
    """
    folder = Path(folder)
    target = build_tiny_model(folder / f"{family}-target", family, "target", seed)
    pad = 448 if family == "gpt2" else None
    draft = build_tiny_model(folder / f"{family}-draft", family, "draft", seed + 1, pad_vocab_to=pad)
    return target, draft


def build_perturbed_draft(target_folder: Path, folder: Path, noise: float, seed: int) -> Path:
    """Write a copy of a model with Gaussian noise (std `noise`) added to every weight; return the folder.

    A draft close to, but not equal to, its target: p and q overlap partially, which is the
    regime where mistakes in the rejection step (wrong residual, unprocessed q) show up.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(target_folder)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * noise)
    folder = Path(folder)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(target_folder).save_pretrained(folder)
    return folder
