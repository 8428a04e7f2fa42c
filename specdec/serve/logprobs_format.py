"""OpenAI's logprobs shapes, built from the runtime's TokenLogprobs (specdec/runtime/logprobs.py).

Chat completions: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}`.
Completions (the legacy shape): `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`.
A token's text is its own decoded piece; `bytes` are that piece's UTF-8 bytes (a token that is half
of a character decodes to U+FFFD, as OpenAI's own tokens then do).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from specdec.runtime.logprobs import TokenLogprobs


@dataclass(frozen=True)
class TokenEntry:
    """One token's logprob and its alternatives, as text (None for both: a prompt's first token, which has no row)."""

    token: str
    logprob: float | None
    top: list[tuple[str, float]] | None


def _finite(value: float) -> float:
    # JSON has no -inf: a token a grammar forbids reports the lowest float OpenAI's clients parse
    return value if math.isfinite(value) else -9999.0


def entries(tokens: list[int], logprobs: TokenLogprobs, decode: Callable[[list[int]], str]) -> list[TokenEntry]:
    """Return a TokenEntry per committed token (`decode` turns ids into text)."""
    out = []
    for row, token in enumerate(tokens[:len(logprobs)]):
        top = [(decode([int(t)]), _finite(float(v))) for t, v in zip(logprobs.top_ids[row], logprobs.top_values[row])]
        out.append(TokenEntry(decode([token]), _finite(float(logprobs.chosen[row])), top))
    return out


def prompt_entries(prompt_ids: list[int], logprobs: TokenLogprobs, decode: Callable[[list[int]], str]
                   ) -> list[TokenEntry]:
    """Return a TokenEntry per prompt token for `echo`: the first with no logprob, the rest from `logprobs`
    (Engine.prompt_logprobs: tokens 1..n-1)."""
    return [TokenEntry(decode(prompt_ids[:1]), None, None)] + entries(prompt_ids[1:], logprobs, decode)


def chat_logprobs(items: list[TokenEntry]) -> dict[str, Any]:
    """Return a chat choice's `logprobs` object."""
    def one(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top]} for e in items],
            "refusal": None}


def completion_logprobs(items: list[TokenEntry], offset: int = 0) -> dict[str, Any]:
    """Return a completion choice's legacy `logprobs` object; text offsets start at `offset`."""
    offsets = []
    for entry in items:
        offsets.append(offset)
        offset += len(entry.token)
    return {"tokens": [e.token for e in items], "token_logprobs": [e.logprob for e in items],
            "top_logprobs": [None if e.top is None else dict(e.top) for e in items], "text_offset": offsets}


def joined(first: dict[str, Any] | None, second: dict[str, Any] | None) -> dict[str, Any] | None:
    """Return two completion `logprobs` objects as one (an echoed prompt's, then its answer's)."""
    if first is None or second is None:
        return first or second
    return {key: first[key] + second[key] for key in first}
