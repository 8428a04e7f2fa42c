"""Where the batch engine's prefills cut a prompt: pure functions over positions.

A prompt is prefilled in chunks aligned to absolute positions, [0, C), [C, 2C), ... (C = PREFILL_CHUNK),
under a per-step token budget; a ragged-rows call may take several of a prompt's chunks in one row, a call
of the plain graph takes one. So a prefix one request computed and another reuses was computed as a
fresh prefill of the second prompt computes it, bit for bit, as far as these hold (docs/DESIGN.md,
"Prefix cache"; measured on a 2-core CPU: the tiny models' KV and logits under any chunking and riders,
and fp32 MatMuls of SmolLM2's shapes over 1 to 320 rows):
- a row's MatMul outputs do not depend on the other rows of the call (whatever else rides it);
- attention over a query of 2+ rows gives each row the same bits whatever the rows around it, but the last
  row of a query of 32m + 1 rows (ATTENTION_BLOCK; onnxruntime 1.32's GroupQueryAttention, both graphs);
  a lone query row takes MLAS's M = 1 kernel, which sums in another order again (`last_row`);
- the plain graph's long-call kernel (calls over LONG_CALL_ROWS) rounds otherwise: no chunk passes it.
So a query's last row is the only one that may round otherwise, and only a prompt's last position may be
such a row: where a fresh aligned prefill makes it one (its last chunk of 1 or 33 tokens), a prefill from a
reused prefix makes it the same kind (`prefill_start`), and a ragged row ending the prompt does too
(`prefill_end`). Such a position is never reused (SlotArena.prefilled).
"""

from __future__ import annotations

from specdec.runtime.session import LONG_CALL_ROWS

PREFILL_CHUNK = LONG_CALL_ROWS  # positions per aligned prefill chunk (64)
PREFILL_GRANULE = 16  # where a step bounded by its running requests' ITL may cut a chunk (`granule_end`)
ATTENTION_BLOCK = 32  # a query of ATTENTION_BLOCK * m + 1 rows computes its last row otherwise (measured)
AMONG, ALONE, BLOCK_TAIL = 0, 1, 2  # how a query computes its last row (`last_row`)


def last_row(rows: int) -> int:
    """Return how a query of `rows` rows computes its last row: ALONE (1 row), BLOCK_TAIL (32m + 1 rows, m >= 1:
    alone in attention's last block) or AMONG the others. Example: 1 -> ALONE; 33, 65 -> BLOCK_TAIL; 40 -> AMONG."""
    if rows == 1:
        return ALONE
    return BLOCK_TAIL if rows % ATTENTION_BLOCK == 1 else AMONG


def ends_as_fresh(start: int, prompt_tokens: int, chunk: int = PREFILL_CHUNK) -> bool:
    """Return whether a query from `start` to the prompt's end computes the last position as a fresh aligned
    prefill does (its last chunk, of (prompt_tokens - 1) % chunk + 1 tokens). Example (chunk 64): 16 of 33 -> False
    (17 rows; the fresh chunk has 33); 0 of 65 -> False (65 rows; the fresh chunk has 1); 38 of 40 -> True."""
    return last_row(prompt_tokens - start) == last_row((prompt_tokens - 1) % chunk + 1)


def chunk_end(start: int, prompt_tokens: int, chunk: int = PREFILL_CHUNK) -> int:
    """Return the end of the chunk a prefill from `start` feeds first: the next multiple of `chunk`, or the prompt's
    end. Example (chunk 64): from 0 of 100 -> 64; from 38 -> 64; from 64 -> 100."""
    return min((start // chunk + 1) * chunk, prompt_tokens)


def prefill_end(start: int, prompt_tokens: int, budget: int, lone_rows_differ: bool = True,
                chunk: int = PREFILL_CHUNK) -> int:
    """Return where this step's prefill of a prompt stops, from `start`: the furthest chunk boundary (a multiple of
    `chunk`, or the prompt's end) at most `budget` tokens on; `start` where its first chunk does not fit. The
    prompt's end only where a query from `start` computes its last position as a fresh prefill does
    (`lone_rows_differ`; `ends_as_fresh`), else the boundary before it.

    Example (chunk 64, 400 tokens): from 0 with 256 -> 256; from 256 with 256 -> 400; from 0 with 100 -> 64;
    from 38 with 20 -> 38 (the chunk [38, 64) takes 26). 65 tokens from 0 with 256 -> 64 (one query of 65 rows
    would make position 64 a block's tail, a fresh prefill's plain calls make it a lone row).
    """
    if start + budget >= prompt_tokens and (not lone_rows_differ or ends_as_fresh(start, prompt_tokens, chunk)):
        return prompt_tokens
    end = min(start + budget, prompt_tokens - 1) // chunk * chunk
    return end if end > start else start


def granule_end(start: int, prompt_tokens: int, budget: int, lone_rows_differ: bool = True,
                granule: int = PREFILL_GRANULE, chunk: int = PREFILL_CHUNK) -> int:
    """Return where this step's prefill of a prompt stops where it may stop inside a chunk (a budget smaller than a
    chunk: prefill_budget.py's ITL bound): the furthest multiple of `granule`, or the prompt's end, at most `budget`
    tokens on whose query computes its last position as a fresh aligned prefill does; where none is that near, the
    nearest such end (a step feeds the oldest prompt something).

    Where a query's last row may round otherwise (`lone_rows_differ`), an end inside the prompt must leave its
    query's last row among others, and inside the prompt's last chunk only where the fresh prefill's last chunk
    ends among others too and the rest can follow in one query that does. Positions between multiples of 16 are
    never 1 or 32m + 1 rows (`last_row`), so a prompt fed from such a multiple reaches its last chunk alike.
    Example (granule 16, a 46-token prompt): from 0 with 20 -> 16; from 16 with 20 -> 32; from 32 with 20 -> 46;
    from 0 with 8 -> 16. A 65-token prompt: from 48 with 40 -> 64 (position 64 is a fresh prefill's lone row).
    """
    last_chunk = (prompt_tokens - 1) // chunk * chunk

    def as_fresh(end: int) -> bool:
        if not lone_rows_differ:
            return True
        if end == prompt_tokens:
            return ends_as_fresh(start, prompt_tokens, chunk)
        inside_last = end > last_chunk
        return last_row(end - start) == AMONG and (not inside_last or (
            last_row(prompt_tokens - last_chunk) == AMONG and last_row(prompt_tokens - end) == AMONG))

    ends = [*range((start // granule + 1) * granule, prompt_tokens, granule), prompt_tokens]
    valid = [end for end in ends if as_fresh(end)] or [chunk_end(start, prompt_tokens, chunk)]
    within = [end for end in valid if end - start <= budget]
    return max(within) if within else valid[0]


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

    At most prompt_tokens - 1: the prefill must score the last token. Where a query's last row may round
    otherwise (`lone_rows_differ`: a graph without the attention pad; `last_row`), the first query from there
    must compute its last position as a fresh prefill does: among others where it ends at a chunk boundary
    (else one position earlier), and as the prompt's fresh last chunk does where it ends the prompt (else one
    position earlier, or that chunk's start where the fresh one makes a block's tail).
    Example (chunk 64): 39 of a 40-token prompt -> 38 (the last token rides with the one before it); 63 of 100
    -> 62; 64 of 65 -> 64 (a fresh prefill computes position 64 alone too); 95 of 200 -> 94 (not 33 rows to
    128); 16 of 33 -> 0 and 80 of 97 -> 64 (a fresh prefill's 33-row chunk); 39 of 40 without lone rows -> 39.
    """
    start = max(0, min(reusable, prompt_tokens - 1))
    if not lone_rows_differ or start == 0:
        return start
    if chunk_end(start, prompt_tokens, chunk) < prompt_tokens:
        return start - 1 if last_row(chunk - start % chunk) != AMONG else start
    if ends_as_fresh(start, prompt_tokens, chunk):
        return start
    last_chunk = (prompt_tokens - 1) // chunk * chunk
    return last_chunk if last_row(prompt_tokens - last_chunk) == BLOCK_TAIL else start - 1


def reprefill_piece(exact: int, kept: int, rows: int = PREFILL_GRANULE) -> tuple[int, int] | None:
    """Return [start, end) of the next query that computes positions `exact`..kept-1 of a kept sequence as a fresh
    prefill of a longer prompt computes them, or None where there is nothing left (or only position 0, alone).

    A longer prompt's fresh prefill computes every position but its own last among others, so the query keeps its
    last row among others too (`last_row`: 2 to `rows` rows, `rows` < 33), taking one exact position again where a
    lone one is left. Example (rows 16): (40, 100) -> (40, 56); (96, 100) -> (96, 100); (99, 100) -> (98, 100);
    (100, 100) -> None.
    """
    if exact >= kept or kept < 2:
        return None
    start = exact if kept - exact >= 2 else kept - 2
    return start, min(start + rows, kept)
