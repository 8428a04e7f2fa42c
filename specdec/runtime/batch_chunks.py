"""Where the batch engine's prefills cut a prompt: pure functions over positions.

A prompt is prefilled in chunks aligned to absolute positions, [0, C), [C, 2C), ... (C = PREFILL_CHUNK),
under a per-step token budget; a ragged-rows call may take several of a prompt's chunks in one row, a call
of the plain graph takes one. So a prefix one request computed and another reuses was computed as a
fresh prefill of the second prompt computes it, bit for bit, as far as these hold (docs/DESIGN.md,
"Prefix cache"; measured on a 2-core CPU: the tiny models' KV and logits under any chunking and riders,
and fp32 MatMuls of SmolLM2's shapes over 1 to 320 rows):
- a row's MatMul outputs do not depend on the other rows of the call (whatever else rides it);
- attention over a query of 2+ rows gives each row the same bits whatever the rows around it; a lone
  query row takes MLAS's M = 1 kernel, which sums in another order;
- the plain graph's long-call kernel (calls over LONG_CALL_ROWS) rounds otherwise: no chunk passes it.
The one lone row an aligned prefill computes is a prompt's last position where it follows a multiple of
C, and a fresh prefill of that prompt computes it alone too; `prefill_start` keeps a reused prefix from
making any other.
"""

from __future__ import annotations

from specdec.runtime.session import LONG_CALL_ROWS

PREFILL_CHUNK = LONG_CALL_ROWS  # positions per aligned prefill chunk (64)


def chunk_end(start: int, prompt_tokens: int, chunk: int = PREFILL_CHUNK) -> int:
    """Return the end of the chunk a prefill from `start` feeds first: the next multiple of `chunk`, or the prompt's
    end. Example (chunk 64): from 0 of 100 -> 64; from 38 -> 64; from 64 -> 100."""
    return min((start // chunk + 1) * chunk, prompt_tokens)


def prefill_end(start: int, prompt_tokens: int, budget: int, chunk: int = PREFILL_CHUNK) -> int:
    """Return where this step's prefill of a prompt stops, from `start`: the furthest chunk boundary (a multiple of
    `chunk`, or the prompt's end) at most `budget` tokens on; `start` where its first chunk does not fit.

    Example (chunk 64, 400 tokens): from 0 with 256 -> 256; from 256 with 256 -> 400; from 0 with 100 -> 64;
    from 38 with 20 -> 38 (the chunk [38, 64) takes 26).
    """
    if start + budget >= prompt_tokens:
        return prompt_tokens
    end = (start + budget) // chunk * chunk
    return end if end > start else start


def chunk_pieces(start: int, end: int, chunk: int = PREFILL_CHUNK) -> list[tuple[int, int]]:
    """Return [start, end) cut at every multiple of `chunk`: the calls of the plain graph that prefill it.
    Example (chunk 64): (38, 200) -> [(38, 64), (64, 128), (128, 192), (192, 200)]."""
    pieces = []
    while start < end:
        stop = min((start // chunk + 1) * chunk, end)
        pieces.append((start, stop))
        start = stop
    return pieces


def prefill_start(reusable: int, prompt_tokens: int, lone_rows_differ: bool = True, chunk: int = PREFILL_CHUNK) -> int:
    """Return the position a prompt's prefill starts at when its first `reusable` positions could be reused.

    At most prompt_tokens - 1: the prefill must score the last token. Where a lone query row rounds otherwise
    (`lone_rows_differ`: a graph without the attention pad), one position earlier where the first chunk from
    there would be one token that a fresh prefill computes among others.
    Example (chunk 64): 39 of a 40-token prompt -> 38 (the last token rides with the one before it); 63 of 100
    -> 62; 64 of 65 -> 64 (a fresh prefill computes position 64 alone too); 39 of 40 without lone rows -> 39.
    """
    start = max(0, min(reusable, prompt_tokens - 1))
    lone = chunk_end(start, prompt_tokens, chunk) - start == 1
    fresh_lone = start % chunk == 0 and start == prompt_tokens - 1
    if lone_rows_differ and start > 0 and lone and not fresh_lone:
        start -= 1
    return start
