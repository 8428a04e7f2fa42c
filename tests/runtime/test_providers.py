"""Provider choice as onnxruntime-gpu behaves on a machine where CUDA cannot load: listed, then CPU."""

import warnings

import onnx
import pytest
from onnx import TensorProto, helper

from specdec.models.errors import GenerationError
from specdec.runtime import providers


@pytest.fixture
def identity_graph(tmp_path):
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "identity",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    path = tmp_path / "identity.onnx"
    onnx.save(helper.make_model(graph), str(path))
    return str(path)


@pytest.fixture
def cuda_listed_but_unloadable(monkeypatch):
    """onnxruntime-gpu without its CUDA libraries: CUDA is 'available', sessions still run on the CPU."""
    preloads = []
    monkeypatch.setattr(providers.ort, "get_available_providers", lambda: [providers.CUDA, providers.CPU])
    monkeypatch.setattr(providers.ort, "preload_dlls", lambda: preloads.append(1), raising=False)
    monkeypatch.setattr(providers, "_cuda_libraries_tried", False)
    monkeypatch.setattr(providers, "_cuda_failed", False)
    warnings.filterwarnings("ignore", message=".*CUDAExecutionProvider.*")  # the CPU build's own warning
    return preloads


def test_auto_loads_cuda_libraries_once_then_falls_back_to_cpu(identity_graph, cuda_listed_but_unloadable,
                                                              monkeypatch):
    asked = []
    real_session = providers.ort.InferenceSession

    def recording_session(path, sess_options=None, providers=None):
        asked.append(list(providers))
        return real_session(path, sess_options=sess_options, providers=providers)

    monkeypatch.setattr(providers.ort, "InferenceSession", recording_session)
    for _ in range(3):
        session, device = providers.create_session(identity_graph, "auto")
        assert device == "cpu" and session.get_providers()[0] == providers.CPU
    assert cuda_listed_but_unloadable == [1]  # tried once per process, before the first CUDA session
    # one session tries CUDA; once it failed, the next go straight to the CPU (no second load, no log)
    assert asked == [[providers.CUDA, providers.CPU], [providers.CPU], [providers.CPU]]
    with pytest.raises(GenerationError):  # but an explicit request still tries, and says why not
        providers.create_session(identity_graph, "cuda")


def test_cuda_requested_but_unloadable_is_an_error(identity_graph, cuda_listed_but_unloadable):
    with pytest.raises(GenerationError, match="could not load its CUDA provider"):
        providers.create_session(identity_graph, "cuda")


def test_cpu_never_touches_cuda_libraries(identity_graph, cuda_listed_but_unloadable):
    session, device = providers.create_session(identity_graph, "cpu")
    assert device == "cpu" and cuda_listed_but_unloadable == []
