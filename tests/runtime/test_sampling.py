import numpy as np
import pytest

from specdec.models.errors import GenerationError
from specdec.runtime.sampling import SamplingConfig, next_token, process_logits, sample_token


def test_greedy_is_one_hot_at_argmax():
    logits = np.array([[0.1, 2.0, -1.0], [3.0, 2.9, 0.0]])
    probs = process_logits(logits, SamplingConfig(temperature=0.0))
    assert probs.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


def test_temperature_softmax():
    logits = np.array([[np.log(1.0), np.log(3.0)]])
    probs = process_logits(logits, SamplingConfig(temperature=1.0))
    np.testing.assert_allclose(probs, [[0.25, 0.75]])
    hot = process_logits(logits, SamplingConfig(temperature=2.0))  # sqrt(1):sqrt(3)
    np.testing.assert_allclose(hot, [[1 / (1 + np.sqrt(3)), np.sqrt(3) / (1 + np.sqrt(3))]])


def test_top_k_keeps_k_most_likely():
    logits = np.log(np.array([[0.1, 0.4, 0.2, 0.3]]))
    probs = process_logits(logits, SamplingConfig(temperature=1.0, top_k=2))
    np.testing.assert_allclose(probs, [[0.0, 4 / 7, 0.0, 3 / 7]])


def test_top_p_keeps_smallest_set_reaching_p():
    logits = np.log(np.array([[0.1, 0.4, 0.2, 0.3]]))
    # 0.4 + 0.3 = 0.7 >= 0.65: keep two tokens
    probs = process_logits(logits, SamplingConfig(temperature=1.0, top_p=0.65))
    np.testing.assert_allclose(probs, [[0.0, 4 / 7, 0.0, 3 / 7]])
    # tiny p still keeps the most likely token
    probs = process_logits(logits, SamplingConfig(temperature=1.0, top_p=0.01))
    np.testing.assert_allclose(probs, [[0.0, 1.0, 0.0, 0.0]])


def test_top_k_and_top_p_compose():
    logits = np.log(np.array([[0.05, 0.4, 0.25, 0.3]]))
    probs = process_logits(logits, SamplingConfig(temperature=1.0, top_k=3, top_p=0.6))
    # top-3 renormalised: .4/.95, .3/.95, .25/.95; mass before the 2nd is .42 < .6, before the 3rd .74
    np.testing.assert_allclose(probs, [[0.0, 4 / 7, 0.0, 3 / 7]])


def test_sample_token_is_seeded_and_follows_probs():
    probs = np.array([0.2, 0.5, 0.3])

    def draws(seed):
        rng = np.random.default_rng(seed)  # one generator per sequence, as a request has
        return [sample_token(probs, rng) for _ in range(40)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    assert len(set(draws(7))) == 3  # the sequence moves: equality above is not of constants
    rng = np.random.default_rng(0)
    draws = np.bincount([sample_token(probs, rng) for _ in range(20000)], minlength=3) / 20000
    np.testing.assert_allclose(draws, probs, atol=0.015)


def test_sample_never_picks_zero_probability():
    probs = np.array([0.0, 1.0, 0.0])
    rng = np.random.default_rng(0)
    assert {sample_token(probs, rng) for _ in range(1000)} == {1}


def test_next_token_greedy_is_argmax():
    assert next_token(np.array([0.0, 5.0, 1.0]), SamplingConfig(), np.random.default_rng(0)) == 1


@pytest.mark.parametrize("config, message", [
    (SamplingConfig(temperature=-0.1), "temperature"),
    (SamplingConfig(temperature=1e-310), "temperature must be 0 .greedy. or in"),  # gave NaN probabilities
    (SamplingConfig(temperature=1e-4), "temperature"),
    (SamplingConfig(temperature=float("nan")), "temperature"),
    (SamplingConfig(temperature=float("inf")), "temperature"),
    (SamplingConfig(temperature=1e6), "temperature"),
    (SamplingConfig(temperature="0.7"), "temperature must be a number"),
    (SamplingConfig(temperature=True), "temperature must be a number"),
    (SamplingConfig(top_k=2.5), "top_k must be an integer"),
    (SamplingConfig(top_p=float("nan")), "top_p"),
    (SamplingConfig(top_p="0.9"), "top_p must be a number"),
    (SamplingConfig(top_p=0.0), "top_p"),
    (SamplingConfig(top_p=1.5), "top_p"),
    (SamplingConfig(top_k=-1), "top_k"),
])
def test_bad_settings_raise(config, message):
    with pytest.raises(GenerationError, match=message):
        config.validate()


@pytest.mark.parametrize("temperature", [1e-3, 0.01, 1.0, 100.0])
def test_every_accepted_temperature_gives_a_distribution(temperature):
    """At the ends of the accepted range, even with float32-extreme logits, rows are finite and sum to 1."""
    SamplingConfig(temperature=temperature).validate()
    logits = np.array([[3e38, -3e38, 0.0, 1.0], [0.0, 1e-3, 2e-3, -5.0]], dtype=np.float32)
    probs = process_logits(logits, SamplingConfig(temperature=temperature, top_k=3, top_p=0.9))
    assert np.isfinite(probs).all()
    np.testing.assert_allclose(probs.sum(axis=-1), 1.0)
    assert probs[0].argmax() == 0
