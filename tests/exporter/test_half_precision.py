"""fp16 conversion of a graph in place, with its weights inside the file or in external data."""

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
