"""vLLM's tokenizer routes: /tokenize, /detokenize and /tokenizer_info, so a client can count and build prompts
with the served model's own tokenizer (lm-evaluation-harness uses them, when they answer, instead of downloading
a tokenizer: what an offline box needs)."""

from __future__ import annotations

from typing import Any

from specdec.models.errors import SpecdecError
from specdec.runtime import Engine
from specdec.serve import protocol
from specdec.serve.protocol import APIError, DetokenizeRequest, TokenizeRequest


def tokenize(engine: Engine, body: TokenizeRequest) -> dict[str, Any]:
    """Return {count, max_model_len, tokens[, token_strs]} of the body's prompt or messages; raise APIError for a
    body that has neither or both, or that the chat template refuses."""
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "send one of prompt and messages", param="prompt")
    codec = engine.codec
    if body.prompt is not None:
        ids = codec.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    else:
        if not body.add_generation_prompt:
            raise APIError(400, "add_generation_prompt false is not supported: the chat template is rendered up to "
                                "the assistant's turn", param="add_generation_prompt")
        if not codec.has_chat_template:
            raise APIError(400, "this model's tokenizer has no chat template: send a prompt", param="messages")
        try:
            text = codec.chat_prompt(protocol.chat_messages(body))
        except SpecdecError as err:
            raise APIError(400, str(err), param="messages") from None
        ids = codec.encode(text, add_special_tokens=bool(body.add_special_tokens))
    reply: dict[str, Any] = {"count": len(ids), "max_model_len": engine.max_positions, "tokens": ids}
    if body.return_token_strs:
        reply["token_strs"] = [codec.tokenizer.id_to_token(token) for token in ids]
    return reply


def detokenize(engine: Engine, body: DetokenizeRequest) -> dict[str, Any]:
    """Return {prompt} for the body's token ids; raise APIError for an id outside the vocabulary."""
    vocab = engine.manifest.tokenizer.vocab_size
    if any(not 0 <= token < vocab for token in body.tokens):
        raise APIError(400, f"token ids must be in 0..{vocab - 1}", param="tokens")
    return {"prompt": engine.codec.decode(body.tokens)}


def tokenizer_info(engine: Engine) -> dict[str, Any]:
    """Return the tokenizer's class, special tokens (as text), chat template and the model's positions."""
    spec, tokenizer = engine.manifest.tokenizer, engine.codec.tokenizer

    def text(token: int | None) -> str | None:
        return None if token is None else tokenizer.id_to_token(token)

    return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": text(next(iter(spec.eos_token_ids), None)),
            "bos_token": text(spec.bos_token_id), "pad_token": text(spec.pad_token_id),
            "chat_template": spec.chat_template, "model_max_length": engine.max_positions}
