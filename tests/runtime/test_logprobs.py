"""logprobs: read from the target's rows, the same with and without drafts, top-1 the greedy token."""

from __future__ import annotations

import numpy as np
import pytest

from specdec.runtime.engine import Engine, GenerationConfig
from specdec.runtime.logprobs import log_softmax, token_logprobs
from specdec.runtime.sampling import SamplingConfig


def test_token_logprobs_are_the_log_softmax_of_the_processed_rows():
    logits = np.array([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 3.0, 1.0]], dtype=np.float32)
    out = token_logprobs(logits, [1, 2], SamplingConfig(temperature=2.0, logit_bias=((3, 1.0),)), None, top=2)
    expected = log_softmax(np.array([[2.0, 1.0, 0.0, 0.0], [0.0, 3.0, 3.0, 2.0]]) / 2.0)
    np.testing.assert_allclose(out.chosen, [expected[0, 1], expected[1, 2]])
    assert out.top_ids.tolist() == [[0, 1], [1, 2]]  # a tie keeps the lower id first
    np.testing.assert_allclose(out.top_values, [[expected[0, 0], expected[0, 1]], [expected[1, 1], expected[1, 2]]])


def test_greedy_reads_temperature_one_and_a_mask_removes_tokens():
    logits = np.array([[1.0, 2.0, 3.0]])
    out = token_logprobs(logits, [1], SamplingConfig(), None, top=1, mask=np.array([[True, True, False]]))
    np.testing.assert_allclose(out.chosen, [np.log(np.exp(2) / (np.exp(1) + np.exp(2)))])
    assert out.top_ids.tolist() == [[1]]


def test_bad_top_is_refused():
    with pytest.raises(ValueError, match="top"):
        token_logprobs(np.zeros((1, 4)), [0], SamplingConfig(), None, top=21)


@pytest.fixture(scope="module")
def engine(tiny_artifacts):
    return Engine.load(tiny_artifacts["llama"], provider="cpu", threads=1)


def _logprobs(result_iterations):
    chosen, top = [], []
    for iteration in result_iterations:
        chosen.extend(iteration.logprobs.chosen.tolist())
        top.extend(iteration.logprobs.top_ids.tolist())
    return np.array(chosen), top


@pytest.mark.parametrize("artifact, drafter, settings", [
    ("tiny_self_draft_artifact", "model", dict(repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.2)),
    ("tiny_near_draft_artifact", "model", {}),
    ("tiny_artifacts", "prediction", {}),
])
def test_logprobs_agree_with_and_without_drafts(request, artifact, drafter, settings):
    folder = request.getfixturevalue(artifact)
    engine = Engine.load(folder["llama"] if artifact == "tiny_artifacts" else folder, provider="cpu", threads=1)
    ids = engine.prompt_ids("one two three one two three one two")
    runs = {}
    for kind in ("none", drafter):
        iterations = []
        config = GenerationConfig(max_new_tokens=32, drafter="none" if kind == "none" else "model", num_draft_tokens=3,
                                  logprobs=5, **settings)
        if kind == "prediction":
            config = GenerationConfig(max_new_tokens=32, num_draft_tokens=3, logprobs=5, drafter="ngram",
                                      prediction=tuple(runs["none"][0].token_ids))
        result = engine.generate(ids, config, on_iteration=iterations.append)
        runs[kind] = (result, *_logprobs(iterations))
    plain, spec = runs["none"], runs[drafter]
    assert spec[0].stats.accepted > 0  # accepted drafts' logprobs are read from the target's rows
    # the self-draft and the exact prediction reach bonus rows; the near draft is also rejected (recovered tokens)
    assert spec[0].stats.bonus_tokens > 0 if artifact != "tiny_near_draft_artifact" else spec[0].stats.acceptance_tests > spec[0].stats.accepted
    assert spec[0].token_ids == plain[0].token_ids
    np.testing.assert_allclose(spec[1], plain[1], atol=1e-4)
    assert [row[0] for row in spec[2]] == spec[0].token_ids  # greedy: top-1 is the committed token
    assert len(spec[1]) == len(spec[0].token_ids)


def test_logprobs_equal_a_fresh_forward_over_the_output(engine):
    ids = engine.prompt_ids("Hello world")
    iterations = []
    result = engine.generate(ids, GenerationConfig(max_new_tokens=12, drafter="none", logprobs=0),
                             on_iteration=iterations.append)
    chosen, _ = _logprobs(iterations)
    logits = engine.target.forward(engine.target.new_cache(), ids + result.token_ids[:-1])
    rows = log_softmax(logits[len(ids) - 1:])
    np.testing.assert_allclose(chosen, rows[np.arange(len(result.token_ids)), result.token_ids], atol=1e-4)


def test_prompt_logprobs_are_the_generations_own_at_the_same_positions_in_chunks_of_any_size(engine):
    """Scoring prompt + answer (completions' echo) gives each answer token the logprob its generation reported,
    the first token none, and feeding the prompt in chunks of 3 rows changes nothing."""
    from specdec.runtime.prompt_logprobs import prompt_logprobs

    prompt = engine.prompt_ids("one, two, three, one, two, three, four")
    iterations = []
    result = engine.generate(prompt, GenerationConfig(max_new_tokens=10, logprobs=3, num_draft_tokens=3),
                             on_iteration=iterations.append)
    chosen, top = _logprobs(iterations)
    scored = engine.prompt_logprobs(prompt + result.token_ids, top=3)
    assert len(scored) == len(prompt) + len(result.token_ids) - 1
    answer = slice(len(prompt) - 1, None)
    np.testing.assert_allclose(scored.chosen[answer], chosen[:len(result.token_ids)], atol=1e-4)
    assert scored.top_ids[answer].tolist() == top[:len(result.token_ids)]
    chunked = prompt_logprobs(engine.target, prompt + result.token_ids, 3, chunk=3)
    np.testing.assert_allclose(chunked.chosen, scored.chosen, atol=1e-5)
    assert len(engine.prompt_logprobs(prompt[:1])) == 0
