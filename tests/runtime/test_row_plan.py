"""The row plans of ModelSession's three calls (single, batch, ragged): exact hand-made cases, then every small case
read back through a fake graph whose every output row holds the position it was computed at."""

import itertools

import numpy as np
import pytest

from specdec.runtime.row_plan import GraphRows, batch_rows, ragged_rows, single_rows

PLAIN = GraphRows(max_positions=100)
PADDED = GraphRows(max_positions=100, min_rows=2)
HEAD_START = GraphRows(max_positions=100, head_row_start=True)


def _pairs(rows):
    return list(zip(rows[0].tolist(), rows[1].tolist()))


def test_a_verify_call_feeds_its_tokens_after_the_cache_and_returns_every_row():
    plan = single_rows(PLAIN, [11, 12, 13], past=5, rows=3)
    assert plan.ids.tolist() == [[11, 12, 13]] and plan.ids.dtype == np.int64
    assert plan.positions.tolist() == [[5, 6, 7]] and plan.positions.dtype == np.int64
    assert plan.seqlens.tolist() == [7] and plan.seqlens.dtype == np.int32
    assert (plan.total_length, plan.row_tokens) == (8, None)
    assert (plan.out_rows, plan.head_start, plan.head_rows, plan.n_fed, plan.returned) == (3, 0, 3, 3, 3)
    assert _pairs(plan.logits_at) == [(0, 0), (0, 1), (0, 2)]
    assert _pairs(plan.states_at) == [(0, 0), (0, 1), (0, 2)]


def test_a_prefill_keeps_its_last_row_only():
    plan = single_rows(PLAIN, [1, 2, 3, 4], past=0, rows=1)
    assert (plan.out_rows, plan.head_rows) == (1, 1)
    assert _pairs(plan.logits_at) == [(0, 0)]
    assert _pairs(plan.states_at) == [(0, 0), (0, 1), (0, 2), (0, 3)]  # every new token's fed row
    # a graph without a logits_rows input computes every row: the last one is returned
    whole = single_rows(GraphRows(max_positions=100, keeps_rows=False), [1, 2, 3, 4], past=0, rows=2)
    assert (whole.out_rows, whole.head_rows) == (4, 4) and _pairs(whole.logits_at) == [(0, 2), (0, 3)]


def test_min_rows_pads_a_step_with_a_throwaway_copy_whose_row_never_comes_back():
    plan = single_rows(PADDED, [9], past=5, rows=1)
    assert plan.ids.tolist() == [[9, 9]] and plan.positions.tolist() == [[5, 6]]
    assert plan.seqlens.tolist() == [6] and plan.total_length == 7
    assert (plan.out_rows, plan.head_rows) == (2, 2)  # both rows through the MatMuls
    assert _pairs(plan.logits_at) == [(0, 0)] and _pairs(plan.states_at) == [(0, 0)]
    # no room for the pad at the last position: fed alone
    last = single_rows(PADDED, [9], past=99, rows=1)
    assert last.ids.tolist() == [[9]] and last.out_rows == 1 and _pairs(last.logits_at) == [(0, 0)]
    # a call of min_rows tokens or more is not padded, but its LM head still runs on min_rows rows
    long = single_rows(PADDED, [1, 2, 3], past=0, rows=1)
    assert long.ids.tolist() == [[1, 2, 3]] and long.out_rows == 2 and _pairs(long.logits_at) == [(0, 1)]


def test_a_hidden_prefill_keeps_every_row_and_starts_the_lm_head_at_the_last():
    plan = single_rows(HEAD_START, list(range(10)), past=0, rows=1, hidden=True)
    assert (plan.out_rows, plan.head_start, plan.head_rows) == (10, 9, 1)
    assert _pairs(plan.logits_at) == [(0, 0)]  # the head's one row: kept row 9
    assert len(plan.states_at[1]) == 10
    # without a row start the head runs on every kept row and the last is picked
    plain = single_rows(PLAIN, list(range(10)), past=0, rows=1, hidden=True)
    assert (plain.out_rows, plain.head_start, plain.head_rows) == (10, 0, 10) and _pairs(plain.logits_at) == [(0, 9)]


def _returned_positions(plan, at):
    """Return the positions the fake graph's LM head output rows `at` were computed at: the head reads the kept
    rows (the last out_rows fed ones) from head_start on."""
    first = plan.n_fed - plan.out_rows + plan.head_start
    head_output = plan.positions[:, first:]
    assert head_output.shape[1] == plan.head_rows
    return head_output[at].tolist()


@pytest.mark.parametrize("graph", [PLAIN, PADDED, GraphRows(max_positions=7, min_rows=3, head_row_start=True),
                                   GraphRows(max_positions=100, min_rows=2, keeps_rows=False), HEAD_START])
def test_every_small_single_call_returns_the_rows_it_asked_for(graph):
    for past, n_new, hidden in itertools.product(range(5), range(1, 5), (False, True)):
        if past + n_new > graph.max_positions:
            continue
        tokens = list(range(100, 100 + n_new))
        for rows in range(1, n_new + 1):
            plan = single_rows(graph, tokens, past, rows, hidden)
            case = (past, n_new, rows, hidden)
            assert plan.ids[0, :n_new].tolist() == tokens and set(plan.ids[0, n_new:].tolist()) <= {tokens[-1]}
            assert _returned_positions(plan, plan.logits_at) == list(range(past + n_new - rows, past + n_new)), case
            assert plan.positions[plan.states_at].tolist() == list(range(past, past + n_new)), case
            assert plan.head_rows >= min(graph.min_rows, plan.n_fed), case  # the head's MatMuls see min_rows rows
            assert plan.total_length == past + plan.n_fed <= max(graph.max_positions, past + n_new)


def test_a_batch_feeds_one_token_per_sequence_after_its_own_length():
    plan = batch_rows(HEAD_START, [7, 8, 9], np.array([3, 5, 0]))
    assert plan.ids.tolist() == [[7], [8], [9]] and plan.ids.dtype == np.int64
    assert plan.positions.tolist() == [[3], [5], [0]]
    assert plan.seqlens.tolist() == [3, 5, 0] and plan.seqlens.dtype == np.int32
    assert (plan.total_length, plan.row_tokens) == (6, None)
    assert (plan.out_rows, plan.head_start, plan.head_rows, plan.returned) == (1, 0, 1, 3)
    assert _pairs(plan.logits_at) == [(0, 0), (1, 0), (2, 0)]  # sequence i's row in place i
    assert len(plan.states_at[0]) == 0


def test_a_ragged_call_flattens_its_rows_and_returns_every_token_row_by_row():
    plan = ragged_rows([[7, 8], [], [9]], [4, 2, 6])
    assert plan.ids.tolist() == [[7, 8, 9]] and plan.positions.tolist() == [[4, 5, 6]]
    assert plan.seqlens.tolist() == [5, 1, 6] and plan.seqlens.dtype == np.int32
    assert plan.total_length == 7  # the empty row attends one throwaway token: 2 + 1 < 7
    assert plan.row_tokens.tolist() == [2, 0, 1] and plan.row_tokens.dtype == np.int64
    assert (plan.out_rows, plan.head_start, plan.head_rows, plan.returned) == (3, 0, 3, 3)
    assert _pairs(plan.logits_at) == [(0, 0), (0, 1), (0, 2)] == _pairs(plan.states_at)
    idle = ragged_rows([[], []], [5, 2])  # slots with nothing to feed still attend their throwaway token
    assert (idle.total_length, idle.seqlens.tolist(), idle.returned, idle.ids.shape) == (6, [4, 1], 0, (1, 0))
