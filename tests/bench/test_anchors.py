from specdec.benchmarks.anchors import (DIFFERS, EQUAL, PAST_MAX_NEW_TOKENS, AnchorRun, GreedyAgreement,
                                   greedy_agreement)
from specdec.benchmarks.report import _agreement_cell, _agreement_notes, anchor_rows

EOS = [2]


def test_equal_tokens_agree_whether_or_not_the_end_of_sequence_token_is_returned():
    assert greedy_agreement([5, 6, 7, 2], [5, 6, 7, 2], 8, EOS) == GreedyAgreement(EQUAL)
    # specdec returns the EOS that ended the generation; onnxruntime-genai leaves it out
    assert greedy_agreement([5, 6, 7, 2], [5, 6, 7], 8, EOS) == GreedyAgreement(EQUAL)


def test_tokens_beyond_max_new_tokens_are_told_apart_from_a_difference():
    assert greedy_agreement([5, 6, 7, 8], [5, 6, 7, 8, 9, 10], 4, EOS) == GreedyAgreement(PAST_MAX_NEW_TOKENS,
                                                                                          extra_tokens=2)
    # the reference stopped at EOS before the limit: going on is a difference, where it stopped
    assert greedy_agreement([5, 6, 2], [5, 6, 7, 8], 4, EOS) == GreedyAgreement(DIFFERS, position=2)
    # the same length, different tokens: where they first part
    assert greedy_agreement([5, 6, 7, 8], [5, 9, 7, 8], 4, EOS) == GreedyAgreement(DIFFERS, position=1)
    # stopping early is a difference, where the anchor stopped
    assert greedy_agreement([5, 6, 7, 8], [5, 6], 4, EOS) == GreedyAgreement(DIFFERS, position=2)


def test_anchor_rate_counts_only_the_tokens_asked_for():
    assert AnchorRun("x", "p", list(range(132)), 2.0, max_new_tokens=128).tokens_per_second == 64.0
    assert AnchorRun("x", "p", list(range(100)), 2.0, max_new_tokens=128).tokens_per_second == 50.0
    assert AnchorRun("x", "p", list(range(132)), 2.0).tokens_per_second == 66.0


def test_anchor_rows_say_how_each_run_disagrees():
    baseline = {"a": [1, 3, 4, 5], "b": [1, 2, 9, 9]}
    runs = [AnchorRun("tf lookup", "a", [1, 3, 4, 5, 6, 7], 1.0, 4),  # 2 past the limit
            AnchorRun("tf lookup", "b", [1, 2, 8, 9], 1.0, 4),  # differs at token 2
            AnchorRun("tf greedy", "a", [1, 3, 4, 5], 1.0, 4), AnchorRun("tf greedy", "b", [1, 2, 9, 9, 2], 1.0, 4),
            AnchorRun("genai", "b", [1, 2, 8, 9], 1.0, 4), AnchorRun("genai", "b", [1, 2, 8, 9], 1.0, 4)]
    spec_rows = [{"group": "g", "config": c, "tokens_per_second": 8.0} for c in ("plain", "ngram")]
    gaps = []

    def logit_gap(prompt_id, position):
        gaps.append((prompt_id, position))
        return 0.0004

    rows = anchor_rows(runs, spec_rows, {"a": "g", "b": "g"}, baseline,
                       {"tf greedy": "plain", "tf lookup": "ngram", "genai": "plain"}, 4, EOS, logit_gap)
    by_system = {r["system"]: r for r in rows}
    assert by_system["tf greedy"]["greedy_equal"] == "2/2" and by_system["tf greedy"]["greedy_disagreements"] == []
    lookup = by_system["tf lookup"]
    assert lookup["greedy_equal"] == "0/2" and gaps == [("b", 2)]
    assert lookup["tokens_per_second"] == 4.0  # the two tokens past the limit do not count
    cell = _agreement_cell(lookup, 4)
    assert cell == "0/2; 1 equal over all 4 tokens, then went on: +2; b differs from token 2 (top-2 logit gap 0.0004)"
    # the same parting point, met again by another system or repeat, is looked up once and told once
    assert _agreement_cell(by_system["genai"], 4) == "0/2; b differs from token 2 (top-2 logit gap 0.0004) (x2)"
    assert gaps == [("b", 2)]
    notes = "\n".join(_agreement_notes(rows, 4))
    assert "tf lookup returned more tokens than the 4 asked for" in notes and "near-tie" in notes
    assert _agreement_notes([by_system["tf greedy"]], 4) == []
