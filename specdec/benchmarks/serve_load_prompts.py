"""Raw prompts of an exact token count for the prefill scenario, each from a different place in a text.

Servers cache prompt prefixes (specdec's --prefix-cache, llama-server's cache_prompt, vLLM's prefix caching),
so a prompt sent twice costs nothing the second time: every request starts at another sentence of the text.
"""

from __future__ import annotations

import re
from typing import Sequence

from specdec.models.errors import SpecdecError

SAME_START = 24  # characters two sentence starts must differ within to count as two
CUT_TRIES = 8  # words dropped, one at a time, before giving up on an exact cut


def count_tokens(tokenizer, text: str) -> int:
    """Return how many tokens `text` is as a server counts a raw prompt: special tokens added (a BOS, if any)."""
    return len(tokenizer.encode(text, add_special_tokens=True).ids)


def cut_to_tokens(tokenizer, text: str, n: int) -> str | None:
    """Return the start of `text` that is exactly `n` tokens as count_tokens counts them, or None when no cut
    lands on `n`; raise SpecdecError when `text` is too short.

    tokenizer: a `tokenizers.Tokenizer`. Decoding the first k tokens and encoding them again can merge across
    the cut (a run of newlines, a split character), so the cut moves by the difference until the count is
    exact; where the n-th token sits inside such a run, no cut is exact.
    """
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    cut = n - count_tokens(tokenizer, "")  # the special tokens a server adds (SmolLM2's GGUF tokenizer: 1)
    if cut <= 0 or len(ids) < cut:
        raise SpecdecError(f"the text is {len(ids)} tokens, too short for a prompt of {n}")
    tried: set[int] = set()
    while cut not in tried and 0 < cut <= len(ids):
        piece = tokenizer.decode(ids[:cut])
        count = count_tokens(tokenizer, piece)
        if count == n:
            return piece
        tried.add(cut)
        cut += n - count
    return None


def drop_word(text: str, k: int) -> str:
    """Return `text` without its k-th space-separated word (k >= 1; the first, 0, stays: the start is kept).

    E.g. ("a b c d", 2) -> "a b d"."""
    parts = text.split(" ", k + 1)
    return " ".join(parts[:k] + parts[k + 1:]) if len(parts) > k + 1 else text


def sentence_starts(text: str) -> list[int]:
    """Return the offsets where sentences and lines of `text` start (after ". ", "? ", "! " or a newline), but
    only the first of those that begin with the same SAME_START characters (a repeated line shares its prefix).

    E.g. "One. Two\\nThree" -> [0, 5, 9]."""
    starts, seen = [], set()
    for start in [0] + [m.end() for m in re.finditer(r"[.?!]\s+|\n+", text)]:
        head = text[start:start + SAME_START]
        if start < len(text) and not text[start].isspace() and head not in seen:
            starts.append(start)
            seen.add(head)
    return starts


def prefill_prompt(tokenizer, texts: Sequence[str], index: int, n: int) -> str:
    """Return prompt `index` of `n` tokens: the joined `texts` from their index-th sentence start on (wrapping
    round to their beginning as often as needed), cut to exactly `n` tokens; raise SpecdecError when the texts
    have fewer sentence starts than `index` + 1 (each prompt must begin at a different one)."""
    corpus = "\n\n".join(texts)
    starts = sentence_starts(corpus)
    if index >= len(starts):
        raise SpecdecError(f"the prompts hold {len(starts)} sentences, too few for {index + 1} different prefill "
                           "prompts: give --prompts with more text, or fewer --prefill-lengths or --rounds")
    text = corpus[starts[index]:]
    while count_tokens(tokenizer, text) <= n + 8 + CUT_TRIES:  # beyond n: the cut needs the tokens after it
        text += "\n\n" + corpus
    for k in range(CUT_TRIES):  # no exact cut: a word fewer near the start moves every token boundary after it
        prompt = cut_to_tokens(tokenizer, drop_word(text, k) if k else text, n)
        if prompt is not None:
            return prompt
    raise SpecdecError(f"found no cut of prompt {index} that is exactly {n} tokens")


def load_tokenizer(artifact: str):
    """Return the artifact's tokenizer (`<artifact>/tokenizer/tokenizer.json`); raise SpecdecError if missing."""
    from pathlib import Path

    from tokenizers import Tokenizer

    path = Path(artifact) / "tokenizer" / "tokenizer.json"
    if not path.is_file():
        raise SpecdecError(f"no tokenizer at {path}: --prefill-lengths cuts prompts with the artifact's tokenizer")
    return Tokenizer.from_file(str(path))
