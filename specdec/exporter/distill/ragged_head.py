"""The draft head's ragged-rows graph: one round of every drafting request's head calls in ONE call.

A head call is small (one layer), but its weights (the LM head over the vocabulary subset most of all)
are read again by every request's call. This graph takes the pairs of up to R requests flattened on
one token axis ([1, N]: every projection, the MLP and the LM head read their weights once for all of
them) and runs attention per row: row r takes its `row_tokens[r]` pairs, its own past (`past_key.<r>`,
`past_value.<r>`) and returns its own presents, so a row computes what its batch-1 call computes. The
logits are each row's last pair's ([R, subset]); a row with no pairs (fewer requests than R) costs no
MatMul row, its logits row is meaningless, and the runtime gives it one zero position of past. `specdec
distill` exports it from the trained head (`export_ragged_head`) and keeps it only where every row equals
its batch-1 call to the bit (`ragged_head_difference`: the seed-for-seed promise under load).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

RAGGED_HEAD_FILE = "draft_rows.onnx"
ROW_TOKENS_NAME = "row_tokens"


def row_input_names(rows: int) -> list[str]:
    """Return the ragged head's inputs: the flattened pairs, `row_tokens`, then each row's past key and value."""
    return ["hidden", "input_ids", "position_ids", ROW_TOKENS_NAME] + [
        name for r in range(rows) for name in (f"past_key.{r}", f"past_value.{r}")]


def row_output_names(rows: int) -> list[str]:
    """Return the ragged head's outputs: logits [R, subset], features [1, N, H], then each row's presents."""
    return ["logits", "feature"] + [name for r in range(rows) for name in (f"present_key.{r}", f"present_value.{r}")]


class _RaggedDraftCall(nn.Module):
    def __init__(self, head, rows: int):
        super().__init__()
        self.head = head
        self.rows = rows

    def forward(self, hidden, input_ids, position_ids, row_tokens, *pasts):
        residual, q, k, v = self.head.project(hidden, input_ids, position_ids)
        ends = torch.cumsum(row_tokens, 0)
        starts = ends - row_tokens
        token = torch.arange(input_ids.shape[1])
        attended, presents = [], []
        for r in range(self.rows):
            # NonZero over a mask: the row's token positions, traced as a dynamic range
            index = torch.nonzero((token >= starts[r]) & (token < ends[r])).squeeze(-1)
            out, key, value = self.head.attend(q.index_select(2, index), k.index_select(2, index),
                                               v.index_select(2, index), pasts[2 * r], pasts[2 * r + 1])
            attended.append(out)
            presents += [key, value]
        feature = self.head.finish(residual, torch.cat(attended, dim=1))
        logits = self.head.lm_head(feature.index_select(1, ends - 1))[0]
        return (logits, feature, *presents)


def export_ragged_head(model, path: Path, rows: int, opset: int = 17) -> None:
    """Write the head's ragged-rows graph over `rows` rows (inputs `row_input_names`, outputs `row_output_names`)."""
    c = model.config
    model = model.eval().to("cpu")
    counts = [1 + r % 3 for r in range(rows)]  # rows of different lengths: nothing specialises on one
    tokens = sum(counts)
    pasts = []
    for r in range(rows):
        pasts += [torch.zeros(1, c.num_kv_heads, 2 + r, c.head_dim), torch.zeros(1, c.num_kv_heads, 2 + r, c.head_dim)]
    example = (torch.zeros(1, tokens, model.feature_width), torch.zeros(1, tokens, dtype=torch.long),
               torch.arange(tokens)[None], torch.tensor(counts), *pasts)
    axes = {"hidden": {1: "tokens"}, "input_ids": {1: "tokens"}, "position_ids": {1: "tokens"},
            "feature": {1: "tokens"}}
    for r in range(rows):
        axes.update({f"past_key.{r}": {2: f"past_{r}"}, f"past_value.{r}": {2: f"past_{r}"},
                     f"present_key.{r}": {2: f"total_{r}"}, f"present_value.{r}": {2: f"total_{r}"}})
    with torch.no_grad():
        torch.onnx.export(_RaggedDraftCall(model, rows), example, str(path), input_names=row_input_names(rows),
                          output_names=row_output_names(rows), dynamic_axes=axes, opset_version=opset, dynamo=False)


def ragged_head_difference(single: Path, ragged: Path, rows: int, feature_width: int, vocab_size: int,
                           threads: int = 1, seed: int = 0) -> float:
    """Return the largest |difference| between the ragged graph's rows and batch-1 calls of `single` (logits,
    features and presents), over calls of rows with different pair counts and pasts, one row empty."""
    from specdec.runtime.providers import create_session

    # the runtime's own session settings (EagleHead's), so the check covers what it will run
    one, many = (create_session(str(path), "cpu", threads, spin=False)[0] for path in (single, ragged))
    past_shape = {i.name: i.shape for i in one.get_inputs()}["past_key"]
    kv_heads, head_dim = past_shape[1], past_shape[3]
    rng = np.random.default_rng(seed)
    worst = 0.0
    for counts in ([1] * rows, [3, 0] + [1 + r % 4 for r in range(rows - 2)]):
        counts = counts[:rows]
        feeds, rows_alone = {ROW_TOKENS_NAME: np.asarray(counts, np.int64)}, []
        hidden, ids, positions = [], [], []
        for r, count in enumerate(counts):
            past = int(rng.integers(0, 12)) if count else 1  # an idle row: what the runtime feeds it
            key = rng.standard_normal((1, kv_heads, past, head_dim)).astype(np.float32)
            value = rng.standard_normal((1, kv_heads, past, head_dim)).astype(np.float32)
            alone = {"hidden": rng.standard_normal((1, count, feature_width)).astype(np.float32),
                     "input_ids": rng.integers(0, vocab_size, (1, count)).astype(np.int64),
                     "position_ids": np.arange(past, past + count, dtype=np.int64)[None],
                     "past_key": key, "past_value": value}
            feeds[f"past_key.{r}"], feeds[f"past_value.{r}"] = key, value
            hidden.append(alone["hidden"])
            ids.append(alone["input_ids"])
            positions.append(alone["position_ids"])
            rows_alone.append(alone)
        feeds.update(hidden=np.concatenate(hidden, 1), input_ids=np.concatenate(ids, 1),
                     position_ids=np.concatenate(positions, 1))
        logits, features, *presents = many.run(None, feeds)
        start = 0
        for r, (count, alone) in enumerate(zip(counts, rows_alone)):
            if count:
                want_logits, want_features, want_key, want_value = one.run(None, alone)
                got = (logits[r], features[0, start:start + count], presents[2 * r], presents[2 * r + 1])
                for a, b in zip(got, (want_logits[0, -1], want_features[0], want_key, want_value)):
                    worst = max(worst, float(np.max(np.abs(a - b))) if a.size else 0.0)
            start += count
    return worst
