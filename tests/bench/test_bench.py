import json

from click.testing import CliRunner

from specdec.cli.main import main
from specdec.data import HELDOUT_PROMPTS_FILE, PROMPTS_FILE
from specdec.runtime.prompts import load_prompts


def test_shipped_prompt_set_has_both_groups():
    cases = load_prompts(PROMPTS_FILE)
    groups = [c.group for c in cases]
    assert groups.count("grounded") == 3 and groups.count("open") == 3
    assert all(len(c.prompt.split()) > 150 for c in cases if c.group == "grounded")


def test_bench_writes_table_json_and_plot(tiny_artifacts, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"id": "g", "group": "grounded", "prompt": "one, two, three, one, two, three, one,", "chat": False})
        + "\n" + json.dumps({"id": "o", "group": "open", "prompt": "Hello world", "chat": False}) + "\n")
    out = tmp_path / "out"
    results = tmp_path / "RESULTS.md"
    result = CliRunner().invoke(main, ["bench", str(tiny_artifacts["llama"]), "--prompts", str(prompts),
                                       "--max-new-tokens", "8", "--repeats", "2", "-k", "3", "--output", str(out),
                                       "--results", str(results), "--provider", "cpu"])
    assert result.exit_code == 0, result.output
    document = json.loads((out / "bench.json").read_text())
    configs = {row["config"] for row in document["rows"]}
    assert configs == {"target-only", "model K=3", "model auto", "ngram K=3", "ngram auto"}
    assert all(row["greedy_equal"] for row in document["rows"])
    baseline = [r for r in document["rows"] if r["config"] == "target-only"]
    assert all(r["speedup"] == 1.0 for r in baseline)
    systems = {a["system"] for a in document["anchors"]}
    assert systems == {"transformers greedy", "transformers prompt-lookup"}
    assert all(a["greedy_equal"] == "1/1" for a in document["anchors"] if a["system"] == "transformers greedy")
    assert (out / "bench.png").stat().st_size > 1000
    text = results.read_text()
    assert "| grounded | model K=3 |" in text and "## Anchors" in text
    # the export choices that change its speed
    assert "; target graph: float32 LM head, calls over 64 tokens (prefills) take onnxruntime's causal attention kernel" in text
    # A prompt file of one's own is named, not passed off as the shipped set's version.
    assert document["meta"]["prompt_set_version"] is None and "- prompt set: p.jsonl (2 prompts" in text
    assert (tmp_path / "RESULTS.png").stat().st_size > 1000 and "(RESULTS.png)" in text
    # the replay of the first repeat's greedy output: the bound is at least every fixed K replayed
    replays = {r["prompt"]: r for r in document["replay"]}
    assert set(replays) == {"g", "o"} and "## What n-gram drafting could reach" in text
    for r in replays.values():
        assert set(r["replay_speedup"]) == {"3", "6"}
        assert all(r["oracle_speedup"] >= s - 1e-9 for s in r["replay_speedup"].values())


def test_step_time_table(tiny_artifacts, tiny_target_only_artifact, tmp_path):
    results = tmp_path / "steps.md"
    result = CliRunner().invoke(main, ["bench", str(tiny_artifacts["llama"]), "--steps", "--compare",
                                       f"plain={tiny_target_only_artifact}", "--results", str(results),
                                       "--provider", "cpu"])
    assert result.exit_code == 0, result.output
    table = results.read_text()
    assert "| 1024 |" not in table  # the tiny models hold 512 positions: skipped
    for past in (64, 256):
        assert f"| specdec | {past} |" in table and f"| plain | {past} |" in table
    assert "5 / 1" in table
    bad = CliRunner().invoke(main, ["bench", str(tiny_artifacts["llama"]), "--steps", "--compare", "nopath"])
    assert bad.exit_code != 0 and "NAME=ARTIFACT" in bad.output


def test_held_out_prompt_set_loads_and_shares_no_prompt_with_the_bench_set():
    heldout = load_prompts(HELDOUT_PROMPTS_FILE)
    bench = load_prompts(PROMPTS_FILE)
    assert {p.group for p in heldout} == {"grounded", "open"} and len(heldout) == 12
    assert not {p.id for p in heldout} & {p.id for p in bench}
    assert not {p.prompt for p in heldout} & {p.prompt for p in bench}


def test_step_rounds_give_medians_and_paired_ratios():
    from specdec.benchmarks.steps import median_of_rounds, ratio_table, round_ratios

    # a machine that slows down 2x between rounds: each round's ratio stays 0.8, the medians drift
    rounds = [{("specdec", 64, 1): 0.8 * k, ("genai", 64, 1): 1.0 * k, ("plain", 64, 1): 3.0 * k} for k in (1, 2, 4)]
    rounds[2].pop(("genai", 64, 1))  # a round that missed one side gives no ratio
    assert median_of_rounds(rounds) == {("specdec", 64, 1): 1.6, ("genai", 64, 1): 1.5, ("plain", 64, 1): 6.0}
    ratios = round_ratios(rounds, "specdec", "genai")
    assert ratios == {(64, 1): [0.8, 0.8]}
    assert "| 64 | 0.80x (0.80-0.80) |" in ratio_table(ratios, "specdec", "genai")


def test_paired_prefills_alternate_who_goes_first_and_time_one_prefill_each(tiny_target_only_artifact, monkeypatch):
    from specdec.cli import bench
    from specdec.cli.bench import _paired_prefills
    from specdec.runtime.engine import Engine

    engine = Engine.load(tiny_target_only_artifact, provider="cpu")
    order = []

    class Genai:
        def prefills(self, ids, count=1):
            order.append("genai")
            return [0.5] * count

    generate = engine.generate
    engine.generate = lambda ids, config: order.append("specdec") or generate(ids, config)
    monkeypatch.setattr(bench, "_settle", lambda: order.append("settle"))
    pairs = _paired_prefills(engine, Genai(), {"a": [5, 6, 7], "b": [8, 9]}, 3, lambda message: None)
    assert sorted(pairs) == ["a", "b"] and all(len(rounds) == 3 for rounds in pairs.values())
    assert all(genai == 0.5 and 0 < mine < 5 for rounds in pairs.values() for mine, genai in rounds)
    # per prompt: genai's warm-up prefill, then rounds led by specdec, genai, specdec; each timed
    # prefill starts on a settled machine (the other side's tail slows a call that starts right after it)
    assert order[:13] == ["genai", "settle", "specdec", "settle", "genai", "settle", "genai", "settle", "specdec",
                          "settle", "specdec", "settle", "genai"]
