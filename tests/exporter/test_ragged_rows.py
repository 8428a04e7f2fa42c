"""The ragged-rows graph: written beside the plain one (weights shared), validated to the bit, skipped where
the batch engine cannot use it."""

from __future__ import annotations

import onnx
import pytest

from specdec.exporter.pipeline import ExportConfig, run_export
from specdec.models.errors import ExportError
from specdec.models.manifest import load_manifest


def test_a_default_export_has_a_ragged_graph_equal_to_batch_1_calls(tiny_artifacts):
    folder = tiny_artifacts["llama"]
    manifest = load_manifest(folder)  # every file present, sha256 checked
    target = manifest.target
    assert target.ragged_file == "target/ragged.onnx" and target.ragged_rows == 8
    assert "target/model.onnx.data" in target.files and target.ragged_file in target.sha256
    assert manifest.validation["target"]["ragged_rows_max_diff"] == 0.0
    ragged = onnx.load(str(folder / target.ragged_file), load_external_data=False)
    plain = onnx.load(str(folder / target.graph_file), load_external_data=False)
    # one data file holds the weights for both graphs
    locations = {entry.value for graph in (ragged, plain) for tensor in graph.graph.initializer
                 for entry in tensor.external_data if entry.key == "location"}
    assert locations == {"model.onnx.data"}
    attention = [n for n in ragged.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(attention) == 8 * target.num_layers
    draft = manifest.draft  # the draft model's calls of a step are batched too
    assert draft.ragged_file == "draft/ragged.onnx" and draft.ragged_rows == 8
    assert manifest.validation["draft"]["ragged_rows_max_diff"] == 0.0


def test_a_quantized_copy_draft_has_its_own_ragged_graph_and_no_stale_target_files(tiny_sources, tmp_path):
    target, _ = tiny_sources["llama"]
    out = tmp_path / "art"
    manifest = run_export(ExportConfig(target=str(target), draft="quantized:int4", output=out, min_agreement=0.0,
                                       greedy_head=True), progress=lambda m: None)  # the target's head: a folder
    draft = load_manifest(out).draft  # every listed file present, sha256 checked
    assert draft.files == ["draft/model.onnx", "draft/model.onnx.data"]
    if "ragged_rows_left_out_diff" in manifest.validation["draft"]:  # an AVX2-only CPU: see the test below
        assert draft.ragged_file is None
        assert sorted(p.name for p in (out / "draft").iterdir()) == ["model.onnx", "model.onnx.data"]
        return
    assert draft.ragged_file == "draft/ragged.onnx"
    assert sorted(p.name for p in (out / "draft").iterdir()) == ["model.onnx", "model.onnx.data", "ragged.onnx"]
    assert manifest.validation["draft"]["ragged_rows_max_diff"] == 0.0


def test_a_draft_ragged_graph_this_cpu_rounds_apart_is_left_out_not_fatal(tiny_sources, tmp_path, monkeypatch):
    """MatMulNBits at the draft's accuracy level rounds a 1-row call apart from a multi-row one on AVX2-only
    CPUs: the export keeps the draft's batch-1 calls (exact at any load) and drops its ragged graph."""
    import specdec.exporter.pipeline as pipeline

    measured = pipeline.ragged_rows_difference

    def draft_rounds_apart(session, prompts, **kwargs):
        return 1.9e-6 if session.spec.role == "draft" else measured(session, prompts, **kwargs)

    monkeypatch.setattr(pipeline, "ragged_rows_difference", draft_rounds_apart)
    target, draft_source = tiny_sources["llama"]
    out = tmp_path / "art"
    run_export(ExportConfig(target=str(target), draft=str(draft_source), output=out), progress=lambda m: None)
    manifest = load_manifest(out)  # every listed file present, sha256 checked
    assert manifest.target.ragged_file == "target/ragged.onnx"
    assert manifest.draft.ragged_file is None and manifest.draft.ragged_rows == 0
    assert not (out / "draft" / "ragged.onnx").exists()
    assert manifest.validation["draft"]["ragged_rows_left_out_diff"] == 1.9e-6


def test_batch_rows_zero_and_int8_targets_have_none(tiny_sources, tmp_path):
    """int8 targets (level 1: its kernels' rows against the call's not measured) get none; int4 do
    (tests/runtime/test_batch_padded.py)."""
    target, _ = tiny_sources["llama"]
    for flags in (dict(batch_rows=0), dict(weights="int8", min_agreement=0.0)):  # a random tiny model: no floor
        manifest = run_export(ExportConfig(target=str(target), draft=None, output=tmp_path / str(flags), **flags),
                              progress=lambda m: None)
        assert manifest.target.ragged_file is None and manifest.target.ragged_rows == 0


def test_one_row_is_refused():
    with pytest.raises(ExportError, match="batch-rows"):
        from specdec.exporter.pipeline import check_config

        check_config(ExportConfig(target="x", draft=None, output="/tmp/never", batch_rows=1))


def test_a_graph_with_its_own_data_file_ends_with_one_shared_file(tiny_artifacts, tmp_path):
    """A model exported with external weights of its own (large models): after the rewrite both graphs read
    one data file and the old one is gone; the ragged graph loads."""
    import onnxruntime as ort

    from specdec.exporter.ragged_rows import DATA_FILE, write_ragged_graph

    model = onnx.load(str(tiny_artifacts["llama"] / "target" / "model.onnx"))
    graph = tmp_path / "model.onnx"
    onnx.save_model(model, str(graph), save_as_external_data=True, location="weights.bin", size_threshold=0)
    ragged, layers = write_ragged_graph(graph, 4, "seqlens_k")
    assert layers == load_manifest(tiny_artifacts["llama"]).target.num_layers
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["model.onnx", DATA_FILE, ragged.name])
    assert len(ort.InferenceSession(str(ragged), providers=["CPUExecutionProvider"]).get_inputs()) > 0
