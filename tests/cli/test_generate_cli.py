import json

import pytest
from click.testing import CliRunner

from specdec.cli.main import main
from specdec.runtime.ngram import ONE_TOKEN_MATCH, SITUATIONS


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_generate_json(tiny_artifacts):
    result = _run("generate", tiny_artifacts["gpt2"], "The quick brown fox", "--max-new-tokens", 10,
                  "-k", 3, "--json", "--provider", "cpu")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(data["token_ids"]) == 10 and data["finish_reason"] == "length"
    stats = data["stats"]
    assert stats["target_calls"] >= 1 and stats["drafter"] == "model" and stats["num_draft_tokens"] == "3"
    for key in ("alpha", "acceptance_rate", "tokens_per_target_call", "theoretical_speedup", "overhead_share"):
        assert key in stats


def test_generate_streams_text_and_stats(tiny_artifacts):
    plain = _run("generate", tiny_artifacts["llama"], "Hello", "--max-new-tokens", 8, "--no-draft", "--json")
    text = json.loads(plain.stdout.strip().splitlines()[-1])["text"]
    streamed = _run("generate", tiny_artifacts["llama"], "Hello", "--max-new-tokens", 8, "--verbose", "-k", "2")
    assert streamed.exit_code == 0, streamed.output
    assert streamed.stdout.startswith(text)
    assert "drafted" in streamed.stderr and "tokens/target call" in streamed.stderr
    assert "fp16 artifact" not in streamed.stderr  # that note is for fp16 graphs on the CPU only


def test_verbose_names_the_ngram_drafters_situation(tiny_target_only_artifact):
    result = _run("generate", tiny_target_only_artifact, "a b c d a b c d a b c d a b", "--max-new-tokens", 8,
                  "--verbose", "-k", "auto")
    assert result.exit_code == 0, result.output
    labels = {line.split(": drafted")[0].strip(" [") for line in result.stderr.splitlines() if ": drafted" in line}
    assert labels and labels <= set(SITUATIONS) | {s + ONE_TOKEN_MATCH for s in SITUATIONS}


def test_generate_chat_and_auto(tiny_artifacts):
    result = _run("generate", tiny_artifacts["llama"], "hi", "--chat", "-k", "auto", "--max-new-tokens", 6, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.strip().splitlines()[-1])["stats"]["num_draft_tokens"] == "auto"


def test_first_auto_run_says_it_timed_the_calls_and_the_next_does_not(tiny_artifacts):
    first = _run("generate", tiny_artifacts["llama"], "hi", "-k", "auto", "--max-new-tokens", 6)
    assert first.exit_code == 0 and "auto: timed target calls once" in first.stderr and "kept in" in first.stderr
    again = _run("generate", tiny_artifacts["llama"], "hi", "-k", "auto", "--max-new-tokens", 6)
    assert again.exit_code == 0 and "timed target calls" not in again.stderr  # read from the cache


@pytest.mark.parametrize("args, message", [
    (["--temperature", "-0.5"], "temperature must be 0 (greedy) or in"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--top-k", "-1"], "top_k must be >= 0"),
    (["-k", "0"], "must be >= 1"),
    (["-k", "many"], "integer >= 1 or 'auto'"),
    (["--max-new-tokens", "0"], "max_new_tokens must be >= 1"),
    (["--threads", "0"], "0 is not in the range x>=1"),
])
def test_bad_settings_are_one_line_errors(tiny_artifacts, args, message):
    result = _run("generate", tiny_artifacts["llama"], "hi", *args)
    assert result.exit_code != 0
    assert message in result.output
    assert "Traceback" not in result.output


def test_engine_refuses_a_thread_count_below_one(tiny_artifacts):
    from specdec.models.errors import GenerationError
    from specdec.runtime.engine import Engine

    with pytest.raises(GenerationError, match="threads must be >= 1"):
        Engine.load(tiny_artifacts["llama"], provider="cpu", threads=-1)


def test_prompt_too_long(tiny_artifacts):
    result = _run("generate", tiny_artifacts["llama"], "the " * 800)
    assert result.exit_code == 1
    assert result.output.startswith("Error: prompt of") and "512 positions" in result.output


def test_missing_or_broken_artifact(tiny_artifacts, tmp_path):
    result = _run("generate", tmp_path / "none", "hi")
    assert result.exit_code == 1 and "does not exist" in result.output
    (tmp_path / "specdec.json").write_text('{"format": "specdec-artifact", "version": 1}')
    result = _run("generate", tmp_path, "hi")
    assert result.exit_code == 1 and "missing field 'provenance'" in result.output
    assert "Traceback" not in result.output


def test_cuda_requested_without_cuda(tiny_artifacts):
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("this onnxruntime has CUDA")
    result = _run("generate", tiny_artifacts["llama"], "hi", "--provider", "cuda")
    assert result.exit_code == 1 and "CUDA was requested" in result.output


def test_help_explains_every_option():
    for command in ("export", "generate", "inspect"):
        result = _run(command, "--help")
        assert result.exit_code == 0
        options = [line.split()[0] for line in result.output.splitlines() if line.strip().startswith("--")]
        assert options


def test_every_generation_setting_has_a_flag_with_the_same_default():
    import dataclasses

    from specdec.runtime.engine import GenerationConfig

    params = {param.name: param for param in main.commands["generate"].params}
    for field in dataclasses.fields(GenerationConfig):
        if field.name == "cache_salt":  # the batch engine's prefix cache (specdec serve); one generation has none
            continue
        assert field.name in params, f"GenerationConfig.{field.name} has no generate flag"
        param = params[field.name]
        default = param.default
        # K's default is the artifact's (None); stops and biases are tuples of repeats; flags default off
        repeated = ("stop_strings", "stop_token_ids", "logit_bias")
        if field.name != "num_draft_tokens" and field.name not in repeated and not getattr(param, "is_flag", False):
            assert default == field.default, f"--{field.name.replace('_', '-')} defaults to {default}, not {field.default}"


@pytest.mark.parametrize("args, message", [
    (["--ngram-min", "3", "--ngram-max", "2"], "need 1 <= ngram_min <= ngram_max"),
    (["--max-draft-tokens-auto", "0"], "max_draft_tokens_auto must be in 1..32"),
])
def test_drafter_settings_are_checked(tiny_artifacts, args, message):
    result = _run("generate", tiny_artifacts["llama"], "hi", *args)
    assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output


def test_ngram_settings_reach_the_drafter(tiny_target_only_artifact):
    prompt = "a b c d a b c d a b c d a b"
    tight = _run("generate", tiny_target_only_artifact, prompt, "--max-new-tokens", 12, "--ngram-min", 4,
                 "--ngram-max", 4, "-k", 4, "--json")
    loose = _run("generate", tiny_target_only_artifact, prompt, "--max-new-tokens", 12, "--ngram-min", 1,
                 "-k", 4, "--json")
    tight_stats, loose_stats = (json.loads(r.stdout.strip().splitlines()[-1])["stats"] for r in (tight, loose))
    assert tight_stats["drafted"] < loose_stats["drafted"]


def test_logprobs_and_a_prediction_file_reach_the_json_output(tiny_artifacts, tmp_path):
    plain = json.loads(_run("generate", tiny_artifacts["llama"], "one two three", "--max-new-tokens", "12",
                            "--no-draft", "--json").stdout)
    predicted = tmp_path / "prediction.txt"
    predicted.write_text(plain["text"], encoding="utf-8")
    result = _run("generate", tiny_artifacts["llama"], "one two three", "--max-new-tokens", "12", "--json",
                  "--logprobs", "2", "--prediction", str(predicted), "--drafter", "ngram")
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    assert body["token_ids"] == plain["token_ids"]
    assert [entry["id"] for entry in body["logprobs"]] == body["token_ids"]
    assert all(len(entry["top"]) == 2 and entry["logprob"] <= 0 for entry in body["logprobs"])
    assert set(body["prediction_tokens"]) == {"accepted", "rejected"}
    missing = _run("generate", tiny_artifacts["llama"], "hi", "--prediction", str(tmp_path / "nope.txt"))
    assert missing.exit_code == 2 and "does not exist" in missing.output


def test_json_schema_constrains_the_answer_and_a_bad_file_is_one_line(tiny_artifacts, tmp_path):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema), encoding="utf-8")
    result = _run("generate", tiny_artifacts["llama"], "one two three", "--json-schema", str(path), "--json",
                  "--max-new-tokens", "20")
    assert result.exit_code == 0, result.output
    value = json.loads(json.loads(result.stdout)["text"])
    assert set(value) == {"n"} and 0 <= value["n"] <= 99
    path.write_text("{nope", encoding="utf-8")
    bad = _run("generate", tiny_artifacts["llama"], "hi", "--json-schema", str(path))
    assert bad.exit_code == 2 and "is not JSON" in bad.output and "Traceback" not in bad.output
    path.write_text('{"type": "no-such-type"}', encoding="utf-8")
    unsupported = _run("generate", tiny_artifacts["llama"], "hi", "--json-schema", str(path))
    assert unsupported.exit_code == 1 and "json_schema" in unsupported.output and "Traceback" not in unsupported.output
