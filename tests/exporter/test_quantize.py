"""Weight precision options: int8 / int4 targets, and a quantized copy of the target as the draft."""

import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from specdec.cli.main import main
from specdec.exporter import pipeline
from specdec.exporter.agreement import AGREEMENT_FLOOR, float_answers, teacher_forced_agreement
from specdec.exporter.pipeline import ExportConfig, run_export
from specdec.exporter.quantize import (DRAFT_ACCURACY_LEVEL, EXACT_ACCURACY_LEVEL, FAST_ACCURACY_LEVEL,
                                      target_precision)
from specdec.exporter.sources import load_source
from specdec.models.errors import ExportError
from specdec.models.manifest import load_manifest
from specdec.runtime.engine import Engine, GenerationConfig

# Tiny random models lose more to int4 than real ones (good int4 graph: 0.34 here, 0.7+ on
# SmolLM2): the int4 floor of these tests; int8 keeps its default floor (0.85).
TINY_INT4_FLOOR = 0.25
TINY_FLOORS = {"int8": AGREEMENT_FLOOR["int8"], "int4": TINY_INT4_FLOOR}


@pytest.fixture(scope="module")
def quantized_artifacts(tiny_sources, tmp_path_factory):
    """Return {weights: artifact folder} of the tiny llama target at int8 and int4."""
    target, _ = tiny_sources["llama"]
    root = tmp_path_factory.mktemp("quantized")
    for weights in ("int8", "int4"):
        run_export(ExportConfig(target=str(target), draft=None, output=root / weights, weights=weights,
                                min_agreement=TINY_FLOORS[weights]), progress=lambda m: None)
    return {weights: root / weights for weights in ("int8", "int4")}


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_quantized_target_validates_and_decodes_exactly(quantized_artifacts, weights):
    import onnx

    out = quantized_artifacts[weights]
    manifest = load_manifest(out)
    spec = manifest.target
    assert spec.weights_dtype == weights and spec.optimization["quantization"]["weights"] == weights
    report = manifest.validation["target"]
    # A quantized graph is judged by teacher-forced greedy agreement with PyTorch, not a logit bound.
    floor = TINY_FLOORS[weights]
    assert report["passed"] and report["min_agreement"] == floor and report["agreement"] >= floor
    assert report["tokens"] > 0 and report["check"].startswith("teacher-forced")
    graph = onnx.load(str(out / spec.graph_file))
    assert any(node.op_type == "MatMulNBits" for node in graph.graph.node)
    # one attention kernel for calls of every length (specdec/exporter/long_call_attention.py is for float graphs)
    assert spec.long_call_name is None and not any(node.op_type == "If" for node in graph.graph.node)
    # At level 4 SmolLM2's 1-token steps scored a position up to 1.2 logits away from verify calls: an
    # int4 target keeps level 4 and its attention never runs on one query row; int8 computes in fp32 (level 1).
    level, pad = {"int8": (EXACT_ACCURACY_LEVEL, False), "int4": (FAST_ACCURACY_LEVEL, True)}[weights]
    assert _accuracy_levels(graph) == {level} and (level, pad) == target_precision(weights, True)
    # Where this CPU's MatMul kernels also round a 1-row call differently, every call gets 2 rows (min_rows).
    one_row = report.get("step_vs_call_max_diff_one_row")
    assert spec.kv_buffer == "shared" and spec.attention_pad_rows == int(pad)
    assert spec.min_rows == (2 if one_row else 1) and (one_row is None or pad)
    assert ("attention_pad" in spec.optimization) == pad
    assert manifest.validation["target"]["step_vs_call_max_diff"] == 0.0 or not pad
    shown = CliRunner().invoke(main, ["inspect", str(out)])  # a quantized report has no float logit bounds
    assert shown.exit_code == 0 and "teacher-forced greedy agreement" in shown.output, shown.output
    assert ("steps vs verify calls: bit-identical" in shown.output) == pad
    engine = Engine.load(out, provider="cpu")
    plain = engine.generate("one, two, three, one, two,", GenerationConfig(max_new_tokens=24, drafter="none"))
    spec_run = engine.generate("one, two, three, one, two,", GenerationConfig(max_new_tokens=24, drafter="ngram"))
    assert spec_run.token_ids == plain.token_ids


# --- A broken quantized graph must still fail: the agreement check is not a rubber stamp. ---

def _scale_every_block(graph, factor):
    """A wrong scale everywhere, as a quantizer dividing by the wrong range would write."""
    from onnx import numpy_helper

    inits = {init.name: init for init in graph.graph.initializer}
    for node in graph.graph.node:
        if node.op_type == "MatMulNBits":
            scales = inits[node.input[2]]
            scales.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(scales) * np.float32(factor), scales.name))


def _skip_layer(graph, layer):
    """Zero the output projections (o_proj, down_proj) of one decoder layer: it adds nothing to the residual."""
    from onnx import numpy_helper

    inits = {init.name: init for init in graph.graph.initializer}
    zeroed = 0
    for node in graph.graph.node:
        if node.op_type == "MatMulNBits" and f"layers.{layer}/" in node.name and \
                ("o_proj" in node.name or "down_proj" in node.name):
            scales = inits[node.input[2]]
            scales.CopyFrom(numpy_helper.from_array(np.zeros_like(numpy_helper.to_array(scales)), scales.name))
            zeroed += 1
    assert zeroed == 2, "the tiny llama's o_proj/down_proj names changed"


BREAKAGES = {
    "scales x2": lambda graph: _scale_every_block(graph, 2.0),
    "scales x0.5": lambda graph: _scale_every_block(graph, 0.5),
    "layer 0 skipped": lambda graph: _skip_layer(graph, 0),
    "layer 1 skipped": lambda graph: _skip_layer(graph, 1),
}


@pytest.fixture(scope="module")
def tiny_float_answers(tiny_sources, tmp_path_factory):
    """Return PyTorch's greedy answers (with logits) of the tiny llama target, as validation makes them."""
    target, _ = tiny_sources["llama"]
    loaded = load_source(str(target), tmp_path_factory.mktemp("float-answers"))
    return float_answers(loaded.model, loaded.tokenizer)


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_broken_quantized_graph_fails_agreement(quantized_artifacts, tiny_float_answers, tmp_path, weights):
    import onnx

    out = tmp_path / "art"
    shutil.copytree(quantized_artifacts[weights], out)
    spec = load_manifest(out, check_files=False).target
    floor = TINY_FLOORS[weights]
    good = teacher_forced_agreement(out, spec, tiny_float_answers, floor)
    pristine = onnx.load(str(out / spec.graph_file))
    figures = {"good": good.agreement}
    for name, breakage in BREAKAGES.items():
        graph = onnx.ModelProto()
        graph.CopyFrom(pristine)
        breakage(graph)
        onnx.save(graph, str(out / spec.graph_file))
        broken = teacher_forced_agreement(out, spec, tiny_float_answers, floor)
        figures[name] = broken.agreement
        assert not broken.passed, (name, figures)
        assert broken.agreement < good.agreement - 0.1, (name, figures)
    print(weights, {name: round(value, 3) for name, value in figures.items()})
    assert good.passed and good.agreement == load_manifest(quantized_artifacts[weights]).validation["target"]["agreement"]


def test_export_refuses_a_broken_quantization(tiny_sources, tmp_path, monkeypatch):
    """End to end: a quantizer that skips a layer makes `specdec export` fail, leaving no artifact."""
    import onnx

    quantize = pipeline.quantize_graph

    def quantize_then_skip_a_layer(graph_path, weights, accuracy_level):
        record = quantize(graph_path, weights, accuracy_level)
        graph = onnx.load(str(graph_path))
        _skip_layer(graph, 0)
        onnx.save(graph, str(graph_path))
        return record

    monkeypatch.setattr(pipeline, "quantize_graph", quantize_then_skip_a_layer)
    target, _ = tiny_sources["llama"]
    out = tmp_path / "art"
    with pytest.raises(ExportError, match=r"target graph failed validation: .* below the int8 floor 85%"):
        run_export(ExportConfig(target=str(target), draft=None, output=out, weights="int8"), progress=lambda m: None)
    assert not out.exists()


def _accuracy_levels(graph) -> set[int]:
    from onnx import helper

    return {helper.get_attribute_value(a) for node in graph.graph.node if node.op_type == "MatMulNBits"
            for a in node.attribute if a.name == "accuracy_level"}


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
    import onnx

    # A draft only shapes proposals: it keeps the fast int8-compute kernel.
    assert _accuracy_levels(onnx.load(str(out / manifest.draft.graph_file))) == {DRAFT_ACCURACY_LEVEL} == {4}
    assert manifest.draft.attention_pad_rows == manifest.target.attention_pad_rows == 0  # an fp32 target: no pad
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
