"""Weight precision options: int8 / int4 targets, and a quantized copy of the target as the draft."""

import pytest
from click.testing import CliRunner

from specdec.cli.main import main
from specdec.exporter.pipeline import ExportConfig, run_export
from specdec.models.manifest import load_manifest
from specdec.runtime.engine import Engine, GenerationConfig


@pytest.mark.parametrize("weights, op", [("int8", "MatMulNBits"), ("int4", "MatMulNBits")])
def test_quantized_target_validates_and_decodes_exactly(tiny_sources, tmp_path, weights, op):
    import onnx

    target, _ = tiny_sources["llama"]
    out = tmp_path / "art"
    # Tiny random models lose more to quantization than real ones: looser bounds here, the
    # defaults are set from SmolLM2 (README).
    manifest = run_export(ExportConfig(target=str(target), draft=None, output=out, weights=weights, atol=20.0,
                                       min_agreement=0.25), progress=lambda m: None)
    spec = manifest.target
    assert spec.weights_dtype == weights and spec.optimization["quantization"]["weights"] == weights
    report = manifest.validation["target"]
    # A quantized graph is judged by teacher-forced greedy agreement with PyTorch, not a logit bound.
    assert report["passed"] and report["min_agreement"] == 0.25 and report["agreement"] >= 0.25
    assert report["tokens"] > 0 and report["check"].startswith("teacher-forced")
    graph = onnx.load(str(out / spec.graph_file))
    assert any(node.op_type == op for node in graph.graph.node)
    engine = Engine.load(out, provider="cpu")
    plain = engine.generate("one, two, three, one, two,", GenerationConfig(max_new_tokens=24, drafter="none"))
    spec_run = engine.generate("one, two, three, one, two,", GenerationConfig(max_new_tokens=24, drafter="ngram"))
    assert spec_run.token_ids == plain.token_ids


def test_quantized_copy_of_target_as_draft(tiny_sources, tmp_path):
    target, _ = tiny_sources["llama"]
    out = tmp_path / "art"
    result = CliRunner().invoke(main, ["export", "--target", str(target), "--draft", "quantized:int8",
                                       "--output", str(out), "--atol", "20", "--min-agreement", "0.25"])
    assert result.exit_code == 0, result.output
    manifest = load_manifest(out)
    assert manifest.draft.weights_dtype == "int8" and manifest.draft.source.startswith("quantized:int8 of ")
    assert manifest.target.weights_dtype == "fp32"
    assert manifest.draft.sha256["draft/model.onnx"] != manifest.target.sha256["target/model.onnx"]
    engine = Engine.load(out, provider="cpu")
    plain = engine.generate("The quick brown fox", GenerationConfig(max_new_tokens=32, drafter="none"))
    spec = engine.generate("The quick brown fox", GenerationConfig(max_new_tokens=32, num_draft_tokens=4))
    assert spec.token_ids == plain.token_ids
    assert spec.stats.acceptance_rate > 0.5  # a quantized copy mostly agrees with its original


@pytest.mark.parametrize("args, message", [
    (["--weights", "int4", "--dtype", "fp16"], "drop --dtype fp16"),
    (["--draft", "quantized:int3"], "quantized:int8 or quantized:int4"),
])
def test_bad_quantization_options(tiny_sources, tmp_path, args, message):
    target, _ = tiny_sources["llama"]
    base = ["export", "--target", str(target), "--output", str(tmp_path / "out")]
    if "--draft" not in args:
        base += ["--draft", "none"]
    result = CliRunner().invoke(main, base + args)
    assert result.exit_code == 1 and message in result.output and not (tmp_path / "out").exists()
