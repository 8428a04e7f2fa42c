"""fp16 conversion of a graph in place, with its weights inside the file or in external data."""

from dataclasses import replace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from specdec.exporter.half_precision import convert_graph_to_fp16
from specdec.models.manifest import sha256_of_file


def _matmul_graph(path, weights, external: bool):
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32])],
        [numpy_helper.from_array(weights, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    if external:
        onnx.save_model(model, str(path), save_as_external_data=True, location="weights.bin", size_threshold=0)
    else:
        onnx.save_model(model, str(path))


@pytest.mark.parametrize("external", [False, True])
def test_graph_becomes_fp16_in_place(tmp_path, external):
    rng = np.random.default_rng(0)
    weights = rng.standard_normal((64, 32)).astype(np.float32)  # 4 KiB in fp16: kept external
    path = tmp_path / "model.onnx"
    _matmul_graph(path, weights, external)
    before = sha256_of_file(path)
    record = convert_graph_to_fp16(path)
    assert record["sha256_before"] == before and record["sha256_after"] == sha256_of_file(path) != before
    model = onnx.load(str(path), load_external_data=False)
    assert model.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT16
    assert model.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT16
    locations = {e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"}
    # external weights move to one file named after the graph; the old file is gone
    assert locations == ({"model.onnx.data"} if external else set())
    assert sorted(p.name for p in tmp_path.iterdir()) == (["model.onnx", "model.onnx.data"] if external
                                                          else ["model.onnx"])
    x = rng.standard_normal((1, 64)).astype(np.float16)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (y,) = session.run(None, {"x": x})
    assert y.dtype == np.float16
    np.testing.assert_allclose(y.astype(np.float32), x.astype(np.float32) @ weights, atol=0.1)


# --- fp16 at long positions: rotary angles and norm statistics kept in fp32 -------------------------

LONG = 4096  # max positions of the tiny models below: room past 2048


def _long_model(tmp_path, family: str, embedding_scale: float = 1.0):
    """Write a tiny random `family` model with LONG positions; return (folder, PyTorch model)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from specdec.exporter.tiny_models import build_tokenizer

    tokenizer = build_tokenizer()
    if family == "gpt2":
        config = AutoConfig.for_model("gpt2", vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=4,
                                      n_positions=LONG, initializer_range=0.2)
    else:
        from tests.exporter.test_families import FAMILIES

        sizes = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=LONG,
                     initializer_range=0.2, pad_token_id=0)
        config = AutoConfig.for_model(family, **{**sizes, **FAMILIES.get(family, {})})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(embedding_scale)
    folder = tmp_path / family
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, model


def _export(folder, out, dtype):
    from specdec.exporter.pipeline import ExportConfig, run_export

    return run_export(ExportConfig(target=str(folder), draft=None, output=out, dtype=dtype), progress=lambda m: None)


def test_every_family_is_checked_here():
    from specdec.models.architectures import supported_model_types

    assert sorted(FAMILIES_KEPT_FP32) == supported_model_types()


# family -> (rotary nodes kept in fp32?, norm statistics kept in fp32?): llama's graph fuses both
# (RotaryEmbedding over a cos cache, SimplifiedLayerNormalization), gpt2 has learned positions and
# LayerNormalization; the others keep MatMul/Cos/Sin and Pow/ReduceMean as plain ops.
FAMILIES_KEPT_FP32 = {"gpt2": (False, False), "llama": (False, False), "mistral": (True, True),
                      "qwen2": (True, True), "phi3": (True, True), "qwen3": (True, True), "olmo2": (True, True),
                      "granite": (True, True), "smollm3": (True, True), "gemma2": (True, True),
                      "gemma3_text": (True, True), "gpt_neox": (True, False), "phi": (True, False)}


@pytest.mark.parametrize("family", sorted(FAMILIES_KEPT_FP32))
def test_fp16_export_matches_pytorch_past_position_2048(tmp_path, family):
    from specdec.exporter.fp32_islands import NORM, ROTARY, fp16_sensitive_nodes
    from specdec.exporter.long_positions import check_long_positions
    from specdec.exporter.validate import DEFAULT_ATOL

    folder, model = _long_model(tmp_path, family)
    manifest = _export(folder, tmp_path / "art", "fp16")
    spec = manifest.target
    kept = spec.optimization["half_precision"]["kept_fp32"]
    assert (kept[ROTARY] > 0, kept[NORM] > 0) == FAMILIES_KEPT_FP32[family]
    assert fp16_sensitive_nodes(onnx.load(str(tmp_path / "art" / spec.graph_file))) == []
    report = check_long_positions(tmp_path / "art", spec, model, atol=DEFAULT_ATOL["fp16"])
    # read 0.02-0.05 on every family at positions 2048-2063 (logits up to ~8)
    assert report.passed, report


def _convert_copy(source, out, keep_fp32):
    import shutil

    from specdec.models.manifest import load_manifest

    shutil.copytree(source, out)
    spec = load_manifest(out).target
    convert_graph_to_fp16(out / spec.graph_file, keep_fp32=keep_fp32)
    return replace(spec, kv_dtype="float16")


UNFUSED = sorted(family for family, kept in FAMILIES_KEPT_FP32.items() if any(kept))  # the guard's families


def test_the_unguarded_families_are_the_unfused_ones():
    assert UNFUSED == ["gemma2", "gemma3_text", "gpt_neox", "granite", "mistral", "olmo2", "phi", "phi3", "qwen2",
                       "qwen3", "smollm3"]


# The families the drift was measured on; on the newer ones' tiny models an unguarded conversion also fails
# the check, but by less past 2048 (qwen3: 0.12 before, 0.03 after), so the size asserted below is theirs.
DRIFT_MEASURED = ["mistral", "phi3", "qwen2"]


@pytest.mark.parametrize("family", DRIFT_MEASURED)
def test_an_unguarded_conversion_fails_the_long_position_check(tmp_path, family):
    """The same fp32 graph converted both ways: rotary angles in fp16 drift by ~1 logit."""
    from specdec.exporter.fp32_islands import fp16_sensitive_nodes
    from specdec.exporter.long_positions import check_long_positions

    folder, model = _long_model(tmp_path, family)
    _export(folder, tmp_path / "fp32", "fp32")
    reports = {}
    for keep in (True, False):
        spec = _convert_copy(tmp_path / "fp32", tmp_path / f"fp16-{keep}", keep)
        sensitive = fp16_sensitive_nodes(onnx.load(str(tmp_path / f"fp16-{keep}" / spec.graph_file)))
        assert (sensitive == []) == keep  # unguarded: Cos, Sin and the norms' ReduceMeans read fp16
        reports[keep] = check_long_positions(tmp_path / f"fp16-{keep}", spec, model, atol=0.1)
    assert reports[True].passed
    # read 1.0-1.7 past 2048 (and ~1 before: angles of a few hundred rad lose their fractions too)
    assert not reports[False].passed and reports[False].max_diff_from_start > 0.3


def _first_norm(graph_path, out_path):
    """Cut the first RMSNorm (upcast, Pow, ReduceMean, ..., weight) out of an exported graph; return out_path."""
    from specdec.exporter.grouped_attention import producers_and_consumers

    model = onnx.load(str(graph_path))
    producers, consumers = producers_and_consumers(model.graph)
    reduce_mean = next(node for node in model.graph.node if node.op_type == "ReduceMean")
    upcast = producers[producers[reduce_mean.input[0]].input[0]]
    assert upcast.op_type == "Cast"
    node = upcast
    for op_type in ("Mul", "Cast", "Mul"):  # x * inv_std, back to the input dtype, times the weight
        node = next(user for user in consumers[node.output[0]] if user.op_type == op_type)
    onnx.utils.extract_model(str(graph_path), str(out_path), [upcast.input[0]], [node.output[0]])
    return out_path


@pytest.mark.filterwarnings("ignore:overflow encountered")
def test_norm_statistics_in_fp16_overflow_unless_kept_in_fp32(tmp_path):
    """qwen2's first RMSNorm, run in true fp16 arithmetic (onnx's reference evaluator, as CUDA's fp16
    kernels compute; onnxruntime's CPU provider runs Pow and ReduceMean in fp32 and cannot show it)."""
    from onnx.reference import ReferenceEvaluator

    folder, _ = _long_model(tmp_path, "qwen2")
    spec = _export(folder, tmp_path / "fp32", "fp32").target
    x = np.random.default_rng(0).standard_normal((1, 3, 64)) * np.array([1.0, 100.0, 1000.0])[None, :, None]
    results = {}
    for keep in (True, False):
        path = _first_norm(tmp_path / "fp32" / spec.graph_file, tmp_path / f"norm-{keep}.onnx")
        convert_graph_to_fp16(path, keep_fp32=keep)
        (results[keep],) = ReferenceEvaluator(str(path)).run(None, {onnx.load(str(path)).graph.input[0].name:
                                                                      x.astype(np.float16)})
    expected = x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-6)  # the weight is 1 at initialisation
    np.testing.assert_allclose(results[True].astype(np.float64), expected, atol=2e-2)
    assert np.abs(results[False][0, 0] - expected[0, 0]).max() < 2e-2  # small activations: fine either way
    # |x| ~ 100 and 1000: the squares' sum (and at 1000 the squares) overflow fp16, the norm reads 0
    assert np.abs(results[False][0, 1:]).max() < 1e-2
