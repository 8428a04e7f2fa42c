"""Replaying n-gram drafting over a known output: hand-made sequences and the oracle bound."""

import random

from specdec.benchmarks.replay import CostModel, replay_ngram
from specdec.runtime.ngram import ngram_propose

COST = CostModel(verify_cost=0.1, rollback_cost=0.05)


def test_copy_of_the_prompt_by_hand():
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    # prefill commits 1; (9, 1) never occurred: a plain call commits 2; (1, 2) did: drafts
    # 3 4 5 6, all accepted, bonus 7; 2 tokens left: 1 draft (8) accepted, bonus 9.
    result = replay_ngram(prompt, prompt, k=4, cost=COST)
    assert (result.target_calls, result.drafted, result.accepted) == (3, 5, 5)
    assert abs(result.cost - (1 + 1.4 + 1.1)) < 1e-12
    assert abs(result.speedup - 8 / 3.5) < 1e-12


def test_nothing_recurs_means_plain_decoding():
    result = replay_ngram([100, 101], list(range(20)), k=4, cost=COST)
    assert (result.target_calls, result.drafted, result.cost, result.speedup) == (19, 0, 19.0, 1.0)


def test_rejected_drafts_cost_verify_and_rollback():
    prompt = [1, 2, 3, 4]
    # plain call commits 2; (1, 2) proposes 3 (room for one draft), rejected: 9; plain: 9
    output = [1, 2, 9, 9]
    result = replay_ngram(prompt, output, k=2, cost=COST)
    assert (result.target_calls, result.drafted, result.accepted) == (3, 1, 0)
    assert abs(result.cost - (1 + (1 + 0.1 + 0.05) + 1)) < 1e-12


def _brute_force(prompt, output, k):
    """The loop itself with the reference (scanning) n-gram proposer."""
    context, position, calls, total = list(prompt) + output[:1], 1, 0, 0.0
    while position < len(output):
        proposal = ngram_propose(context, min(k, len(output) - position - 1), 2, 4)
        run = 0
        while run < len(proposal) and proposal[run] == output[position + run]:
            run += 1
        calls += 1
        total += 1 + COST.verify_cost * len(proposal) + (COST.rollback_cost if run < len(proposal) else 0)
        context += output[position:position + run + 1]
        position += run + 1
    return calls, total


def test_replay_matches_the_loop_and_the_oracle_bounds_every_k():
    rng = random.Random(0)
    for _ in range(30):
        alphabet = rng.randint(3, 8)  # few symbols: many recurring n-grams
        prompt = [rng.randrange(alphabet) for _ in range(rng.randint(5, 40))]
        output = [rng.randrange(alphabet) for _ in range(rng.randint(2, 60))]
        oracle = replay_ngram(prompt, output, None, COST)
        # auto's 1-token lookups add proposals the oracle may take or skip: never a higher cost
        assert replay_ngram(prompt, output, None, COST, ngram_min=1).cost <= oracle.cost + 1e-12
        for k in (1, 2, 4, 8):
            result = replay_ngram(prompt, output, k, COST)
            calls, total = _brute_force(prompt, output, k)
            assert result.target_calls == calls and abs(result.cost - total) < 1e-9
            assert oracle.cost <= result.cost + 1e-12


def test_cost_model_reads_the_measured_table_and_extends_it():
    table = CostModel(verify_cost=0.05, rollback_cost=0.0, call_costs={1: 1.0, 2: 1.1, 6: 1.15, 7: 1.3})
    assert table.call(1) == 1.0 and table.call(6) == 1.15
    assert abs(table.call(4) - (1.1 + 2 * 0.05)) < 1e-12  # unmeasured: the shorter measured call plus v per token
    assert abs(table.call(9) - (1.3 + 2 * 0.05)) < 1e-12
    assert abs(COST.call(5) - 1.4) < 1e-12  # no table: the line


def test_replay_charges_each_call_from_the_table():
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    step = CostModel(verify_cost=0.1, rollback_cost=0.0, call_costs={1: 1.0, 2: 1.2, 5: 1.25})
    # as in test_copy_of_the_prompt_by_hand: calls over 1, 5 and 2 tokens
    result = replay_ngram(prompt, prompt, k=4, cost=step)
    assert abs(result.cost - (1 + 1.25 + 1.2)) < 1e-12
