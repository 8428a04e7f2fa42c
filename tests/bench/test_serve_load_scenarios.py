"""The load generator's scenarios, pure parts (serve_load_stats.window_gaps, serve_load_workloads' messages,
serve_load_parts, serve_load_prompts, serve_load_scenario_report): exact hand-made cases."""

from __future__ import annotations

import pytest

from specdec.benchmarks.serve_load_client import Record
from specdec.benchmarks.serve_load_parts import PARTS, add_totals, part_means_ms, parse_ttft_parts, parts_delta
from specdec.benchmarks.serve_load_prompts import (count_tokens, cut_to_tokens, drop_word, prefill_prompt,
                                                   sentence_starts)
from specdec.benchmarks.serve_load_scenario_report import ScenarioCell, scenario_markdown, summarize_scenario
from specdec.benchmarks.serve_load_scenarios import Numbering
from specdec.benchmarks.serve_load_stats import window_gaps
from specdec.benchmarks.serve_load_workloads import FOLLOW_UPS, burst_windows, follow_up, numbered, turn_messages
from specdec.models.errors import SpecdecError

TEXTS = ["Read the passage and answer: who founded the library?\n\nThe library was founded in 1887 by Eleanor "
         "Hartwell. She gave her own books! By 1910 it held 15,000 books.",
         "Write a short poem about the sea at night.",
         "Correct the mistakes in this text:\n\nTeh cat sat on teh mat. It were happy? Yes, it were."]


def test_window_gaps_split_a_running_requests_gaps_into_idle_and_burst():
    times = [0.0, 1.0, 2.0, 3.0, 5.0, 6.0, 7.0]
    # idle gaps lie wholly inside (0, 2.5); burst gaps overlap (2.5, 4): the one cut by the send, the one after
    assert window_gaps(times, (0.0, 2.5), (2.5, 4.0)) == ([1.0, 1.0], [1.0, 2.0])
    assert window_gaps(times, (0.5, 2.5), (2.5, 3.0)) == ([1.0], [1.0])  # the burst ended on a chunk: no gap after
    assert window_gaps(times, (0.0, 0.5), (6.5, 9.0)) == ([], [1.0])
    assert window_gaps([1.0], (0.0, 2.0), (2.0, 3.0)) == ([], [])
    assert window_gaps([], (0.0, 2.0), (2.0, 3.0)) == ([], [])


def test_burst_windows_use_absolute_times_and_count_running_requests_that_ended_first():
    running = [Record("long0", ok=True, started=10.0, chunk_times=[0.1, 0.2, 0.3, 0.5, 0.9, 1.0]),
               Record("long1", ok=True, started=10.05, chunk_times=[0.1, 0.2, 0.3])]  # its last chunk at 10.35
    burst = [Record("b0", ok=True, started=10.3, ttft=0.2), Record("b1", ok=True, started=10.31, ttft=0.4),
             Record("b2", ok=False, started=10.31, error="HTTP 429")]
    result = burst_windows(running, burst, (10.1, 10.3), seconds=2.0)
    # the burst window runs from 10.3 to b1's first token at 10.71
    assert result.idle_gaps == pytest.approx([0.1, 0.1, 0.1])  # long0: 10.1->10.2->10.3; long1: 10.15->10.25
    assert result.burst_gaps == pytest.approx([0.2, 0.4, 0.1])  # long0's 10.3->10.5->10.9; long1's 10.25->10.35
    assert result.ended_early == 1 and result.seconds == 2.0


def test_turn_two_carries_the_first_answer_and_a_follow_up():
    assert turn_messages("Hi", [], []) == [{"role": "user", "content": "Hi"}]
    assert turn_messages("Hi", ["Hello!"], ["And?"]) == [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "And?"}]
    assert len(turn_messages("Hi", ["a", "b"], ["c", "d"])) == 5
    with pytest.raises(ValueError, match="one follow-up per answer"):
        turn_messages("Hi", ["a"], [])
    assert len(set(FOLLOW_UPS)) == len(FOLLOW_UPS)
    # conversations side by side ask different follow-ups; one conversation never repeats one
    assert len({follow_up(n, 2) for n in range(len(FOLLOW_UPS))}) == len(FOLLOW_UPS)
    assert len({follow_up(7, t) for t in range(2, 2 + len(FOLLOW_UPS))}) == len(FOLLOW_UPS)
    assert follow_up(3, 2) == follow_up(3, 2) and numbered("Hi", 17) == "Request 17: Hi"


def test_request_numbers_come_in_one_block_per_key_whatever_server_asks():
    numbers = Numbering()
    assert numbers.block(("turns", 1, 0, "none"), 3) == range(0, 3)
    assert numbers.block(("turns", 1, 0, "ngram"), 3) == range(3, 6)
    assert numbers.block(("turns", 1, 0, "none"), 3) == range(0, 3)  # the next server: the same prompts
    assert numbers.block(("burst", 8, 0, "none"), 10) == range(6, 16)


EXPOSITION = """# HELP specdec:ttft_part_seconds Time to first token split by part.
# TYPE specdec:ttft_part_seconds histogram
specdec:ttft_part_seconds_bucket{model_name="m",part="prefill",le="0.5"} 1.0
specdec:ttft_part_seconds_bucket{model_name="m",part="prefill",le="+Inf"} 2.0
specdec:ttft_part_seconds_count{model_name="m",part="prefill"} 2.0
specdec:ttft_part_seconds_sum{model_name="m",part="prefill"} 0.9
specdec:ttft_part_seconds_count{model_name="m",part="server"} 2.0
specdec:ttft_part_seconds_sum{model_name="m",part="server"} 0.004
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_count{model_name="m"} 2.0
vllm:time_to_first_token_seconds_sum{model_name="m"} 1.0
"""


def test_ttft_parts_are_the_mean_of_each_parts_growth_over_a_cell():
    before = parse_ttft_parts(EXPOSITION)
    assert before == {"prefill": (0.9, 2.0), "server": (0.004, 2.0)}
    after = parse_ttft_parts(EXPOSITION.replace("} 0.9", "} 1.5").replace('part="prefill"} 2.0', 'part="prefill"} 4.0')
                             .replace("} 0.004", "} 0.008").replace('part="server"} 2.0', 'part="server"} 4.0')
                             + 'specdec:ttft_part_seconds_sum{model_name="m",part="stream"} 0.002\n'
                             + 'specdec:ttft_part_seconds_count{model_name="m",part="stream"} 2.0\n')
    delta = parts_delta(before, after)
    assert {part: pytest.approx(v) for part, v in delta.items()} == {
        "prefill": (0.6, 2.0), "server": (0.004, 2.0), "stream": (0.002, 2.0)}
    totals: dict[str, list[float]] = {}
    add_totals(totals, delta)
    add_totals(totals, {"prefill": (0.2, 2.0), "server": (0.0, 2.0), "stream": (0.002, 2.0)})
    add_totals(totals, None)  # a round whose /metrics did not answer adds nothing
    means = part_means_ms(totals)
    assert list(means) == ["server", "prefill", "stream", "sum"]  # PARTS' order, then the sum
    assert means["prefill"] == pytest.approx(200.0) and means["server"] == pytest.approx(1.0)
    assert means["sum"] == pytest.approx(202.0)
    # absent metric (another server, an older specdec): nothing, silently
    assert parse_ttft_parts("vllm:num_requests_running 0\n") is None
    assert parts_delta(None, after) is None and part_means_ms({}) == {}
    assert part_means_ms({"prefill": [0.0, 0.0]}) == {}  # nothing counted in the cell
    assert PARTS[0] == "server" and PARTS[-1] == "stream"


def trained_bpe():
    """Return a byte-level BPE trained on TEXTS that adds a BOS token, as SmolLM2's GGUF tokenizer does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    # blank lines ending a text: the merge "\n\n" is learnt, so a cut between two newlines is not stable
    tokenizer.train_from_iterator(TEXTS * 4 + ["The end.\n\n"] * 50, trainers.BpeTrainer(
        vocab_size=300, show_progress=False, special_tokens=["<s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return tokenizer


@pytest.fixture(scope="module")
def bpe():
    return trained_bpe()


def test_prompts_are_cut_to_exactly_n_tokens_bos_included_each_from_its_own_sentence(bpe):
    assert count_tokens(bpe, "") == 1  # the BOS a server adds counts
    for n in (2, 7, 30, 120):
        prompts = [prefill_prompt(bpe, TEXTS, index, n) for index in range(6)]
        assert all(count_tokens(bpe, p) == n for p in prompts), n
        assert len({p[:12] for p in prompts}) == 6  # different starts: no prefix cache holds one for another
    assert prefill_prompt(bpe, TEXTS, 1, 30).startswith("The library was founded in 1887")
    assert sentence_starts("One. Two\nThree") == [0, 5, 9]
    line = "A line that repeats itself."  # a repeated line is one start: its copies share a long prefix
    assert sentence_starts(f"{line}\n{line}\nEnd.") == [0, 2 * len(line) + 2]
    with pytest.raises(SpecdecError, match="too few for"):
        prefill_prompt(bpe, TEXTS, len(sentence_starts("\n\n".join(TEXTS))), 7)
    with pytest.raises(SpecdecError, match="too short"):
        cut_to_tokens(bpe, "Teh cat", 50)


def test_a_cut_inside_a_run_of_newlines_drops_a_word_instead(bpe):
    text = "Correct the mistakes:\n\nTeh cat sat on teh mat."
    ids = bpe.encode(text, add_special_tokens=False).ids
    exact = {count_tokens(bpe, bpe.decode(ids[:cut])) for cut in range(1, len(ids) + 1)}
    missing = [n for n in range(2, len(ids)) if n not in exact]
    assert missing, "the newline run should leave some count that no prefix gives"
    assert cut_to_tokens(bpe, text, missing[0]) is None
    assert drop_word("a b c d", 2) == "a b d" and drop_word("a b", 3) == "a b"
    assert count_tokens(bpe, prefill_prompt(bpe, [text], 0, missing[0])) == missing[0]


def test_scenario_summaries_and_tables_by_hand():
    turns = ScenarioCell("turns", "s", "none", 2, records={
        "turn1": [Record("a", ok=True, ttft=0.4, prompt_tokens=50), Record("b", ok=True, ttft=0.6, prompt_tokens=70)],
        "turn2": [Record("a", ok=True, ttft=0.1, prompt_tokens=150), Record("b", ok=False, error="HTTP 500")]},
        parts={"prefill": [0.3, 3.0], "server": [0.003, 3.0]})
    s = summarize_scenario(turns)
    assert s["turn1"]["ttft_p50"] == pytest.approx(0.5) and s["turn2"]["ttft_p50"] == pytest.approx(0.1)
    assert s["turn2"]["ratio_p50"] == pytest.approx(0.2) and s["turn2"]["prompt_tokens_mean"] == 150
    assert (s["requests"], s["errors"]) == (4, 1) and s["ttft_mean"] == pytest.approx(1.1 / 3)
    assert s["ttft_parts_ms"] == pytest.approx({"server": 1.0, "prefill": 100.0, "sum": 101.0})
    burst = ScenarioCell("burst", "s", "none", 2, idle_gaps=[0.02, 0.02, 0.04], burst_gaps=[0.05, 0.1],
                         records={"running": [Record("l", ok=True, tokens=192)],
                                  "burst": [Record("x", ok=True, ttft=0.3), Record("y", ok=True, ttft=0.5)]})
    b = summarize_scenario(burst)
    assert b["idle_itl_p50"] == pytest.approx(0.02) and b["burst_itl_p99"] == pytest.approx(0.0995)
    assert b["itl_p99_ratio"] == pytest.approx(0.0995 / 0.0396) and b["burst_ttft_p90"] == pytest.approx(0.48)
    assert b["running_tokens"] == [192] and b["ttft_parts_ms"] == {}
    prefill = ScenarioCell("prefill", "s", "none", 100, records={"prefill": [
        Record("p", ok=True, ttft=0.5, prompt_tokens=100), Record("q", ok=True, ttft=0.25, prompt_tokens=100),
        Record("r", ok=True, ttft=None, e2e=0.2, prompt_tokens=None)]})  # no text: its end is its first token
    p = summarize_scenario(prefill)
    assert p["prompt_tokens_per_second"] == 400.0 and p["ttft_median"] == 0.25
    assert p["prompt_tokens_reported"] == [100, None]
    setup = {"setup": "x", "command": "y", "not_run": []}
    assert "| s | 2 | target-only | 2 | 1 (1 failed) | 150 | 0.100 | 0.100 | 0.20x | 0.17x |" in scenario_markdown([s], setup)
    assert "| sum of parts |" in scenario_markdown([s], setup)
    assert "| s | 2 | target-only | 3 |" in scenario_markdown([b], setup)
    assert "| s | 100 | 3 | 100, ? | 0.250 | 400 |" in scenario_markdown([p], setup)
