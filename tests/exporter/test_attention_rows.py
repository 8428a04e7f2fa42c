"""--exact-steps: attention over two query rows at least, so a 1-token step scores like a verify call, to the bit."""

import json

import numpy as np
import onnx
import pytest

from specdec.exporter.attention_rows import ATTENTION_PAD_ROWS, pad_attention_queries
from specdec.exporter.pipeline import ExportConfig, run_export
from specdec.exporter.validate import step_call_difference, steps_and_call
from specdec.models.errors import ExportError, ManifestError
from specdec.models.manifest import MANIFEST_FILENAME, load_manifest, manifest_from_dict
from specdec.runtime.engine import Engine, GenerationConfig
from specdec.runtime.session import ModelSession

PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [64, 128, 31, 11], list(range(40, 90))]


@pytest.fixture(scope="module")
def exact_artifact(export_tiny_llama):
    """The tiny llama pair exported with --exact-steps."""
    return export_tiny_llama("exact-steps", exact_steps=True)


def test_exact_steps_export_records_the_pad_and_a_zero_drift(exact_artifact, tiny_artifacts):
    manifest, plain = load_manifest(exact_artifact), load_manifest(tiny_artifacts["llama"])
    target = manifest.target
    assert target.attention_pad_rows == ATTENTION_PAD_ROWS == 1 and target.min_rows == 1
    assert target.optimization["attention_pad"] == {"layers": target.num_layers, "rows": 1}
    # a token scores alike in calls of every length: no second attention kernel for long calls
    assert target.long_call_name is None and "long_call_attention" not in target.optimization
    assert plain.target.long_call_name  # the same export without --exact-steps has one
    # the throwaway row is written one position past the call: the model's last position is its
    assert target.max_positions == plain.target.max_positions - 1
    assert target.kv_capacity_limit == plain.target.max_positions
    assert manifest.validation["target"]["step_vs_call_max_diff"] == 0.0
    assert manifest.draft.attention_pad_rows == 0  # a draft's numbers only shape proposals
    graph = onnx.load(str(exact_artifact / target.graph_file), load_external_data=False)
    assert sum(n.op_type == "Pad" for n in graph.graph.node) >= target.num_layers


def test_padded_steps_equal_verify_rows_to_the_bit(exact_artifact):
    session = ModelSession(exact_artifact, load_manifest(exact_artifact).target, provider="cpu")
    for prompt in PROMPTS:
        # capacity 4: the buffers grow (with room for the pad row) during the prompt and the steps
        steps, call = steps_and_call(session, prompt, steps=12, capacity=4)
        np.testing.assert_array_equal(steps, call)


def test_the_pad_is_what_makes_them_equal(tiny_artifacts, exact_artifact):
    """The same tiny model without the pad: its 1-token steps take the op's 1-row path and drift."""
    plain = load_manifest(tiny_artifacts["llama"]).target
    assert plain.attention_pad_rows == 0
    drift = step_call_difference(ModelSession(tiny_artifacts["llama"], plain, provider="cpu"), PROMPTS)
    assert drift > 0.0
    padded = ModelSession(exact_artifact, load_manifest(exact_artifact).target, provider="cpu")
    assert step_call_difference(padded, PROMPTS) == 0.0


def test_padded_target_decodes_speculatively_to_its_greedy_output_up_to_the_last_position(exact_artifact):
    engine = Engine.load(exact_artifact, provider="cpu")
    limit = engine.max_positions
    prompt = [(3 + 7 * i) % 300 for i in range(limit - 20)]
    plain = engine.generate(prompt, GenerationConfig(max_new_tokens=40, drafter="none"))
    # the last token is produced, never fed: every fed one (and its pad row) had a position
    assert plain.finish_reason == "max_positions" and len(prompt) + len(plain.token_ids) == limit + 1
    for drafter in ("model", "ngram"):
        run = engine.generate(prompt, GenerationConfig(max_new_tokens=40, drafter=drafter, num_draft_tokens=3))
        assert run.token_ids == plain.token_ids, drafter


def test_rewrite_is_idempotent_and_keeps_outputs(exact_artifact):
    graph = onnx.load(str(exact_artifact / load_manifest(exact_artifact).target.graph_file))
    outputs = [o.name for o in graph.graph.output]
    assert pad_attention_queries(graph) == 0  # rewritten already: untouched
    assert [o.name for o in graph.graph.output] == outputs


def test_exact_steps_needs_the_shared_buffer(tiny_sources, tmp_path):
    target, _ = tiny_sources["llama"]
    with pytest.raises(ExportError, match="--exact-steps"):
        run_export(ExportConfig(target=str(target), draft=None, output=tmp_path / "x", exact_steps=True,
                                shared_kv=False), progress=lambda m: None)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("value, kv_buffer", [(2, "shared"), (-1, "shared"), (1, "concat")])
def test_bad_attention_pad_rows_is_refused(exact_artifact, value, kv_buffer):
    data = json.loads((exact_artifact / MANIFEST_FILENAME).read_text())
    assert manifest_from_dict(data).target.attention_pad_rows == 1  # round trip
    data["target"]["attention_pad_rows"] = value
    if kv_buffer == "concat":
        data["target"].update(kv_buffer="concat", attention_mask_name="attention_mask", kv_slice_file="x.onnx")
    with pytest.raises(ManifestError, match="attention_pad_rows"):
        manifest_from_dict(data)


def test_inspect_says_whether_steps_score_like_verify_calls(exact_artifact):
    from click.testing import CliRunner

    from specdec.cli.main import main

    shown = CliRunner().invoke(main, ["inspect", str(exact_artifact)])
    assert shown.exit_code == 0, shown.output
    assert "steps vs verify calls: bit-identical" in shown.output
