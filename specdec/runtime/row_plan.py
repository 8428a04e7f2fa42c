"""Which rows one graph call feeds, and which of its output rows come back: pure functions over ints and arrays.

ModelSession runs three kinds of call through one binding helper, each planned here:
- `single_rows`: one sequence, n new tokens after `past` (maybe padded to the graph's min_rows), the last rows kept;
- `batch_rows`: B sequences, one new token each, each after its own length;
- `ragged_rows`: one sequence of every ragged row's tokens, one after another, each row after its own length.
Every output is read as [sequences, rows, width]; a plan names the rows that come back as (sequence, row) pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

Rows = tuple[np.ndarray, np.ndarray]  # (sequence, row) index arrays, one pair per row that comes back


@dataclass(frozen=True)
class RowPlan:
    """One call's inputs that say what is fed and where, and which output rows the caller gets."""

    ids: np.ndarray  # [sequences, fed] int64: the tokens fed, a pad's throwaway ones included
    positions: np.ndarray  # [sequences, fed] int64: each fed token's position
    seqlens: np.ndarray  # [sequences] int32: past + fed - 1 of each sequence (ragged: row), its last position
    total_length: int  # the longest past + fed: the attention op's total sequence length
    row_tokens: np.ndarray | None  # [ragged rows] int64: tokens each ragged row feeds (None: not a ragged call)
    out_rows: int  # rows the graph keeps per sequence (its logits_rows input), counted from the end of the fed ones
    head_start: int  # the first kept row the LM head reads
    head_rows: int  # rows of the LM head's outputs per sequence (its input's rows: head_start + head_rows)
    logits_at: Rows  # each returned logits row, among the LM head's output rows
    states_at: Rows  # each new token's row among the fed ones (its hidden state)

    @property
    def n_fed(self) -> int:
        """Return the positions fed per sequence."""
        return self.ids.shape[1]

    @property
    def returned(self) -> int:
        """Return how many logits rows come back."""
        return len(self.logits_at[0])


@dataclass(frozen=True)
class GraphRows:
    """What a graph's inputs make of a call's rows (from its GraphSpec)."""

    max_positions: int  # positions a sequence may reach: a pad stops there
    min_rows: int = 1  # positions every call feeds at least (throwaway ones after the real tokens)
    keeps_rows: bool = True  # a logits_rows input: only the trailing rows go through the last layer
    head_row_start: bool = False  # its LM head takes a row start: it reads the kept rows from there on


def _first(rows: np.ndarray) -> Rows:
    return np.zeros(len(rows), dtype=np.intp), rows


def single_rows(graph: GraphRows, tokens: list[int], past: int, rows: int, hidden: bool = False) -> RowPlan:
    """Return the plan of a call over `tokens` after `past` positions that wants the last `rows` logits.

    A graph whose kernels round a 1-row call differently (min_rows > 1, int4 at accuracy level 4) gets
    throwaway positions after the real ones (copies of the last token, as far as max_positions leaves room);
    the rows the LM head needs also hold min_rows, since they go through MatMuls. A graph without
    keeps_rows keeps every fed row, and so does a `hidden` call (its features).
    Example: 1 token after 5 positions, rows 1, min_rows 2: fed [t, t] at 5, 6; 2 rows kept, row 0 returned.
    """
    n_new = len(tokens)
    pad = min(max(0, graph.min_rows - n_new), graph.max_positions - past - n_new)
    n_fed = n_new + pad
    needed = min(max(rows + pad, graph.min_rows), n_fed)  # the rows the LM head runs on
    out_rows = (n_fed if hidden else needed) if graph.keeps_rows else n_fed
    head_start = out_rows - needed if graph.head_row_start else 0
    kept = np.arange(out_rows - pad - rows, out_rows - pad)
    return RowPlan(
        ids=np.asarray([list(tokens) + [tokens[-1]] * pad], dtype=np.int64),
        positions=np.arange(past, past + n_fed, dtype=np.int64)[None, :],
        seqlens=np.array([past + n_fed - 1], dtype=np.int32), total_length=past + n_fed, row_tokens=None,
        out_rows=out_rows, head_start=head_start, head_rows=out_rows - head_start,
        logits_at=_first(kept - head_start), states_at=_first(np.arange(n_new)))


def batch_rows(graph: GraphRows, tokens: list[int], lengths: np.ndarray) -> RowPlan:
    """Return the plan of a call over len(tokens) sequences, tokens[i] fed after lengths[i] positions of sequence i.

    The graph keeps the rows a 1-token call of its own would; each output holds one row per sequence, and
    row i's logits come back in place i. Example: tokens [7, 8], lengths [3, 5]: positions [[3], [5]],
    seqlens [3, 5], total length 6.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    one = single_rows(graph, [0], 0, 1)
    everyone = np.arange(len(tokens))
    return RowPlan(
        ids=np.asarray(tokens, dtype=np.int64)[:, None], positions=lengths[:, None],
        seqlens=lengths.astype(np.int32), total_length=int(lengths.max()) + 1, row_tokens=None,
        out_rows=one.out_rows, head_start=one.head_start, head_rows=1,
        logits_at=(everyone, np.zeros(len(tokens), dtype=np.intp)), states_at=(everyone[:0], everyone[:0]))


def ragged_rows(rows: list[list[int]], lengths: np.ndarray) -> RowPlan:
    """Return the plan of a ragged-rows call: row r feeds rows[r] after lengths[r] positions of its own KV slot.

    Every fed token's logits come back, row after row. Example: rows [[7, 8], [], [9]], lengths [4, 2, 6]:
    ids [[7, 8, 9]], positions [[4, 5, 6]], seqlens [5, 1, 6], total length 7, row tokens [2, 0, 1].
    """
    counts = np.array([len(r) for r in rows], dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(counts.sum())
    every = np.arange(total)
    positions = np.concatenate([np.arange(past, past + n) for past, n in zip(lengths, counts)])
    return RowPlan(
        ids=np.concatenate([np.asarray(r, np.int64) for r in rows])[None, :],
        positions=positions[None, :].astype(np.int64),
        seqlens=(lengths + counts - 1).astype(np.int32),
        # Never equal to a row's own count while it has a past: the op would read the call as a prompt. An
        # empty row's attention gets one throwaway token (the graph adds it).
        total_length=int((lengths + np.maximum(counts, 1)).max()), row_tokens=counts,
        out_rows=total, head_start=0, head_rows=total, logits_at=_first(every), states_at=_first(every))
