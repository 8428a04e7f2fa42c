"""`specdec score`: a text's token log-probabilities under the target, their sum and the perplexity."""

import json
import math

import numpy as np
from click.testing import CliRunner

from specdec.cli.main import main
from specdec.runtime.engine import Engine


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_score_lists_the_engines_prompt_logprobs_and_their_perplexity(tiny_artifacts):
    artifact = tiny_artifacts["llama"]
    engine = Engine.load(artifact, provider="cpu", threads=1)
    text = "The quick brown fox jumps over the lazy dog."
    result = _run("score", artifact, text, "--json", "--top", 2, "--provider", "cpu")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    ids = engine.codec.encode(text)
    expected = engine.prompt_logprobs(ids, 2)
    assert data["count"] == len(ids) - 1 == len(data["logprobs"]) == len(data["top"])
    np.testing.assert_allclose(data["logprobs"], expected.chosen, atol=1e-6)
    assert data["token_ids"] == ids[1:]
    assert math.isclose(data["perplexity"], math.exp(-sum(data["logprobs"]) / data["count"]))

    context = "The quick brown fox"
    continued = _run("score", artifact, " jumps over", "--context", context, "--json", "--provider", "cpu")
    assert continued.exit_code == 0, continued.output
    part = json.loads(continued.stdout)
    head, whole = engine.codec.encode(context), engine.codec.encode(context + " jumps over")
    assert part["count"] == len(whole) - len(head)
    assert math.isclose(part["sum"], float(engine.prompt_logprobs(whole).chosen[len(head) - 1:].sum()), abs_tol=1e-6)

    shown = _run("score", artifact, text, "--provider", "cpu")
    assert shown.exit_code == 0 and len(shown.stdout.splitlines()) == len(ids) - 1
    assert "perplexity" in shown.stderr


def test_score_of_a_missing_artifact_is_one_line(tmp_path):
    result = _run("score", tmp_path / "nowhere", "hello")
    assert result.exit_code == 1
    assert len(result.output.strip().splitlines()) == 1
