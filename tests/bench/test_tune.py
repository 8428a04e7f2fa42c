import json
import re
import shutil

import pytest
from click.testing import CliRunner

from specdec.cli.main import main
from specdec.models.manifest import load_manifest
from specdec.runtime.call_costs import non_decreasing
from specdec.runtime.engine import Engine, GenerationConfig
from specdec.runtime.prompts import load_prompts
from specdec.benchmarks.tune import TuneReport, TuneRow, recommend
from specdec.runtime.theory import expected_speedup


def test_expected_speedup_with_a_call_cost_function():
    # a call cost of 1 is the paper's formula; a costlier verify lowers it
    assert expected_speedup(0.5, 2, 0.1) == pytest.approx(1.75 / 1.2)
    assert expected_speedup(0.5, 2, 0.1, lambda n: 1.3 if n == 3 else 1.0) == pytest.approx(1.75 / 1.5)


def test_verify_cost_fit():
    report = TuneReport("ngram", 0.5, 0.0, [1.0, 1.1, 1.2, 1.3], 0.0, 10.0)
    assert report.verify_cost == pytest.approx(0.1)


def test_recommend_takes_auto_only_when_it_beats_every_fixed_k():
    rows = [TuneRow(k, expected_paper=2.0, expected=e, measured=m)
            for k, e, m in ((1, 1.4, 1.1), (2, 1.2, 1.3), (3, 1.3, 1.2))]
    assert recommend(rows, None, by_measurement=True) == 2
    assert recommend(rows, 1.25, by_measurement=True) == 2
    assert recommend(rows, 1.3, by_measurement=True) == 2  # a tie keeps the reproducible fixed K
    assert recommend(rows, 1.31, by_measurement=True) == "auto"
    assert recommend(rows, 9.0, by_measurement=False) == 1  # no sweep measured: best expected, auto unmeasured


def test_tune_stores_k_that_the_runtime_then_uses(tiny_artifacts, tmp_path):
    artifact = tmp_path / "art"
    shutil.copytree(tiny_artifacts["llama"], artifact)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "one, two, three, one, two,", "chat": False}) + "\n")
    result = CliRunner().invoke(main, ["tune", str(artifact), "--prompts", str(prompts), "--max-k", "3",
                                       "--max-new-tokens", "8", "--plot", str(tmp_path / "tune.png"),
                                       "--provider", "cpu"])
    assert result.exit_code == 0, result.output
    assert "| K |" in result.output and "recommended K" in result.output and "| auto (cap 3)" in result.output
    assert (tmp_path / "tune.png").stat().st_size > 1000
    stored = load_manifest(artifact).runtime_defaults.to_dict()
    # What is stored is what the sweep recommended and marked in its table (not just any valid K).
    printed = re.search(r"^recommended K = (\S+)", result.output, flags=re.MULTILINE).group(1)
    assert str(stored["num_draft_tokens"]) == printed and stored["drafter"] == "model"
    measured = {}  # table row label (K or "auto") -> measured speedup, and which row is marked
    for line in result.output.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if line.startswith("| ") and (cells[0][:1].isdigit() or cells[0].startswith("auto")):
            measured[cells[0].split()[0]] = (float(cells[-1].rstrip("x")), "**recommended**" in cells[0])
    assert sorted(measured) == ["1", "2", "3", "auto"], measured
    assert [label for label, (_, marked) in measured.items() if marked] == [printed]
    best = max(speedup for speedup, _ in measured.values())
    assert measured[printed][0] >= best - 0.005  # the best measured row (table figures are rounded to 0.01)
    # The measured call-cost curve, n = 1..max_k + 1, is what `auto` starts from.
    assert len(stored["target_call_costs"]) == 4 and stored["target_call_costs"][0] == 1.0
    engine = Engine.load(artifact, provider="cpu")
    assert engine.target_call_costs.prior == {n: r for n, r in enumerate(stored["target_call_costs"], start=1)}
    # On a noisy machine a measured t(n) can dip below a shorter call's; the runtime pools the
    # dip with its neighbours (t(1) held at 1), so that is what it must report.
    pooled = non_decreasing(dict(enumerate(stored["target_call_costs"], start=1)), pinned=1)
    for n in range(1, 5):
        assert engine.target_call_costs.relative(n) == pytest.approx(pooled[n])
    stats = engine.generate("Hello", GenerationConfig(max_new_tokens=6)).stats
    assert stats.num_draft_tokens == str(stored["num_draft_tokens"]) and stats.drafter == "model"
    # The tiny llama graph has both attention kernels: tune times a prefill through each and says which way to go.
    assert re.search(r"^long-call attention kernel: a \d+-token prefill \d+\.\d\dx the short-call kernel's; .*"
                     r"(Worth keeping|export with --no-long-call-attention)", result.output, flags=re.MULTILINE)


def test_the_long_call_prefill_ratio_times_each_kernel_and_restores_the_switch(tiny_artifacts, export_tiny_llama):
    from specdec.benchmarks.tune import long_call_prefill_ratio

    target = Engine.load(tiny_artifacts["llama"], provider="cpu").target
    kept = target.long_call_rows
    fed = []  # the long_call input of every call, as the session binds it
    forward = target.forward

    def spying_forward(cache, tokens, **kwargs):
        fed.append(len(tokens) > target.long_call_rows)
        return forward(cache, tokens, **kwargs)

    target.forward = spying_forward
    ratio = long_call_prefill_ratio(target, list(range(5, 85)), rounds=3)
    assert 0.2 < ratio < 5 and target.long_call_rows == kept
    assert fed == [True, False, False, True, True, False, False, True]  # a warm-up round, then 3 alternating
    one_kernel = Engine.load(export_tiny_llama("no-long-call", long_call_attention=False), provider="cpu")
    assert long_call_prefill_ratio(one_kernel.target, list(range(5, 85))) is None


def test_bad_prompt_file(tmp_path):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(Exception, match="p.jsonl:1"):
        load_prompts(bad)
    result = CliRunner().invoke(main, ["tune", str(tmp_path), "--prompts", str(bad)])
    assert result.exit_code == 1 and "Traceback" not in result.output
