"""The KV cache of one model for one request: device-resident tensors plus their length."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np

from specdec.runtime.providers import ort


class KVSlicer:
    """Crops every past tensor of a model along its sequence axis, on the device.

    Runs the artifact's tiny `kv_slice.onnx` (one Slice per tensor, driven by a `keep`
    input) on the same provider as the model, with IO binding, so a rollback never copies
    the cache through host memory. One slicer per model, shared by all requests.
    """

    def __init__(self, session: ort.InferenceSession, device: str, num_tensors: int):
        self.session = session
        self._device = device
        self._inputs = [f"past_{i}" for i in range(num_tensors)]
        self._outputs = [f"kept_{i}" for i in range(num_tensors)]

    def crop(self, tensors: list[ort.OrtValue], keep: int) -> list[ort.OrtValue]:
        """Return new device tensors holding the first `keep` positions of each input tensor."""
        binding = self.session.io_binding()
        for name, value in zip(self._inputs, tensors):
            binding.bind_ortvalue_input(name, value)
        binding.bind_cpu_input("keep", np.array([keep], dtype=np.int64))
        for name in self._outputs:
            binding.bind_output(name, self._device)
        self.session.run_with_iobinding(binding)
        return binding.get_outputs()


class BufferPool:
    """Shared-buffer KV sets of one model, handed to requests and taken back when they end.

    A new set is zeros copied once from the host (onnxruntime's Python API has no device
    memset); without the pool every request paid that copy (an 8B model at 2,048 positions:
    ~268 MB). A set taken again keeps the last request's values past its length, which the
    graph never reads (as after a rollback). One pool per model, shared by concurrent requests.
    """

    def __init__(self, shape: tuple[int, int, int], dtype: np.dtype, device: str, count: int, keep: int = 4):
        self._shape = shape  # (1, kv_heads, head_dim): positions go between the last two
        self._dtype = dtype
        self._device = device
        self._count = count  # tensors per set: key and value per layer
        self._keep = keep  # sets kept at most (the largest), bounding the pool's memory
        self._free: list[list[ort.OrtValue]] = []
        self._lock = threading.Lock()
        self.allocated = 0  # sets made so far: what the pool saves is requests minus this

    def take(self, positions: int) -> list[ort.OrtValue]:
        """Return a set of `count` buffers [1, kv_heads, capacity, head_dim], positions <= capacity <= 2 * positions.

        The bound keeps a small request from holding a large set (and a cache's growth, which
        tests and callers size on purpose, from being skipped).
        """
        with self._lock:
            fitting = [s for s in self._free if positions <= _capacity(s) <= 2 * positions]
            if fitting:
                chosen = min(fitting, key=_capacity)
                self._free.remove(chosen)
                return chosen
            self.allocated += 1
        shape = self._shape[:2] + (positions,) + self._shape[2:]
        # one array per tensor: on the CPU an OrtValue shares its array's memory
        return [ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, dtype=self._dtype), self._device, 0)
                for _ in range(self._count)]

    def give(self, tensors: list[ort.OrtValue]) -> None:
        """Take back a set a request no longer uses; the smallest sets go when more than `keep` are held."""
        with self._lock:
            self._free.append(tensors)
            self._free.sort(key=_capacity, reverse=True)
            del self._free[self._keep:]


def _capacity(tensors: list[ort.OrtValue]) -> int:
    return int(tensors[0].shape()[2])


class DeviceInputs:
    """One request's small input tensors (token ids, positions, seqlens), kept where the model runs.

    A call whose input has the shape of an earlier call's writes into that call's OrtValue
    (`update_inplace`) instead of binding a new host array: the steady state (1-token steps,
    K+1-token verifies) allocates nothing. Per request, not per model: concurrent requests
    must not write into each other's inputs.
    """

    def __init__(self, device: str):
        self.device = device
        self._values: dict[tuple[str, tuple[int, ...]], ort.OrtValue] = {}

    def bind(self, binding: ort.IOBinding, name: str, array: np.ndarray) -> None:
        """Bind `array` to input `name`, copied into this request's device tensor of its shape."""
        key = (name, array.shape)
        value = self._values.get(key)
        if value is None:
            value = self._values[key] = ort.OrtValue.ortvalue_from_numpy(array, self.device, 0)
        else:
            value.update_inplace(array)
        binding.bind_ortvalue_input(name, value)


@dataclass(frozen=True)
class KVView:
    """Part of a larger KV buffer, by address: the rows a batch engine's slot or batched call binds.

    onnxruntime's Python API cannot make an OrtValue over part of a device buffer, but an
    IOBinding takes a bare address (bind_input / bind_output with buffer_ptr), on the CPU and
    on CUDA alike. Offers the OrtValue methods the cache and the device check read.
    """

    device: str  # onnxruntime's device name: "cpu", "cuda"
    dtype: np.dtype
    dims: tuple[int, ...]  # [rows, kv_heads, capacity, head_dim]
    address: int

    def shape(self) -> list[int]:
        """Return the view's shape (as OrtValue.shape does)."""
        return list(self.dims)

    def data_ptr(self) -> int:
        """Return the view's first byte's address (as OrtValue.data_ptr does)."""
        return self.address

    def device_name(self) -> str:
        """Return the device the view's memory is on (as OrtValue.device_name does)."""
        return self.device


@dataclass
class KVCache:
    """Past keys/values of one model for one request.

    `tensors` holds 2 * layers OrtValues (key, value per layer) on the session's device.
    With a slicer (a "concat" graph) they have shape [1, kv_heads, length, head_dim] and
    each step replaces them. Without one (a "shared" graph) they are preallocated buffers
    [1, kv_heads, capacity, head_dim] the graph writes in place, and only the first
    `length` positions are valid: a rollback just shortens `length`, and whatever lies
    beyond it is overwritten by the next step. `token_ids` are the tokens the valid
    positions encode, so a drafter can find how much of its cache is still valid.
    """

    tensors: list[ort.OrtValue] | list[KVView]  # views: a batch engine's slot (specdec/runtime/slots.py)
    slicer: KVSlicer | None  # None: shared buffers, rollback moves the length only
    device: str = "cpu"  # where grown buffers go
    max_positions: int = 0  # the model's limit, which a shared buffer never grows past (0: no limit)
    pool: BufferPool | None = None  # where a shared cache's buffers go back when the request ends
    token_ids: list[int] = field(default_factory=list)
    # Usage counters for this request's stats: time inside session.run, and in rollbacks.
    run_seconds: float = 0.0
    run_calls: int = 0
    rollback_seconds: float = 0.0

    def __post_init__(self):
        self.inputs = DeviceInputs(self.device)
        # The model session's reusable IOBindings for this cache (specdec/runtime/session.py CallBinding),
        # keyed by which outputs they fetch; they reference the buffers, so they go when those do.
        self.bindings: dict = {}
        # The last greedy-head call's (heads' input rows, 8-bit logits), for validation and diagnostics.
        self.last_greedy_rows: tuple[np.ndarray, np.ndarray] | None = None

    def __del__(self):
        self.release()

    def release(self) -> None:
        """Give the buffers back to the pool (the request is over); the cache is empty after."""
        self.bindings = {}
        if self.pool is not None and self.tensors:
            self.pool.give(self.tensors)
        self.tensors = []
        self.token_ids = []

    def count_call(self, seconds: float) -> None:
        """Count one model call for this request's stats: `seconds` inside session.run (its share of a shared call)."""
        self.run_seconds += seconds
        self.run_calls += 1

    @property
    def length(self) -> int:
        """Return the number of cached positions."""
        return len(self.token_ids)

    @property
    def capacity(self) -> int:
        """Return how many positions the tensors can hold (their current length for concat caches)."""
        return int(self.tensors[0].shape()[2])

    def reserve(self, positions: int) -> None:
        """Make a shared cache's buffers hold at least `positions`, doubling and keeping the valid prefix.

        A concat cache has nothing to reserve: each step returns tensors of the new length.
        """
        if self.slicer is not None or positions <= self.capacity:
            return
        size = max(positions, 2 * self.capacity)
        if self.max_positions:
            size = min(size, self.max_positions)
        grown = []
        # Rare (log2 of the sequence length times per request): through host memory is fine.
        for old in self.tensors:
            data = old.numpy()
            bigger = np.zeros(data.shape[:2] + (size,) + data.shape[3:], dtype=data.dtype)
            bigger[:, :, :self.length] = data[:, :, :self.length]
            grown.append(ort.OrtValue.ortvalue_from_numpy(bigger, self.device, 0))
        self.tensors = grown

    def append(self, new_tensors: list[ort.OrtValue], new_token_ids: list[int]) -> None:
        """Take a step's present outputs (the same buffers, for a shared cache) and the new tokens."""
        self.tensors = new_tensors
        self.token_ids.extend(int(t) for t in new_token_ids)

    def rollback(self, length: int) -> None:
        """Drop every position from `length` on (a no-op when nothing is dropped)."""
        if length < 0 or length > self.length:
            raise ValueError(f"cannot roll back a cache of length {self.length} to {length}")
        if length == self.length:
            return
        start = time.perf_counter()
        if self.slicer is not None:
            self.tensors = self.slicer.crop(self.tensors, length)
        del self.token_ids[length:]
        self.rollback_seconds += time.perf_counter() - start
