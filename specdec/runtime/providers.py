"""Choosing onnxruntime execution providers, and checking the one we got is the one we asked for."""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from specdec.models.errors import ArtifactError, GenerationError, MissingDependencyError

try:
    import onnxruntime as ort
except ImportError as err:
    # onnxruntime is an extra, not a base dependency: onnxruntime and onnxruntime-gpu both
    # install the `onnxruntime` module, so a base requirement on one would clobber the other.
    raise MissingDependencyError(
        "specdec's runtime needs onnxruntime: pip install 'specdec[cpu]', "
        "or 'specdec[gpu]' (onnxruntime-gpu) on a CUDA machine"
    ) from err

PROVIDER_CHOICES = ("auto", "cuda", "cpu")
CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"


def providers_for(requested: str) -> list[str]:
    """Return the provider list to try for "auto", "cuda" or "cpu".

    Raises GenerationError when "cuda" is asked for but this onnxruntime has no CUDA provider.
    """
    if requested not in PROVIDER_CHOICES:
        raise GenerationError(f"provider must be one of {', '.join(PROVIDER_CHOICES)}, got '{requested}'")
    available = ort.get_available_providers()
    if requested == "cpu":
        return [CPU]
    if CUDA in available:
        return [CUDA, CPU]
    if requested == "cuda":
        raise GenerationError(
            "CUDA was requested but this onnxruntime has no CUDAExecutionProvider: "
            "replace onnxruntime with onnxruntime-gpu "
            "(pip uninstall -y onnxruntime && pip install 'onnxruntime-gpu[cuda,cudnn]'), or use --provider cpu"
        )
    return [CPU]


# Every CUDA session's provider options (docs/GPU.md, "Arena"): the arena grows by what is asked
# rather than to the next power of two, since KV buffers are allocated once and pooled
# (specdec/runtime/kv_cache.py) and per-step activations repeat in size: doubling would only strand memory.
CUDA_OPTIONS = {"arena_extend_strategy": "kSameAsRequested"}


@dataclass
class CheckSettings:
    """Session settings only the device check turns on (`checked_sessions`), never the serving path."""

    profile_dir: Path | None = None  # run onnxruntime's profiler; its JSON files go here
    verbose_log: bool = False  # log at VERBOSE: node placements, "nodes were not assigned", Memcpy nodes
    cuda_options: dict[str, str] = field(default_factory=dict)  # added to CUDA_OPTIONS, e.g. use_tf32 "0"
    logs: dict[str, str] = field(default_factory=dict)  # graph path -> what onnxruntime logged creating it


_check: CheckSettings | None = None


@contextlib.contextmanager
def checked_sessions(settings: CheckSettings) -> Iterator[CheckSettings]:
    """Within the block, create_session applies `settings`; yield them (their `logs` fill in)."""
    global _check
    previous, _check = _check, settings
    try:
        yield settings
    finally:
        _check = previous


@contextlib.contextmanager
def stderr_into(sink: io.BytesIO) -> Iterator[None]:
    """Send file descriptor 2 (where onnxruntime's C++ logger writes) into `sink` within the block."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            sink.write(capture.read())


_cuda_libraries = threading.Lock()
_cuda_libraries_tried = False
_cuda_failed = False  # a session asked for CUDA and got the CPU: this process cannot load CUDA
_preload_said = ""  # what onnxruntime.preload_dlls printed or raised: the reason CUDA did not load, often


def load_cuda_libraries() -> bool:
    """Load the CUDA and cuDNN libraries onnxruntime-gpu needs, once per process; return whether it tried.

    onnxruntime's CUDA provider finds them only on the loader's path, so a box with
    `pip install 'onnxruntime-gpu[cuda,cudnn]'` and no system CUDA (the edge box without
    PyTorch, which would otherwise load them) silently falls back to the CPU.
    `onnxruntime.preload_dlls` (onnxruntime-gpu >= 1.21) loads them from pip's nvidia
    packages (CUDA 13: one `nvidia/cu13/lib` folder; CUDA 12: `nvidia/<component>/lib`)
    or the default paths. What it prints or raises is kept for create_session's error.
    """
    global _cuda_libraries_tried, _preload_said
    preload = getattr(ort, "preload_dlls", None)
    with _cuda_libraries:
        if _cuda_libraries_tried:
            return False
        _cuda_libraries_tried = True
        if preload is None:
            _preload_said = f"onnxruntime {ort.__version__} has no preload_dlls (1.21 or later has)"
            return False
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            try:
                preload()
            except Exception as err:  # noqa: BLE001 - best effort; the session check below is what counts
                print(f"preload_dlls raised {type(err).__name__}: {err}")
        _preload_said = " ".join(line.strip() for line in printed.getvalue().splitlines() if line.strip())
    return True


_shared_pool_lock = threading.Lock()
_shared_pool_threads: int | None = None  # size of this process's shared intra-op pool, once made


def shared_pool(threads: int | None) -> int:
    """Make onnxruntime's process-wide intra-op thread pool of `threads` if there is none; return its size.

    Sessions that take turns (a target and its draft) can share one pool: its threads keep
    spinning for whichever runs next, where two per-session pools either steal each other's
    cores (both spinning) or pay a wake-up per operator (the draft not spinning). Once the
    pool exists onnxruntime refuses per-session pools, so every later session in the process
    runs on it, at its size, whatever thread count it asks for (create_session).
    """
    global _shared_pool_threads
    with _shared_pool_lock:
        if _shared_pool_threads is None:
            from onnxruntime.capi.onnxruntime_pybind11_state import set_global_thread_pool_sizes

            _shared_pool_threads = threads or os.cpu_count() or 1
            set_global_thread_pool_sizes(_shared_pool_threads, 1)
        return _shared_pool_threads


def shared_pool_threads() -> int | None:
    """Return the size of this process's shared intra-op pool, or None while there is none."""
    return _shared_pool_threads


def _session_options(path: str, threads: int | None, spin: bool, shared: bool = False) -> ort.SessionOptions:
    """Return the SessionOptions for one graph, with the device check's settings when they are on."""
    options = ort.SessionOptions()
    if shared:
        options.use_per_session_threads = False  # the process-wide pool (shared_pool); spin/threads are its own
    elif threads:
        options.intra_op_num_threads = threads
    options.log_severity_level = 3  # the CUDA fallback warning is reported by us, once
    if not spin and not shared:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if _check is not None:
        if _check.verbose_log:
            options.log_severity_level = 0  # VERBOSE: where each node was placed, and the fallback warnings
        if _check.profile_dir is not None:
            options.enable_profiling = True
            options.profile_file_prefix = str(Path(_check.profile_dir) / Path(path).stem)
    return options


def _load(path: str, options: ort.SessionOptions, providers: list) -> ort.InferenceSession:
    """Return an onnxruntime session for `path`; raise ArtifactError (one line) if the graph cannot be read.

    A truncated or corrupt graph whose checksum was not checked (or was rewritten) would
    otherwise surface as onnxruntime's own exception, a traceback in the CLI.
    """
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidGraph, InvalidProtobuf, NoSuchFile

    try:
        return ort.InferenceSession(path, sess_options=options, providers=providers)
    except (InvalidProtobuf, InvalidGraph, NoSuchFile, Fail) as err:
        reason = " ".join(str(err).split())
        raise ArtifactError(f"onnxruntime cannot load '{path}': {reason[:300]} (re-export the artifact)") from None


def create_session(path: str, requested: str, threads: int | None = None,
                   spin: bool = True) -> tuple[ort.InferenceSession, str]:
    """Return (session, device) where device is "cuda" or "cpu", as the session really runs.

    spin=False stops the intra-op threads from busy-waiting after each run: when two
    sessions take turns (draft and target), one's spinning threads otherwise steal the
    cores the other needs (measured on 2 cores: a 1-token SmolLM2 step went from ~25 ms to
    ~36 ms when alternating with a spinning session). A lone session decodes faster
    spinning (44 vs 39 tokens/s), hence the default; the engine turns it off for drafts.

    onnxruntime-gpu lists CUDA as available even where it cannot load it, then silently
    falls back to CPU; so the providers are read back from the session. "auto" accepts the
    fallback, and later "auto" sessions in this process go straight to the CPU; "cuda"
    raises GenerationError, quoting what preload_dlls said.

    Once the process has a shared pool (`shared_pool`), the session runs its CPU operators
    on it (`threads` and `spin` then do not apply): onnxruntime allows nothing else.
    """
    options = _session_options(path, threads, spin, shared=_shared_pool_threads is not None)
    global _cuda_failed
    providers = providers_for(requested)
    if requested == "auto" and _cuda_failed:
        providers = [CPU]  # it failed to load once: the next sessions need not fail (and log) again
    if CUDA in providers:
        load_cuda_libraries()
    cuda_options = {**CUDA_OPTIONS, **(_check.cuda_options if _check else {})}
    chosen = [(CUDA, cuda_options) if name == CUDA else name for name in providers]
    if _check is not None and _check.verbose_log:
        log = io.BytesIO()
        with stderr_into(log):
            session = _load(path, options, chosen)
        _check.logs[path] = log.getvalue().decode(errors="replace")
    else:
        session = _load(path, options, chosen)
    on_cuda = session.get_providers()[0] == CUDA
    if CUDA in providers and not on_cuda:
        _cuda_failed = True
        if requested == "cuda":
            said = f" (onnxruntime.preload_dlls: {_preload_said[:400]})" if _preload_said else ""
            raise GenerationError(
                "CUDA was requested but onnxruntime could not load its CUDA provider "
                f"(check the CUDA/cuDNN libraries match onnxruntime-gpu){said}, or use --provider cpu"
            )
    return session, ("cuda" if on_cuda else "cpu")
