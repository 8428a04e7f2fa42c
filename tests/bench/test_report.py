import json

import pytest

from specdec.benchmarks.anchors import AnchorRun
from specdec.benchmarks.genai_anchor import configured_model, hf_tokenizer_config, session_options
from specdec.benchmarks.report import _prompt_set_name, geometric_mean, target_vs_genai_rows, target_vs_genai_section
from tools.goals import goals_section


def _group(group, config, speedup, share):
    return {"group": group, "config": config, "speedup": speedup, "share_of_theory": share,
            "share_of_theory_verify": share}


def test_a_goal_figure_just_below_its_threshold_never_reads_as_met():
    groups = [_group("grounded", "ngram auto", 1.9999, 0.8499), _group("grounded", "ngram K=4", 2.0, 0.85)]
    rows = [{"config": "ngram auto", "group": "open", "speedup": 0.94999, "prompt": "ideas"}]
    head_to_head = [{"prompt": "a", "prompt_tokens": 300, "decode_ratio": 1.0499, "ttft_ratio": 0.8001},
                    {"prompt": "b", "prompt_tokens": 250, "decode_ratio": 1.0499, "ttft_ratio": 0.8},
                    {"prompt": "c", "prompt_tokens": 40, "decode_ratio": 1.0499, "ttft_ratio": 2.0}]
    text = "\n".join(goals_section(groups, rows, [], head_to_head=head_to_head))
    assert "| grounded | 84.9% / 84.9% | no / no |" in text
    assert "| grounded | 85.0% / 85.0% | yes / yes |" in text
    assert "| grounded | 1.99x | no |" in text and "| grounded | 2.00x | yes |" in text
    assert "| open | min 0.94x (ideas) | no |" in text
    assert "| all | 1.04x | no |" in text
    # an at-most goal rounds up: 0.8001 reads 0.81x, not met; exactly 0.8 is met; short prompts are not held to it
    assert "| a (300 tokens) | 0.81x | no |" in text and "| b (250 tokens) | 0.80x | yes |" in text
    assert "c (40 tokens)" not in text
    # Float error must not round an exact figure down: 0.29 * 100 is 28.999999999999996.
    exact = goals_section([_group("open", "ngram K=4", 1.0, 0.29)], [], [])
    assert "| open | 29.0% / 29.0% |" in "\n".join(exact)


def test_target_vs_genai_pairs_medians_per_prompt():
    genai = [AnchorRun("onnxruntime-genai greedy", "p", [1] * 11, 2.0, 10, prefill_seconds=0.5, decode_seconds=1.0),
             AnchorRun("onnxruntime-genai greedy", "p", [1] * 11, 2.0, 10, prefill_seconds=0.3, decode_seconds=0.5),
             AnchorRun("onnxruntime-genai greedy", "p", [1] * 11, 2.0, 10, prefill_seconds=0.4, decode_seconds=0.9),
             AnchorRun("onnxruntime-genai ngram", "p", [1] * 11, 1.0, 10, prefill_seconds=0.1, decode_seconds=0.1),
             AnchorRun("onnxruntime-genai greedy", "q", [1] * 5, 1.0, 10)]  # phases not timed: left out
    # 10 tokens counted (max_new_tokens), 9 after the first: 9 / 0.9 s is the median of 9, 18 and 10
    assert genai[2].decode_tokens_per_second == pytest.approx(10.0) and genai[4].decode_tokens_per_second is None
    rows = target_vs_genai_rows({"p": [(12.0, 0.2), (11.0, 0.3), (13.0, 0.25)], "q": [(5.0, 0.1)]}, genai,
                                {"p": 300, "q": 20})
    assert len(rows) == 1
    row = rows[0]
    assert row["decode_ratio"] == pytest.approx(12.0 / 10.0) and row["ttft_ratio"] == pytest.approx(0.25 / 0.4)
    text = "\n".join(target_vs_genai_section(rows))
    assert "| p | 300 | 12.0 | 10.0 | 1.20x | 250 | 400 | 0.62x |" in text
    # Every timed prefill counts where given: specdec's n-gram runs', genai's extra samples (not its n-gram mode's).
    genai[0].prefill_samples = [0.2, 0.2, 0.2]
    rows = target_vs_genai_rows({"p": [(12.0, 0.2)]}, genai, {"p": 300}, {"p": [0.2, 0.1, 0.1]})
    assert rows[0]["ttft_seconds"] == pytest.approx(0.1) and rows[0]["genai_ttft_seconds"] == pytest.approx(0.25)
    assert rows[0]["prefills"] == (3, 6) and rows[0]["runs"] == (1, 3)
    assert geometric_mean([2.0, 0.5]) == pytest.approx(1.0)


def test_paired_prefill_rounds_give_the_median_of_their_ratios_and_the_goal_reads_it():
    genai = [AnchorRun("onnxruntime-genai greedy", "p", [1] * 11, 2.0, 10, prefill_seconds=0.4, decode_seconds=1.0)]
    # rounds where a burst slowed both sides: the per-round ratio is steady where the medians apart are not
    rounds = [(0.3, 0.4), (0.6, 0.8), (0.35, 0.4), (0.9, 1.0)]
    rows = target_vs_genai_rows({"p": [(12.0, 0.5)]}, genai, {"p": 300}, None, {"p": rounds})
    row = rows[0]
    assert row["ttft_ratio"] == pytest.approx(0.5 / 0.4)
    assert row["paired_ttft_ratio"] == pytest.approx((0.75 + 0.875) / 2) and row["paired_rounds"] == 4
    assert row["paired_ttft_range"] == pytest.approx((0.75, 0.9))
    text = "\n".join(target_vs_genai_section(rows))
    assert "| 1.25x | 0.81x (0.75-0.90) |" in text and "4 rounds per prompt" in text
    goals = "\n".join(goals_section([], [], [], head_to_head=rows))
    assert "(prompts of 200+ tokens), paired rounds | p (300 tokens) | 0.82x | no |" in goals
    row["paired_ttft_ratio"] = 0.8
    assert "| p (300 tokens) | 0.80x | yes |" in "\n".join(goals_section([], [], [], head_to_head=rows))


def test_genai_runs_on_a_copy_with_specdecs_session_options(tmp_path):
    builder = tmp_path / "builder"
    builder.mkdir()
    config = {"model": {"decoder": {"session_options": {"log_id": "x", "provider_options": []},
                                    "filename": "model.onnx"}}}
    (builder / "genai_config.json").write_text(json.dumps(config))
    (builder / "model.onnx").write_bytes(b"graph")
    view = tmp_path / "view"
    view.mkdir()
    configured_model(builder, session_options(2, spin=False), view)
    options = json.loads((view / "genai_config.json").read_text())["model"]["decoder"]["session_options"]
    assert options["intra_op_num_threads"] == 2 and options["session.intra_op.allow_spinning"] == "0"
    assert options["log_id"] == "x" and options["graph_optimization_level"] == "ORT_ENABLE_ALL"
    assert (view / "model.onnx").read_bytes() == b"graph"
    assert json.loads((builder / "genai_config.json").read_text()) == config  # the builder's folder is untouched


def test_one_genai_worker_serves_every_job_of_a_run(tmp_path):
    """The bench keeps one genai process for the run: jobs go in as lines, runs come back as lines."""
    from specdec.benchmarks.genai_anchor import GenaiWorker
    from specdec.models.errors import SpecdecError

    builder = tmp_path / "builder"
    builder.mkdir()
    (builder / "genai_config.json").write_text(json.dumps({"model": {"decoder": {"session_options": {}}}}))
    # Stands in for the genai venv's python: answers each job line with one run, tagged with its own pid.
    fake = tmp_path / "python"
    fake.write_text("#!/usr/bin/env python3\nimport json, os, sys\n"
                    "for line in sys.stdin:\n"
                    "    job = json.loads(line)\n"
                    "    if job.get('kind') == 'steps':\n"
                    "        print(json.dumps([{'past': p, 'n': n, 'seconds': p + n} for p in job['past_lengths']\n"
                    "                          for n in job['new_tokens']]), flush=True)\n"
                    "        continue\n"
                    "    if job.get('kind') == 'prefill':\n"
                    "        print(json.dumps([float(os.environ.get('FAKE_PREFILL', len(job['ids'])))] * job['count']),\n"
                    "              flush=True)\n"
                    "        continue\n"
                    "    if job['prompts'] == {'bad': []}: sys.exit('genai says no')\n"
                    "    (pid, ids), = job['prompts'].items()\n"
                    "    print(json.dumps([{'system': str(os.getpid()), 'prompt_id': pid, 'token_ids': ids,\n"
                    "                       'seconds': 1.0, 'prefill_seconds': 0.1, 'decode_seconds': 0.9,\n"
                    "                       'prefill_samples': [0.1] * job['prefill_samples']}]), flush=True)\n")
    fake.chmod(0o755)
    with GenaiWorker(fake, builder, session_options(2)) as worker:
        first = worker.run({"a": [1, 2]}, 8, prefill_samples=3)
        second = worker.run({"b": [3]}, 8)
        assert first[0].prompt_id == "a" and first[0].prefill_samples == [0.1] * 3 and first[0].max_new_tokens == 8
        assert second[0].token_ids == [3] and second[0].system == first[0].system  # the same process
        assert worker.steps([1] * 20, [4, 8], [1, 5], 3) == {("onnxruntime-genai", p, n): p + n
                                                             for p in (4, 8) for n in (1, 5)}
        assert worker.prefills([1, 2, 3]) == [3.0] and worker.prefills([1], count=2) == [1.0, 1.0]
        with pytest.raises(SpecdecError, match="genai says no"):
            worker.run({"bad": []}, 8)
    # environment variables reach the worker's process (onnxruntime reads some of its switches there)
    with GenaiWorker(fake, builder, session_options(2), env={"FAKE_PREFILL": "0.25"}) as worker:
        assert worker.prefills([1, 2, 3]) == [0.25]


def test_prompt_set_name():
    assert _prompt_set_name({"prompt_set_version": 1, "prompt_set_file": "prompts.jsonl"}) == "v1"
    assert _prompt_set_name({"prompt_set_version": None, "prompt_set_file": "mine.jsonl"}) == "mine.jsonl"


def test_the_report_says_where_autos_table_came_from():
    from specdec.benchmarks.report import _auto_table_origin

    assert "timed target calls" in _auto_table_origin({"call_costs_source": "timed", "calibration_seconds": 1.5})
    assert "call-cost cache" in _auto_table_origin({"call_costs_source": "cache", "calibration_seconds": 0.0})
    assert "specdec tune" in _auto_table_origin({"call_costs_source": "tune"})
    assert _auto_table_origin({"call_costs_source": None, "calibration_seconds": 0.0}) == ""


def test_the_hf_folder_names_a_byte_level_tokenizer_as_one_and_keeps_the_ggufs_bos_setting():
    saved = {"tokenizer_class": "LlamaTokenizer", "add_prefix_space": None, "add_bos_token": True,
             "bos_token": "<s>"}
    fixed = hf_tokenizer_config(saved, "gpt2", add_bos=False)
    assert fixed == {"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False, "add_bos_token": False,
                     "bos_token": "<s>"}
    assert saved["tokenizer_class"] == "LlamaTokenizer"  # the saved dict is left as it was
    # A SentencePiece GGUF ("llama") keeps its class; no BOS field in the GGUF keeps the saved setting.
    assert hf_tokenizer_config(saved, "llama", add_bos=None) == saved
