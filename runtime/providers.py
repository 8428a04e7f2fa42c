"""Choosing onnxruntime execution providers, and checking the one we got is the one we asked for."""

from __future__ import annotations

import contextlib
import io
import threading

from specdec.models.errors import GenerationError, MissingDependencyError

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


_cuda_libraries = threading.Lock()
_cuda_libraries_tried = False
_cuda_failed = False  # a session asked for CUDA and got the CPU: this process cannot load CUDA


def load_cuda_libraries() -> bool:
    """Load the CUDA and cuDNN libraries onnxruntime-gpu needs, once per process; return whether it tried.

    onnxruntime's CUDA provider finds them only on the loader's path, so a box with
    `pip install 'onnxruntime-gpu[cuda,cudnn]'` and no system CUDA (the edge box without
    PyTorch, which would otherwise load them) silently falls back to the CPU.
    `onnxruntime.preload_dlls` (onnxruntime-gpu >= 1.21) loads them from pip's nvidia
    packages or the default paths. What it prints on failure is dropped: a provider that
    still cannot load is reported by create_session.
    """
    global _cuda_libraries_tried
    preload = getattr(ort, "preload_dlls", None)
    with _cuda_libraries:
        if _cuda_libraries_tried or preload is None:
            return False
        _cuda_libraries_tried = True
        with contextlib.redirect_stdout(io.StringIO()):
            try:
                preload()
            except Exception:  # noqa: BLE001 - best effort; the session check below is what counts
                pass
    return True


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
    raises GenerationError.
    """
    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    options.log_severity_level = 3  # the CUDA fallback warning is reported by us, once
    if not spin:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    global _cuda_failed
    providers = providers_for(requested)
    if requested == "auto" and _cuda_failed:
        providers = [CPU]  # it failed to load once: the next sessions need not fail (and log) again
    if CUDA in providers:
        load_cuda_libraries()
    session = ort.InferenceSession(path, sess_options=options, providers=providers)
    on_cuda = session.get_providers()[0] == CUDA
    if CUDA in providers and not on_cuda:
        _cuda_failed = True
        if requested == "cuda":
            raise GenerationError(
                "CUDA was requested but onnxruntime could not load its CUDA provider "
                "(check the CUDA/cuDNN libraries match onnxruntime-gpu), or use --provider cpu"
            )
    return session, ("cuda" if on_cuda else "cpu")
