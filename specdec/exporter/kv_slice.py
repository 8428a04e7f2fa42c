"""The tiny graph that crops a model's KV cache on the device (one Slice per past tensor)."""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto, helper

from specdec.models.architectures import KV_SEQUENCE_AXIS

_ONNX_DTYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}


def write_kv_slice_graph(path: Path, num_tensors: int, kv_heads: int, head_dim: int,
                         kv_dtype: str, opset: int = 17) -> Path:
    """Write a graph mapping inputs past_i [1, H, T, D] and keep [1] to kept_i = past_i[:, :, :keep]; return its path.

    The runtime runs it with IO binding on the model's provider, so rolling a cache back
    after a rejection is one session call and the cache never visits host memory.
    """
    elem = _ONNX_DTYPES[kv_dtype]
    shape = [1, kv_heads, "past_length", head_dim]
    kept_shape = [1, kv_heads, "kept_length", head_dim]
    inputs = [helper.make_tensor_value_info(f"past_{i}", elem, shape) for i in range(num_tensors)]
    inputs.append(helper.make_tensor_value_info("keep", TensorProto.INT64, [1]))
    outputs = [helper.make_tensor_value_info(f"kept_{i}", elem, kept_shape) for i in range(num_tensors)]
    initializers = [
        helper.make_tensor("starts", TensorProto.INT64, [1], [0]),
        helper.make_tensor("axes", TensorProto.INT64, [1], [KV_SEQUENCE_AXIS]),
    ]
    nodes = [
        helper.make_node("Slice", [f"past_{i}", "starts", "keep", "axes"], [f"kept_{i}"], name=f"crop_{i}")
        for i in range(num_tensors)
    ]
    graph = helper.make_graph(nodes, "specdec_kv_slice", inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="specdec")
    model.ir_version = min(model.ir_version, 9)  # readable by older onnxruntime releases too
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path
