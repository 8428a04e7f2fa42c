import pytest

from specdec.runtime.call_costs import TargetCallCosts, relative_costs_from_step_times


def feed(costs: TargetCallCosts, tokens: int, seconds: float, times: int = 3) -> None:
    for _ in range(times):
        costs.observe(tokens, seconds)


def test_measured_lengths_give_their_own_ratio():
    costs = TargetCallCosts(prior={5: 3.0}, prior_verify_cost=0.5)
    feed(costs, 1, 0.020)
    feed(costs, 5, 0.023)
    assert costs.relative(1) == 1.0
    assert costs.relative(5) == pytest.approx(1.15)  # measured beats the prior table


def test_a_length_needs_min_calls_before_it_is_trusted():
    costs = TargetCallCosts(prior={5: 1.4})
    feed(costs, 1, 0.020)
    feed(costs, 5, 0.023, times=2)
    assert costs.relative(5) == pytest.approx(1.4)
    costs.observe(5, 0.023)
    assert costs.relative(5) == pytest.approx(1.15)


def test_unmeasured_lengths_use_the_prior_table_then_a_line_then_the_prior_line():
    costs = TargetCallCosts(prior={3: 1.2}, prior_verify_cost=0.1)
    assert costs.relative(3) == pytest.approx(1.2)
    assert costs.relative(4) == pytest.approx(1.3)  # prior line 1 + 0.1 * 3
    feed(costs, 1, 0.010)
    feed(costs, 2, 0.012)  # measured line: t(n) = 8 ms + 2 ms n
    assert costs.relative(3) == pytest.approx(1.2)  # the prior table still wins over a guess
    assert costs.relative(6) == pytest.approx(20 / 10)


def test_never_cheaper_than_a_one_token_call():
    costs = TargetCallCosts(prior={2: 0.9})
    assert costs.relative(2) == 1.0
    feed(costs, 1, 0.020)
    feed(costs, 4, 0.018)  # timing noise
    assert costs.relative(4) == 1.0
    assert costs.relative(8) == 1.0  # the line through them slopes down: floored


def test_drift_is_followed():
    costs = TargetCallCosts(smoothing=0.5)
    feed(costs, 1, 0.010)
    feed(costs, 2, 0.011)
    for _ in range(20):  # the machine slows down for 2-token calls
        costs.observe(2, 0.015)
    assert costs.relative(2) == pytest.approx(1.5, abs=1e-3)


def test_one_token_seconds_takes_the_call_length_out():
    costs = TargetCallCosts(prior={4: 1.3})
    assert costs.one_token_seconds(4, 0.013) == pytest.approx(0.010)


def test_relative_costs_from_step_times():
    assert relative_costs_from_step_times([0.02, 0.022, 0.03]) == pytest.approx({1: 1.0, 2: 1.1, 3: 1.5})
    assert relative_costs_from_step_times([]) == {}


def test_shared_by_threads():
    # One engine's requests share the table: lengths added by one thread while another reads.
    import sys
    import threading

    costs = TargetCallCosts()
    errors = []
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible

    def writer(offset):
        for n in range(1, 400):
            costs.observe(offset + n, 0.01 + 0.001 * n)

    def reader():
        try:
            for _ in range(2000):
                costs.relative(7)
        except RuntimeError as err:  # "dictionary changed size during iteration"
            errors.append(err)

    threads = [threading.Thread(target=writer, args=(i * 1000,)) for i in range(3)] + \
              [threading.Thread(target=reader) for _ in range(3)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors
    assert sum(costs._calls.values()) == 3 * 399
