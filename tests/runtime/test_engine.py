"""The library API: streaming, stop strings, threads, bad requests."""

import threading

import numpy as np
import pytest

from specdec.models.errors import GenerationError
from specdec.runtime.engine import Engine, GenerationConfig
from specdec.runtime.text import StopStringFilter, tokens_released


@pytest.fixture(scope="module")
def engine(tiny_artifacts):
    return Engine.load(tiny_artifacts["llama"], provider="cpu")


def test_stream_pieces_add_up_to_the_text(engine):
    config = GenerationConfig(max_new_tokens=30, temperature=0.8, seed=5)
    stream = engine.stream("Hello world", config)
    pieces = list(stream)
    result = stream.result
    assert "".join(pieces) == result.text == engine.codec.decode(result.token_ids)
    assert result.finish_reason in ("length", "eos")


def test_streaming_is_correct_for_multibyte_characters(engine):
    # Feed the ids of a text with 2-, 3- and 4-byte characters through the streaming decoder.
    text = "Über 東京 café 🙂 done"
    ids = engine.codec.encode(text, add_special_tokens=False)
    decoder = engine.codec.decode_stream()
    pieces = [decoder.push(i) for i in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)


def test_stop_string_filter_holds_back_partial_matches():
    f = StopStringFilter(("STOP",))
    assert f.feed("abc ST") == "abc "
    assert f.feed("O") == ""
    assert f.feed("P and more") == ""
    assert f.stopped and f.final_text == "abc "
    g = StopStringFilter(("STOP",))
    assert g.feed("abc ST") == "abc " and g.feed("ART") == "START" and g.flush() == ""
    assert g.final_text == "abc START"


def test_stop_strings_end_generation(engine):
    free = engine.generate("The quick brown fox", GenerationConfig(max_new_tokens=40))
    stop = free.text[5:8]
    assert stop and stop in free.text
    stopped = engine.generate("The quick brown fox", GenerationConfig(max_new_tokens=40, stop_strings=(stop,)))
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: free.text.index(stop)]
    assert len(stopped.token_ids) < len(free.token_ids)


def test_eos_stops_inside_an_accepted_block(tiny_self_draft_artifact):
    """With draft == target, 5 tokens commit per call; an EOS in the middle must end the output there."""
    engine = Engine.load(tiny_self_draft_artifact, provider="cpu")
    free = engine.generate("The quick brown fox", GenerationConfig(max_new_tokens=30, num_draft_tokens=4))
    assert free.stats.tokens_per_target_call > 4
    eos = free.token_ids[7]  # committed in the middle of the second verify block
    first = free.token_ids.index(eos)
    engine.eos_token_ids = {eos}
    ended = engine.generate("The quick brown fox", GenerationConfig(max_new_tokens=30, num_draft_tokens=4))
    assert ended.finish_reason == "eos"
    assert ended.token_ids == free.token_ids[: first + 1]


def test_ngram_min_defaults_by_draft_length(engine):
    # auto learns per situation whether 1-token matches pay; a fixed K would draft after every one
    assert GenerationConfig().ngram_min_for(adaptive=True) == 1
    assert GenerationConfig().ngram_min_for(adaptive=False) == 2
    assert GenerationConfig(ngram_min=3).ngram_min_for(adaptive=True) == 3
    assert GenerationConfig(ngram_max=1).ngram_min_for(adaptive=False) == 1
    rng = np.random.default_rng(0)
    auto = engine._drafter(GenerationConfig(drafter="ngram"), rng, 10, adaptive=True)
    fixed = engine._drafter(GenerationConfig(drafter="ngram"), rng, 10, adaptive=False)
    assert (auto.index.min_n, fixed.index.min_n) == (1, 2)


def test_stats_by_situation_add_up_to_the_totals(engine):
    result = engine.generate("one two three one two three one two", GenerationConfig(
        max_new_tokens=40, drafter="ngram", num_draft_tokens="auto"))
    stats = result.stats
    assert len(stats.by_situation) >= 2  # the tiny model's output recurs in several ways
    for name, total in (("iterations", stats.iterations), ("drafted", stats.drafted), ("accepted", stats.accepted),
                        ("acceptance_tests", stats.acceptance_tests)):
        assert sum(counts[name] for counts in stats.by_situation.values()) == total
    assert "iterations by drafting situation" in stats.summary()


def test_chat_template(engine):
    ids = engine.prompt_ids("hi", chat=True)
    text = engine.codec.tokenizer.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>user\nhi<|im_end|>") and text.endswith("<|im_start|>assistant\n")


def test_threads_give_the_same_results_as_one_at_a_time(engine):
    # "auto" K follows measured timings, so only its greedy output is timing-independent.
    configs = [GenerationConfig(max_new_tokens=24, temperature=t, seed=s, num_draft_tokens=k)
               for t, s, k in [(0.0, 0, 2), (1.0, 1, 3), (0.7, 2, 1), (1.2, 3, 4), (0.0, 4, 5), (0.0, 5, "auto")]]
    prompts = ["The quick brown fox", "Hello world", "def add(a, b):", "Once upon a time", "Paris", "one, two"]
    sequential = [engine.generate(p, c).token_ids for p, c in zip(prompts, configs)]
    parallel = [None] * len(configs)

    def run(i):
        parallel[i] = engine.generate(prompts[i], configs[i]).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(configs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert parallel == sequential


@pytest.mark.parametrize("config, message", [
    (GenerationConfig(temperature=-1), "temperature"),
    (GenerationConfig(top_p=0), "top_p"),
    (GenerationConfig(top_k=-2), "top_k"),
    (GenerationConfig(num_draft_tokens=0), "num_draft_tokens"),
    (GenerationConfig(max_new_tokens=0), "max_new_tokens"),
    (GenerationConfig(drafter="magic"), "drafter"),
])
def test_bad_requests_raise_before_running(engine, config, message):
    with pytest.raises(GenerationError, match=message):
        engine.stream("hi", config)


def test_prompt_longer_than_positions_names_both_lengths(engine):
    with pytest.raises(GenerationError, match=r"prompt of 600 tokens .* 512 positions"):
        engine.generate([5] * 600)


def test_generation_stops_at_max_positions(engine):
    result = engine.generate([5] * 505, GenerationConfig(max_new_tokens=50, num_draft_tokens=4))
    assert result.finish_reason == "max_positions"
    # 512 positions: the token at index 512 is produced from position 511 and never fed back.
    assert 505 + len(result.token_ids) == 513


def test_model_drafter_needs_a_draft(tiny_target_only_artifact):
    engine = Engine.load(tiny_target_only_artifact, provider="cpu")
    with pytest.raises(GenerationError, match="no draft model"):
        engine.stream("hi", GenerationConfig(drafter="model"))  # refused before anything runs
    assert engine.generate("hi", GenerationConfig(max_new_tokens=5)).stats.drafter == "ngram"


def test_a_drafter_without_a_draft_length_policy_is_refused(tiny_target_only_artifact):
    """The loop never decodes plainly in silence because a drafter came without its K policy."""
    import numpy as np

    from specdec.models.errors import GenerationError
    from specdec.runtime.drafters import NgramDrafter
    from specdec.runtime.loop import DecodeRequest, decode
    from specdec.runtime.sampling import SamplingConfig

    engine = Engine.load(tiny_target_only_artifact, provider="cpu")
    request = DecodeRequest([1, 2, 3], 4, SamplingConfig(), frozenset(), engine.max_positions)
    with pytest.raises(GenerationError, match="needs a draft-length policy"):
        next(decode(engine.target, engine.target.new_cache(), request, np.random.default_rng(0), NgramDrafter()))


def test_tokens_released_counts_the_tokens_whose_text_was_sent_whole():
    """A token's text that a stop string's first characters hold back is not counted, nor a half character until
    the token that completes it; counting on from a known count gives the same."""
    ends = [3, None, 5, 9]
    assert [tokens_released(ends, released) for released in (0, 2, 3, 4, 5, 8, 9)] == [0, 0, 1, 1, 3, 3, 4]
    assert tokens_released(ends, 9, start=3) == 4 and tokens_released([None, None], 5) == 0
