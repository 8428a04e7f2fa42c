"""Helpers shared by the exporter's graph-rewrite tests."""

import numpy as np
import onnx
import onnxruntime as ort


def run_graph(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    """Return every output of `model` on `feeds`, run by onnxruntime on the CPU."""
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
