"""The load generator's pure math (specdec.benchmarks.serve_load_stats): exact hand-made cases."""

from __future__ import annotations

import numpy as np
import pytest

from specdec.benchmarks.serve_load_stats import (GoodputTargets, achieved_rate, arrival_times, count_good,
                                                 inter_token_latencies, meets_targets, percentile, percentiles,
                                                 time_per_output_token)


def test_percentiles_interpolate_linearly_and_are_none_when_empty():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)  # 1 + 0.9 * 3
    assert percentile([], 50) is None
    assert percentiles([0.0, 10.0], "itl") == {"itl_p50": 5.0, "itl_p90": 9.0, "itl_p99": pytest.approx(9.9)}
    assert percentiles([], "ttft", (50,)) == {"ttft_p50": None}


def test_constant_arrivals_are_evenly_spaced_from_zero():
    assert arrival_times(3, 2.0, 0, "constant").tolist() == [0.0, 0.5, 1.0]
    assert arrival_times(1, 5.0, 0, "constant").tolist() == [0.0]
    assert arrival_times(0, 5.0, 0).tolist() == []
    with pytest.raises(ValueError, match="rate > 0"):
        arrival_times(3, 0.0, 0)
    with pytest.raises(ValueError, match="unknown arrivals 'burst'"):
        arrival_times(3, 1.0, 0, "burst")


def test_poisson_arrivals_are_seeded():
    first = arrival_times(6, 4.0, (7, 1))
    assert first[0] == 0.0 and np.all(np.diff(first) > 0)
    assert arrival_times(6, 4.0, (7, 1)).tolist() == first.tolist()
    assert arrival_times(6, 4.0, (7, 2)).tolist() != first.tolist()  # another round draws another schedule
    assert arrival_times(6, 4.0, 8).tolist() != arrival_times(6, 4.0, 7).tolist()


def test_poisson_gaps_are_exponential_with_mean_one_over_rate():
    gaps = np.diff(arrival_times(40_001, 4.0, 0))
    # exponential: mean 1/rate, standard deviation = mean, P(gap > mean) = 1/e; constant gaps have none of these
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.03)
    assert np.mean(gaps > 0.25) == pytest.approx(np.exp(-1), abs=0.01)


def test_inter_token_latencies_one_gap_per_chunk_without_counts():
    assert inter_token_latencies([1.0, 1.25, 1.75]) == [0.25, 0.5]
    assert inter_token_latencies([0.5]) == []
    assert inter_token_latencies([]) == []
    # counts on some chunks only cannot be split: a gap per chunk, as vLLM's benchmark_serving
    assert inter_token_latencies([1.0, 1.25, 1.75], [1, 2]) == [0.25, 0.5]


def test_inter_token_latencies_split_a_multi_token_chunk_into_per_token_gaps():
    # chunks carry 1, 1 and 3 tokens: the last chunk's 0.75 s gap is three gaps of 0.25 s
    assert inter_token_latencies([1.0, 1.5, 2.25], [1, 2, 5]) == [0.5, 0.25, 0.25, 0.25]
    # the first chunk's own tokens (its TTFT) give no gap
    assert inter_token_latencies([1.0, 1.5], [4, 5]) == [0.5]
    # a chunk with no new token passes its gap on: 1.0 -> 1.5 is spread over the 2 tokens of the 1.5 s chunk
    assert inter_token_latencies([1.0, 1.25, 1.5], [1, 1, 3]) == [0.25, 0.25]


def test_time_per_output_token_is_vllms_tpot():
    assert time_per_output_token([0.5, 0.75, 1.5], 5) == 0.25  # (1.5 - 0.5) / 4
    assert time_per_output_token([0.5], 1) == 0.0
    assert time_per_output_token([], 0) == 0.0


def test_goodput_targets_are_inclusive_and_optional():
    targets = GoodputTargets(ttft=0.5, itl=0.1)
    assert meets_targets(0.5, 0.1, 99.0, targets)  # on the bound counts as met; no e2e target
    assert not meets_targets(0.5000001, 0.1, 0.0, targets)
    assert not meets_targets(0.1, 0.1000001, 0.0, targets)
    assert not meets_targets(0.1, 0.05, 2.5, GoodputTargets(ttft=0.5, itl=0.1, e2el=2.0))
    assert meets_targets(9.0, 9.0, 9.0, GoodputTargets(ttft=None, itl=None))
    assert count_good([0.1, 0.6, 0.2, 0.5], [0.05, 0.05, 0.2, 0.1], [1.0] * 4, targets) == 2
    assert count_good([], [], [], targets) == 0
    with pytest.raises(ValueError, match="one entry per request"):
        count_good([0.1], [], [1.0], targets)


def test_achieved_rate_pools_the_gaps_of_every_round():
    assert achieved_rate([[0.0, 0.5, 1.0], [0.0, 1.0]]) == 1.5  # 3 gaps in 2 s
    assert achieved_rate([[2.0, 2.5]]) == 2.0
    assert achieved_rate([[0.0]]) is None
    assert achieved_rate([]) is None
