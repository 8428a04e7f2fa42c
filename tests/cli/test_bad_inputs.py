"""Bad input through the CLI and the library: each refused with one line and a non-zero exit, nothing written.

One table per surface. "One line": the output holds exactly one `Error: ...` line, carrying the
message (click's usage errors print their `Usage:` / `Try ...` hint before it; an export prints
its progress lines), and the command ended by exiting, not by an uncaught exception. "Nothing
written": no file or folder under the test's folder (the artifact copies, the export output's
parent, the working directory, the call-cost cache) is created, changed or removed.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from specdec.cli.main import main
from specdec.models.errors import SpecdecError
from specdec.models.manifest import MANIFEST_FILENAME, sha256_of_file
from specdec.runtime.engine import Engine, GenerationConfig

PROGRESS = re.compile(r"^\[\s*\d+\.\ds\] ")  # an export's elapsed-time progress line


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


def _edit_manifest(change):
    def setup(ws: Path) -> None:
        path = ws / "art" / MANIFEST_FILENAME
        data = json.loads(path.read_text())
        change(data)
        path.write_text(json.dumps(data))
    return setup


def _flip_a_byte(ws: Path) -> None:
    graph = ws / "art" / "target" / "model.onnx"
    data = bytearray(graph.read_bytes())
    data[len(data) // 2] ^= 0xFF
    graph.write_bytes(bytes(data))


def _truncate_and_rehash(ws: Path) -> None:
    """A graph cut in half whose manifest checksum matches: only loading it can tell."""
    graph = ws / "art" / "target" / "model.onnx"
    graph.write_bytes(graph.read_bytes()[: graph.stat().st_size // 2])
    _edit_manifest(lambda d: d["target"]["sha256"].__setitem__("target/model.onnx", sha256_of_file(graph)))(ws)


def _write(relative: str, content: bytes | str):
    def setup(ws: Path) -> None:
        path = ws / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return setup


def _unlink(relative: str):
    return lambda ws: (ws / relative).unlink()


GENERATE = ("generate", "{art}", "hi", "--provider", "cpu")
# (case, setup(workspace) or None, argv with {ws}/{art}/{plain} placeholders, message regex)
CLI_CASES = [
    ("artifact path missing", None, ("generate", "{ws}/none", "hi"), "does not exist"),
    ("folder without a manifest", _write("empty/notes.txt", "x"), ("generate", "{ws}/empty", "hi"),
     "has no specdec.json"),
    ("manifest not JSON", _write("art/specdec.json", "{nope"), GENERATE, "not valid JSON"),
    ("manifest from the future", _edit_manifest(lambda d: d.__setitem__("version", 99)), GENERATE,
     "version 99.*re-export"),
    ("manifest missing a field", _edit_manifest(lambda d: d.pop("provenance")), GENERATE,
     "missing field 'provenance'"),
    ("manifest field of the wrong type", _edit_manifest(lambda d: d["target"].__setitem__("head_dim", "16")),
     GENERATE, r"'target\.head_dim' should be int, got str"),
    ("runtime default out of range", _edit_manifest(lambda d: d.setdefault("runtime_defaults", {}).__setitem__(
        "num_draft_tokens", 0)), GENERATE, "num_draft_tokens' should be an integer >= 1"),
    ("graph changed (sha256 mismatch)", _flip_a_byte, GENERATE, "sha256|checksum"),
    ("graph changed, seen by inspect", _flip_a_byte, ("inspect", "{art}"), "sha256|checksum"),
    ("graph truncated (checksum updated)", _truncate_and_rehash, GENERATE, "target/model.onnx"),
    ("graph file missing", _unlink("art/draft/model.onnx"), GENERATE, "draft/model.onnx"),
    ("tokenizer file missing", _unlink("art/tokenizer/tokenizer.json"), GENERATE, "tokenizer"),
    ("empty prompt", None, ("generate", "{art}", "", "--provider", "cpu"), "prompt is empty"),
    ("over-long prompt", None, ("generate", "{art}", "the " * 800, "--provider", "cpu"),
     "prompt of .* 512 positions"),
    ("K zero", None, GENERATE + ("-k", "0"), "must be >= 1"),
    ("K above the maximum", None, GENERATE + ("-k", "33"), r"num_draft_tokens must be an integer in 1\.\.32"),
    ("K not a number", None, GENERATE + ("-k", "many"), "integer >= 1 or 'auto'"),
    ("negative temperature", None, GENERATE + ("--temperature", "-0.5"), "temperature must be 0 .greedy. or in"),
    ("denormal temperature", None, GENERATE + ("--temperature", "1e-310"), "temperature must be 0 .greedy. or in"),
    ("NaN temperature", None, GENERATE + ("--temperature", "nan"), "temperature must be 0 .greedy. or in"),
    ("top-p above 1", None, GENERATE + ("--top-p", "1.5"), r"top_p must be in \(0, 1\]"),
    ("negative top-k", None, GENERATE + ("--top-k", "-1"), "top_k must be >= 0"),
    ("top-k not an integer", None, GENERATE + ("--top-k", "2.5"), "is not a valid integer"),
    ("zero max-new-tokens", None, GENERATE + ("--max-new-tokens", "0"), "max_new_tokens must be >= 1"),
    ("zero threads", None, GENERATE + ("--threads", "0"), "0 is not in the range x>=1"),
    ("negative seed", None, GENERATE + ("--seed", "-1"), "seed must be >= 0"),
    ("empty stop string", None, GENERATE + ("--stop", ""), "stop_strings must be a tuple of non-empty strings"),
    ("model drafter without a draft", None, ("generate", "{plain}", "hi", "--drafter", "model"), "no draft model"),
    ("unknown drafter", None, GENERATE + ("--drafter", "magic"), "'magic' is not one of"),
    ("n-gram bounds crossed", None, GENERATE + ("--ngram-min", "3", "--ngram-max", "2"),
     "need 1 <= ngram_min <= ngram_max"),
    ("auto K cap zero", None, GENERATE + ("--max-draft-tokens-auto", "0"), r"max_draft_tokens_auto must be in 1\.\.32"),
    ("export from a missing source", None, ("export", "--target", "{ws}/nope", "--draft", "none", "--output",
                                            "{ws}/out/new"), "does not exist"),
    ("export from a folder without config.json", _write("src/notes.txt", "x"),
     ("export", "--target", "{ws}/src", "--draft", "none", "--output", "{ws}/out/new"), "no config.json"),
    ("export from a corrupt GGUF", _write("bad.gguf", b"GGUF" + bytes(range(256)) * 4),
     ("export", "--target", "{ws}/bad.gguf", "--draft", "none", "--output", "{ws}/out/new"), "cannot read"),
    ("export over an artifact without --force", None,
     ("export", "--target", "{ws}/nope", "--draft", "none", "--output", "{art}"), "already exists; pass --force"),
    ("export onto a file", _write("file.txt", "x"),
     ("export", "--target", "{ws}/nope", "--draft", "none", "--output", "{ws}/file.txt"), "is a file"),
    ("phrases with no time", None, ("phrases", "{art}", "--minutes", "0"), "--minutes must be > 0"),
    ("phrases on a missing artifact", None, ("phrases", "{ws}/none"), "does not exist"),
    ("phrases with a broken prompts file", _write("q.jsonl", "just text\n"),
     ("phrases", "{art}", "--prompts-file", "{ws}/q.jsonl"), r"q\.jsonl:1"),
    ("tune with a broken prompts file", _write("p.jsonl", '{"text": "no prompt field"}\n'),
     ("tune", "{art}", "--prompts", "{ws}/p.jsonl", "--provider", "cpu"), r"p\.jsonl:1"),
]


@pytest.fixture
def workspace(tiny_artifacts, tiny_target_only_artifact, tmp_path, monkeypatch) -> Path:
    """A folder holding copies of the tiny llama artifact ('art') and a target-only one ('plain'); the cwd."""
    shutil.copytree(tiny_artifacts["llama"], tmp_path / "art")
    shutil.copytree(tiny_target_only_artifact, tmp_path / "plain")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def assert_refused_in_one_line(result, message: str) -> str:
    """Assert a CliRunner result is a one-line refusal matching `message`; return the error line."""
    assert result.exit_code not in (0, None), result.output
    # click exits through SystemExit; anything else escaped the CLI's error handling (a traceback)
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    lines = [line for line in result.output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("Error:")]
    assert len(errors) == 1, result.output
    assert re.search(message, errors[0]), (message, errors[0])
    others = [line for line in lines if line is not errors[0] and not PROGRESS.match(line)
              and not line.startswith(("Usage:", "Try "))]
    assert others == [], result.output
    return errors[0]


@pytest.mark.parametrize("case, setup, argv, message", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_cli_refuses_in_one_line_and_writes_nothing(workspace, case, setup, argv, message):
    if setup:
        setup(workspace)
    before = _snapshot(workspace)
    places = {"ws": workspace, "art": workspace / "art", "plain": workspace / "plain"}
    result = CliRunner().invoke(main, [arg.format(**places) for arg in argv])
    assert_refused_in_one_line(result, message)
    assert _snapshot(workspace) == before


@pytest.fixture(scope="module")
def engine(tiny_artifacts):
    return Engine.load(tiny_artifacts["llama"], provider="cpu")


LIBRARY_CASES = [  # (case, prompt, GenerationConfig overrides, message regex)
    ("temperature not a number", "hi", dict(temperature="hot"), "temperature must be a number"),
    ("denormal temperature", "hi", dict(temperature=1e-310), "temperature must be 0"),
    ("infinite temperature", "hi", dict(temperature=float("inf")), "temperature must be 0"),
    ("top-p zero", "hi", dict(top_p=0.0), "top_p must be in"),
    ("top-k a float", "hi", dict(top_k=2.5), "top_k must be an integer"),
    ("max_new_tokens a string", "hi", dict(max_new_tokens="10"), "max_new_tokens must be an integer"),
    ("max_new_tokens a float", "hi", dict(max_new_tokens=5.5), "max_new_tokens must be an integer"),
    ("max_new_tokens zero", "hi", dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
    ("K a float", "hi", dict(num_draft_tokens=2.5), "num_draft_tokens must be an integer"),
    ("K a bool", "hi", dict(num_draft_tokens=True), "num_draft_tokens must be an integer"),
    ("K above the maximum", "hi", dict(num_draft_tokens=33), "num_draft_tokens must be an integer in 1..32"),
    ("seed a string", "hi", dict(seed="x"), "seed must be an integer"),
    ("seed negative", "hi", dict(seed=-1), "seed must be >= 0"),
    ("stop strings a bare string", "hi", dict(stop_strings="END"), "stop_strings must be a tuple"),
    ("n-gram max a string", "hi", dict(ngram_max="4"), "ngram_max must be an integer"),
    ("chat not a bool", "hi", dict(chat="yes"), "chat must be True or False"),
    ("unknown drafter", "hi", dict(drafter="magic"), "drafter must be one of"),
    ("empty token list", [], {}, "prompt is empty"),
    ("empty text", "", {}, "prompt is empty"),
    ("token id past the vocabulary", [5, 400], {}, r"prompt token 1 is 400: ids must be integers in 0\.\.399"),
    ("negative token id", [-1], {}, "prompt token 0 is -1"),
    ("token id a float", [1.5], {}, "prompt token 0 is 1.5"),
    ("over-long token list", [5] * 600, {}, "prompt of 600 tokens .* 512 positions"),
]


@pytest.mark.parametrize("case, prompt, overrides, message", LIBRARY_CASES, ids=[c[0] for c in LIBRARY_CASES])
def test_library_refuses_with_a_one_line_specdec_error(engine, tmp_path, monkeypatch, case, prompt, overrides,
                                                       message):
    monkeypatch.chdir(tmp_path)
    before = _snapshot(tmp_path), _snapshot(engine.artifact_dir)
    with pytest.raises(SpecdecError) as caught:
        engine.generate(prompt, GenerationConfig(**{"max_new_tokens": 4, **overrides}))
    assert "\n" not in str(caught.value) and re.search(message, str(caught.value)), str(caught.value)
    assert (_snapshot(tmp_path), _snapshot(engine.artifact_dir)) == before


@pytest.mark.parametrize("case, setup, options, message", [
    ("missing artifact", None, dict(artifact_dir="none"), "does not exist"),
    ("unknown provider", None, dict(provider="tpu"), "provider must be one of"),
    ("zero threads", None, dict(threads=0), "threads must be >= 1"),
    ("manifest from the future", _edit_manifest(lambda d: d.__setitem__("version", 99)), {}, "version 99"),
    ("graph changed (sha256 mismatch)", _flip_a_byte, {}, "sha256|checksum"),
], ids=lambda value: value if isinstance(value, str) and " " in value else None)
def test_engine_load_refuses_with_a_one_line_specdec_error(workspace, case, setup, options, message):
    if setup:
        setup(workspace)
    before = _snapshot(workspace)
    options = {"artifact_dir": "art", **options}
    with pytest.raises(SpecdecError) as caught:
        Engine.load(workspace / options.pop("artifact_dir"), **options)
    assert "\n" not in str(caught.value) and re.search(message, str(caught.value)), str(caught.value)
    assert _snapshot(workspace) == before


def test_the_table_holds_at_least_twenty_distinct_bad_inputs():
    """The reliability figure the issue asks for, counted from the tables above."""
    assert len({case for case, *_ in CLI_CASES}) >= 20 and len({case for case, *_ in LIBRARY_CASES}) >= 20
