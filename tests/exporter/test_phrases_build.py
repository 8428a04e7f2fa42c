"""`specdec phrases` on a tiny target: the table lands in the artifact atomically and decoding stays exact."""

import json
import shutil

import pytest
from click.testing import CliRunner

from specdec.cli.main import main
from specdec.models.errors import ArtifactError
from specdec.models.manifest import load_manifest
from specdec.runtime.engine import Engine, GenerationConfig
from specdec.runtime.ngram import PHRASE_TABLE

from tests.runtime.helpers import greedy

ARGS = ["--prompts", "12", "--max-new-tokens", "16", "--batch", "12", "--min-count", "1", "--threads", "1"]


@pytest.fixture(scope="module")
def phrased(tiny_target_only_artifact, tmp_path_factory):
    """A copy of the tiny target-only artifact with a phrase table, and the command's JSON record."""
    art = tmp_path_factory.mktemp("phrased") / "art"
    shutil.copytree(tiny_target_only_artifact, art)
    result = CliRunner().invoke(main, ["phrases", str(art), *ARGS, "--json"])
    assert result.exit_code == 0, result.output
    return art, json.loads(result.output[result.output.index("{"):])


def test_table_is_recorded_and_checked(phrased):
    art, built = phrased
    manifest = load_manifest(art, check_files=True)  # the table's sha256 included
    assert manifest.phrase_table.built == built
    assert built["answers"] == 12 and built["tokens"] > 12 and built["confident_contexts"] > 0
    assert built["generator_dtype"] in ("float32", "bfloat16")
    assert 0.0 <= built["heldout"]["proposes"] <= 1.0 and built["heldout"]["positions"] > 0
    assert sorted(p.name for p in art.iterdir() if p.name.startswith(("phrases-", "."))) == [manifest.phrase_table.table_file]
    shown = CliRunner().invoke(main, ["inspect", str(art)])
    assert shown.exit_code == 0 and f"phrase table: {manifest.phrase_table.table_file}" in shown.output


def test_greedy_output_with_the_table_equals_target_only(phrased):
    art, _ = phrased
    engine = Engine.load(art, provider="cpu", threads=1)
    assert engine.phrases is not None
    seen = 0
    for prompt in ["The quick brown fox", "Hello world!", "def add(a, b):"]:
        reference = greedy(engine, prompt, drafter="none")
        for k in (2, "auto"):
            iterations = []
            result = greedy(engine, prompt, drafter="ngram", num_draft_tokens=k, on_iteration=iterations.append)
            assert result.token_ids == reference.token_ids
            seen += sum(1 for it in iterations if it.situation == PHRASE_TABLE and it.drafted)
        off = []
        greedy(engine, prompt, drafter="ngram", num_draft_tokens=2, phrases=False, on_iteration=off.append)
        assert not any(it.situation == PHRASE_TABLE for it in off)
    assert seen > 0  # the table did propose


def test_rebuilding_replaces_the_table_and_a_broken_one_is_refused(phrased, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(phrased[0], art)
    old = load_manifest(art).phrase_table.table_file
    result = CliRunner().invoke(main, ["phrases", str(art), *ARGS[:-4], "--min-count", "2", "--threads", "1"])
    assert result.exit_code == 0, result.output
    new = load_manifest(art).phrase_table.table_file
    assert new != old and not (art / old).exists() and (art / new).exists()
    (art / new).write_bytes(b"not a table")
    with pytest.raises(ArtifactError, match="sha256"):
        Engine.load(art, provider="cpu")
    with pytest.raises(ArtifactError, match="phrase table .* cannot be read"):
        Engine.load(art, provider="cpu", check_files=False)


def test_prompts_from_a_file(tiny_target_only_artifact, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(tiny_target_only_artifact, art)
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Tell me about item {i}."}) + "\n" for i in range(3)))
    result = CliRunner().invoke(main, ["phrases", str(art), "--prompts-file", str(prompts), *ARGS[2:], "--json"])
    assert result.exit_code == 0, result.output
    built = load_manifest(art).phrase_table.built
    assert built["answers"] == 3 and built["prompts"].startswith("mine.jsonl")


def test_config_flag_is_validated():
    with pytest.raises(Exception, match="phrases must be True or False"):
        GenerationConfig(phrases="yes").validate()
