"""Provider choice as onnxruntime-gpu behaves on a machine where CUDA cannot load: listed, then CPU."""

import ast
import json
import os
import subprocess
import sys
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
        asked.append([name if isinstance(name, str) else name[0] for name in providers])
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


def test_an_unloadable_cuda_error_quotes_what_preload_said(identity_graph, cuda_listed_but_unloadable, monkeypatch):
    def failing_preload():
        print("Failed to load libcudnn.so.9: cannot open shared object file")
        raise OSError("libcublasLt.so.13: not found")

    monkeypatch.setattr(providers.ort, "preload_dlls", failing_preload, raising=False)
    with pytest.raises(GenerationError) as raised:
        providers.create_session(identity_graph, "cuda")
    message = str(raised.value)
    assert "libcudnn.so.9: cannot open shared object file" in message and "libcublasLt.so.13" in message
    assert "\n" not in message  # one line


def test_cuda_sessions_get_the_arena_setting_and_the_checks_options(identity_graph, cuda_listed_but_unloadable,
                                                                     monkeypatch):
    asked = []
    real_session = providers.ort.InferenceSession

    def recording_session(path, sess_options=None, providers=None):
        asked.append(providers)
        return real_session(path, sess_options=sess_options, providers=[providers[-1]])

    monkeypatch.setattr(providers.ort, "InferenceSession", recording_session)
    providers.create_session(identity_graph, "auto")
    monkeypatch.setattr(providers, "_cuda_failed", False)  # as if in a new process
    with providers.checked_sessions(providers.CheckSettings(cuda_options={"use_tf32": "0"})):
        providers.create_session(identity_graph, "auto")
    providers.create_session(identity_graph, "cpu")
    assert asked[0] == [(providers.CUDA, {"arena_extend_strategy": "kSameAsRequested"}), providers.CPU]
    assert asked[1][0] == (providers.CUDA, {"arena_extend_strategy": "kSameAsRequested", "use_tf32": "0"})
    assert asked[2] == [providers.CPU]


def test_checked_sessions_log_node_placements_and_write_a_profile(identity_graph, tmp_path):
    settings = providers.CheckSettings(profile_dir=tmp_path, verbose_log=True)
    with providers.checked_sessions(settings):
        session, _ = providers.create_session(identity_graph, "cpu")
    plain, _ = providers.create_session(identity_graph, "cpu")  # outside the block: neither
    assert "All nodes placed on [CPUExecutionProvider]. Number of nodes: 1" in settings.logs[identity_graph]
    import numpy as np

    session.run(None, {"x": np.ones(1, np.float32)})
    profile = session.end_profiling()
    assert profile.startswith(str(tmp_path / "identity")) and plain.end_profiling() == ""


_THREAD_COUNT_SCRIPT = """
import os, sys
from specdec.runtime.engine import Engine
counts = []
for threads, artifact in ((2, sys.argv[1]), (2, sys.argv[1]), (3, sys.argv[1]), (1, sys.argv[2])):
    engine = Engine.load(artifact, provider="cpu", threads=threads, shared_threads=True)
    counts.append((engine.shared_pool, len(os.listdir("/proc/self/task"))))
print(counts)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_engines_with_a_draft_share_one_thread_pool(tiny_artifacts):
    """In a fresh process the first engine with a draft makes the shared pool; no later session makes threads."""
    out = subprocess.run([sys.executable, "-c", _THREAD_COUNT_SCRIPT, str(tiny_artifacts["llama"]),
                          str(tiny_artifacts["gpt2"])], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-500:]
    counts = ast.literal_eval(out.stdout.strip())
    assert [shared for shared, _ in counts] == [2, 2, 2, 2]  # the first engine's size, whatever is asked later
    assert len({threads for _, threads in counts}) == 1  # no engine after the first made a thread


def test_shared_sessions_use_the_process_pool_and_ignore_spin(identity_graph):
    options = providers._session_options(str(identity_graph), 2, spin=False, shared=True)
    assert options.use_per_session_threads is False
    with pytest.raises(RuntimeError):  # the pool's threads spin for whichever session runs next
        options.get_session_config_entry("session.intra_op.allow_spinning")
    per_session = providers._session_options(str(identity_graph), 2, spin=False)
    assert per_session.intra_op_num_threads == 2
    assert per_session.get_session_config_entry("session.intra_op.allow_spinning") == "0"


def test_generate_with_shared_threads_equals_per_session_pools(tiny_artifacts):
    """`specdec generate --shared-threads` (own process): the same greedy tokens as without it."""
    def run(*flags):
        out = subprocess.run([sys.executable, "-m", "specdec.cli.main", "generate", str(tiny_artifacts["llama"]),
                              "The quick brown fox", "--max-new-tokens", "24", "-k", "3", "--drafter", "model",
                              "--json", "--threads", "2", *flags], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-500:]
        return json.loads(out.stdout)["token_ids"]
    assert run("--shared-threads") == run()
