"""One exported decoder graph run with IO binding; KV caches stay on the device between steps."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from specdec.models.errors import GenerationError
from specdec.models.manifest import GraphSpec
from specdec.runtime.kv_cache import BufferPool, KVCache, KVSlicer
from specdec.runtime.providers import create_session, ort


def check_kv_buffer_device(spec: GraphSpec, device: str) -> None:
    """Raise GenerationError when the graph's KV cache cannot work in place on `device`.

    onnxruntime's CUDA GroupQueryAttention takes fp16/bf16 only: an fp32 shared-buffer
    graph would run its attention on the CPU, copying the cache across every step.
    """
    if spec.kv_buffer == "shared" and device == "cuda" and spec.kv_dtype == "float32":
        raise GenerationError(
            f"the {spec.role} graph keeps an fp32 KV cache in one shared buffer, which onnxruntime's CUDA "
            "GroupQueryAttention cannot run (fp16/bf16 only): use --provider cpu, or re-export with "
            "--dtype fp16, or with --no-shared-kv")


DEFAULT_CAPACITY = 256  # positions a shared-buffer cache starts with when the caller gives no hint


class ModelSession:
    """A loaded graph, shared by all requests; each request brings its own KVCache.

    `forward` binds the new tokens from the host, the cache's past tensors as device
    OrtValues, and the present outputs to the device (for a shared-buffer graph: to the
    very same OrtValues, written in place), so the cache never leaves it; only the logits
    come back to the host.
    """

    def __init__(self, artifact_dir: str | Path, spec: GraphSpec, provider: str = "auto",
                 threads: int | None = None, vocab_limit: int | None = None, spin: bool = True):
        folder = Path(artifact_dir)
        self.spec = spec
        self.session, self.device = create_session(str(folder / spec.graph_file), provider, threads, spin)
        check_kv_buffer_device(spec, self.device)
        self.shared_kv = spec.kv_buffer == "shared"
        self.slicer: KVSlicer | None = None
        if not self.shared_kv:  # a shared buffer rolls back by its length alone
            # The slicer runs where the cache lives: same device as the model.
            slice_session, _ = create_session(str(folder / spec.kv_slice_file), self.device, threads=1)
            self.slicer = KVSlicer(slice_session, self.device, 2 * spec.num_layers)
        self.vocab_limit = min(spec.vocab_size, vocab_limit or spec.vocab_size)
        self._past_names = [name for pair in spec.past_names for name in pair]
        self._present_names = [name for pair in spec.present_names for name in pair]
        self._kv_dtype = np.dtype(spec.kv_dtype)
        self.pool = BufferPool((1, spec.num_kv_heads, spec.head_dim), self._kv_dtype, self.device,
                               len(self._past_names)) if self.shared_kv else None

    @property
    def provider(self) -> str:
        """Return the execution provider the session really uses."""
        return self.session.get_providers()[0]

    def new_cache(self, capacity: int | None = None) -> KVCache:
        """Return an empty cache (length 0) on this session's device.

        `capacity` sizes a shared-buffer cache (positions; it grows when exceeded, with a
        copy); its buffers come from the model's pool and go back when the cache is released
        or dropped. A concat cache starts empty whatever it is.
        """
        if not self.shared_kv:
            shape = (1, self.spec.num_kv_heads, 0, self.spec.head_dim)
            empty = [ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, dtype=self._kv_dtype), self.device, 0)
                     for _ in self._past_names]
            return KVCache(tensors=empty, slicer=self.slicer, device=self.device,
                           max_positions=self.spec.max_positions)
        size = max(1, min(capacity or DEFAULT_CAPACITY, self.spec.max_positions))
        return KVCache(tensors=self.pool.take(size), slicer=None, device=self.device,
                       max_positions=self.spec.max_positions, pool=self.pool)

    def onnx_sessions(self) -> dict[str, ort.InferenceSession]:
        """Return this model's onnxruntime sessions by role: "model", and "kv_slice" for a concat cache."""
        sessions = {"model": self.session}
        if self.slicer is not None:
            sessions["kv_slice"] = self.slicer.session
        return sessions

    def forward(self, cache: KVCache, token_ids: list[int], logits_rows: int | None = None,
                hidden: bool = False) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """Run the graph on `token_ids` after the cache; return logits [rows, vocab] on the host.

        rows = `logits_rows` trailing positions (None: all len(token_ids)); a graph with a
        `logits_rows_name` input computes only those (a prefill needs 1), an older one
        computes all and the rest are dropped here. The cache grows by len(token_ids)
        positions. Logits are cut to `vocab_limit` so ids that only pad an embedding matrix
        can never be produced. With `hidden` (a graph with `hidden_name`, see `specdec distill`)
        returns (logits, hidden states [len(token_ids), hidden] float32): every new position's
        LM-head input, for a drafter that reads the target's features.
        """
        n_new = len(token_ids)
        past = cache.length
        if n_new == 0:
            raise ValueError("forward needs at least one token")
        rows = n_new if logits_rows is None else logits_rows
        if not 1 <= rows <= n_new:
            raise ValueError(f"logits_rows must be 1..{n_new} for a call over {n_new} tokens, got {logits_rows}")
        if past + n_new > self.spec.max_positions:
            raise GenerationError(
                f"sequence of {past + n_new} tokens exceeds the model's {self.spec.max_positions} positions"
            )
        spec = self.spec
        binding = self.session.io_binding()
        # ids, positions and seqlens go into the request's own device tensors (cache.inputs); the
        # mask, rows and total length stay host inputs: kernels read them as shapes on the CPU.
        cache.inputs.bind(binding, spec.input_ids_name, np.asarray([token_ids], dtype=np.int64))
        if spec.attention_mask_name:
            binding.bind_cpu_input(spec.attention_mask_name, np.ones((1, past + n_new), dtype=np.int64))
        if spec.position_ids_name:
            positions = np.arange(past, past + n_new, dtype=np.int64)[None, :]
            cache.inputs.bind(binding, spec.position_ids_name, positions)
        if spec.logits_rows_name:
            binding.bind_cpu_input(spec.logits_rows_name, np.array([rows], dtype=np.int64))
        if self.shared_kv:
            cache.reserve(past + n_new)
            # The op attends over positions 0..seqlens_k; what lies beyond (rolled-back drafts) is ignored.
            cache.inputs.bind(binding, spec.seqlens_name, np.array([past + n_new - 1], dtype=np.int32))
            binding.bind_cpu_input(spec.total_length_name, np.array(past + n_new, dtype=np.int32))
        for name, value in zip(self._past_names, cache.tensors):
            binding.bind_ortvalue_input(name, value)
        binding.bind_output(spec.logits_name, self.device)
        if hidden:
            if not spec.hidden_name:
                raise GenerationError("this artifact's target graph has no hidden-state output: "
                                      "run `specdec distill` on it first")
            binding.bind_output(spec.hidden_name, "cpu")
        for name, value in zip(self._present_names, cache.tensors):
            if self.shared_kv:
                binding.bind_ortvalue_output(name, value)  # in place: present is past
            else:
                binding.bind_output(name, self.device)
        start = time.perf_counter()
        self.session.run_with_iobinding(binding)
        cache.run_seconds += time.perf_counter() - start
        cache.run_calls += 1
        outputs = binding.get_outputs()
        logits = outputs[0].numpy()[0, -rows:, : self.vocab_limit]
        states = outputs[1].numpy()[0].astype(np.float32, copy=False) if hidden else None
        presents = outputs[2:] if hidden else outputs[1:]
        cache.append(cache.tensors if self.shared_kv else presents, token_ids)
        return (logits, states) if hidden else logits
