"""One exported decoder graph run with IO binding; KV caches stay on the device between steps."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from specdec.models.errors import GenerationError
from specdec.models.manifest import GraphSpec
from specdec.runtime.config import MAX_DRAFT_TOKENS
from specdec.runtime.greedy_head import MAX_ROWS as GREEDY_HEAD_MAX_ROWS, GreedyHead
from specdec.runtime.kv_cache import BufferPool, KVCache, KVSlicer, KVView
from specdec.runtime.providers import create_session, ort
from specdec.runtime.row_plan import GraphRows, RowPlan, batch_rows, ragged_rows, single_rows


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


# Calls longer than this take a graph's long-call attention kernel (specdec/exporter/long_call_attention.py):
# above any verify call (MAX_DRAFT_TOKENS + 1 rows), so steps and verify calls keep one kernel and
# only prefills switch; and where the causal kernel measured faster (SmolLM2 prefills, 2 cores:
# 0.90-0.91x at 256-384 tokens, level at 16-64; docs/FAIR_ANCHORS.md).
LONG_CALL_ROWS = max(MAX_DRAFT_TOKENS + 1, 64)
_LONG_CALL = (np.array([False]), np.array([True]))

_NUMPY_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64}


class CallBinding:
    """One cache's IOBinding, reused from call to call: the KV buffers are bound once, not every step.

    Rebinding 2 x layers past and present tensors and fetching every output cost about 1 ms
    of a 21 ms SmolLM2 step on 2 cores. The KV tensors are rebound only when the cache's
    buffers change (KVCache.reserve grew them); the logits (and hidden) outputs go into
    buffers kept per shape, so a steady state allocates nothing.
    """

    def __init__(self, io: ort.IOBinding):
        self.io = io
        self._bound_kv: list[ort.OrtValue] | None = None
        self._outputs: dict[tuple[str, tuple[int, ...]], ort.OrtValue] = {}
        self._output_index: dict[str, int] = {}

    def bind_cache(self, past_names: list[str], present_names: list[str],
                   tensors: list[ort.OrtValue] | list[KVView]) -> None:
        """Bind `tensors` as both past inputs and present outputs (in place), unless they are bound already."""
        if self._bound_kv is tensors:
            return
        for past, present, value in zip(past_names, present_names, tensors):
            if isinstance(value, KVView):
                self.io.bind_input(past, value.device, 0, value.dtype, value.dims, value.address)
                self.io.bind_output(present, value.device, 0, value.dtype, value.dims, value.address)
            else:
                self.io.bind_ortvalue_input(past, value)
                self.io.bind_ortvalue_output(present, value)
            self._order(present)
        self._bound_kv = tensors

    def output(self, name: str, shape: tuple[int, ...], dtype: np.dtype, device: str) -> ort.OrtValue:
        """Bind output `name` to this binding's buffer of `shape` on `device`; return that buffer."""
        key = (name, shape)
        value = self._outputs.get(key)
        if value is None:
            value = self._outputs[key] = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, device, 0)
        self.io.bind_ortvalue_output(name, value)
        self._order(name)
        return value

    def output_allocated(self, name: str, device: str) -> int:
        """Bind output `name` to memory onnxruntime allocates per call; return its index in get_outputs()."""
        self.io.bind_output(name, device)
        return self._order(name)

    def _order(self, name: str) -> int:
        # onnxruntime's IOBinding lists outputs in the order their names were first bound.
        return self._output_index.setdefault(name, len(self._output_index))


_NO_ROWS = 2 ** 62  # a row index past any call: the LM head told to start there computes nothing
KEPT_OUTPUT_ROWS = MAX_DRAFT_TOKENS + 1  # the largest verify call; longer calls are prefills
DEFAULT_CAPACITY = 256  # positions a shared-buffer cache starts with when the caller gives no hint


def reads_greedy_head(spec: GraphSpec, rows: int) -> bool:
    """Return whether a greedy call keeping `rows` logits rows reads the 8-bit head (else the fp32 one).

    Long verify calls read the fp32 head, cheaper there (specdec/runtime/greedy_head.py, MAX_ROWS); a graph that
    scores a token alike in calls of every length (attention pad, min_rows) keeps one head for all.
    """
    return rows <= GREEDY_HEAD_MAX_ROWS or spec.pads_calls


def _bind_head_rows(binding: ort.IOBinding, spec: GraphSpec, plan: RowPlan, greedy_head: bool) -> None:
    """Bind the inputs that say which rows the graph keeps and which LM head reads them from where."""
    if spec.logits_rows_name:
        binding.bind_cpu_input(spec.logits_rows_name, np.array([plan.out_rows], dtype=np.int64))
    if spec.greedy_head:
        # Each LM head reads the kept rows from its index on: one of the two runs.
        binding.bind_cpu_input(spec.greedy_head["row_start_name"],
                               np.array([_NO_ROWS if greedy_head else plan.head_start], np.int64))
        binding.bind_cpu_input(spec.greedy_head["approx_row_start_name"],
                               np.array([plan.head_start if greedy_head else _NO_ROWS], np.int64))
    elif spec.head_row_start_name:
        binding.bind_cpu_input(spec.head_row_start_name, np.array([plan.head_start], np.int64))


@dataclass(frozen=True)
class _Outputs:
    """How one call binds its outputs: bind(name, rows, device) binds output `name` [sequences, rows, width] and
    returns what reads it back after the run; empty(name) binds an output the call leaves without rows."""

    bind: Callable[[str, int, str], Callable[[], np.ndarray]]
    empty: Callable[[str], object]


@dataclass(frozen=True)
class _Result:
    """What one call of ModelSession._run returns."""

    logits: np.ndarray  # [the plan's returned rows, vocab_limit]
    states: np.ndarray | None  # [new tokens, features] float32: their hidden states, where asked for
    greedy_rows: tuple[np.ndarray, np.ndarray] | None  # with the 8-bit head: the heads' input rows, its logits
    seconds: float  # the graph's run alone


def _bind_feed(binding: ort.IOBinding, spec: GraphSpec, plan: RowPlan, greedy_head: bool, long_call: bool,
               bind: Callable[[ort.IOBinding, str, np.ndarray], None]) -> None:
    """Bind `plan`'s tokens, positions and lengths and the rows the graph keeps. `bind` binds ids, positions and
    seqlens (a single call: into the request's own device tensors, cache.inputs); the row counts and total
    length stay host inputs: kernels read them as shapes on the CPU."""
    bind(binding, spec.input_ids_name, plan.ids)
    if spec.position_ids_name:
        bind(binding, spec.position_ids_name, plan.positions)
    if spec.kv_buffer == "shared":
        # The op attends over positions 0..seqlens_k; what lies beyond (rolled-back drafts) is ignored.
        bind(binding, spec.seqlens_name, plan.seqlens)
        binding.bind_cpu_input(spec.total_length_name, np.array(plan.total_length, dtype=np.int32))
    if plan.row_tokens is not None:
        binding.bind_cpu_input(spec.row_tokens_name, plan.row_tokens)
    _bind_head_rows(binding, spec, plan, greedy_head)
    if spec.long_call_name:
        binding.bind_cpu_input(spec.long_call_name, _LONG_CALL[long_call])


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
        self._ragged_source = (folder / spec.ragged_file, threads, spin) if spec.ragged_file else None
        self._ragged: ort.InferenceSession | None = None
        self._ragged_buffers: dict[str, np.ndarray] = {}  # forward_ragged's outputs, one buffer each
        self._ragged_hidden: bool | None = None  # whether the ragged graph returns hidden rows, once looked up
        self.feature_width = 0  # the hidden output's width where the graph leaves it symbolic (the head knows it)
        check_kv_buffer_device(spec, self.device)
        self.shared_kv = spec.kv_buffer == "shared"
        self.slicer: KVSlicer | None = None
        if not self.shared_kv:  # a shared buffer rolls back by its length alone
            # The slicer runs where the cache lives: same device as the model.
            slice_session, _ = create_session(str(folder / spec.kv_slice_file), self.device, threads=1)
            self.slicer = KVSlicer(slice_session, self.device, 2 * spec.num_layers)
        self.vocab_limit = min(spec.vocab_size, vocab_limit or spec.vocab_size)
        self.long_call_rows = LONG_CALL_ROWS  # calls above it take the long-call kernel, where the graph has one
        self._past_names = [name for pair in spec.past_names for name in pair]
        self._present_names = [name for pair in spec.present_names for name in pair]
        self._kv_dtype = np.dtype(spec.kv_dtype)
        # The graph's own output types and widths, for the output buffers each cache keeps.
        self._outputs = {o.name: (_NUMPY_TYPES.get(o.type, np.float32), o.shape[-1]) for o in self.session.get_outputs()}
        self.pool = BufferPool((1, spec.num_kv_heads, spec.head_dim), self._kv_dtype, self.device,
                               len(self._past_names)) if self.shared_kv else None
        # An 8-bit LM head for greedy calls (CPU: where a step is bound by the bytes it reads).
        self.greedy_head: GreedyHead | None = None
        if spec.greedy_head and self.device == "cpu":
            self.greedy_head = GreedyHead.load(folder, spec.greedy_head)

    @property
    def provider(self) -> str:
        """Return the execution provider the session really uses."""
        return self.session.get_providers()[0]

    @property
    def batches(self) -> bool:
        """Return whether the graph takes several sequences per call (one new token each, each its own length).

        Shared-buffer graphs exported since the batch engine declare seqlens_k per row; older ones fix it at [1].
        """
        if not self.shared_kv:
            return False
        shape = next(i.shape for i in self.session.get_inputs() if i.name == self.spec.seqlens_name)
        return not isinstance(shape[0], int) and not self.spec.pads_calls

    def ragged_session(self) -> ort.InferenceSession | None:
        """Return the session of the graph's ragged-rows form (loaded on first use: it holds its own copy of the
        weights), or None when the artifact has none. It runs where this session does."""
        if self._ragged is None and self._ragged_source is not None:
            path, threads, spin = self._ragged_source
            self._ragged, _ = create_session(str(path), self.device, threads, spin)
        return self._ragged

    @property
    def ragged_hidden(self) -> bool:
        """Return whether the ragged-rows graph also returns the hidden rows a draft head reads (tapped by
        `specdec distill` since the batch engine runs heads)."""
        if self._ragged_hidden is None:
            ragged = self.ragged_session()
            self._ragged_hidden = bool(self.spec.hidden_name) and ragged is not None and any(
                o.name == self.spec.hidden_name for o in ragged.get_outputs())
        return self._ragged_hidden

    def _hidden_width(self) -> int:
        """Return the width of the hidden output: the graph's, else learnt from a plain call, else the head's."""
        width = self._outputs.get(self.spec.hidden_name, (None, None))[1]
        width = width if isinstance(width, int) else self.feature_width
        if not width:
            raise GenerationError("the width of the target's hidden-state output is not known yet: load the "
                                  "artifact's draft head with it (Engine.load)")
        return width

    def forward_ragged(self, call: CallBinding, caches: list[KVCache | None], rows: list[list[int]],
                       past_lengths: list[int], greedy: bool = False, hidden: bool = False
                       ) -> list[np.ndarray] | tuple[list[np.ndarray], list[np.ndarray]]:
        """Run ONE call of the ragged-rows graph: row r feeds rows[r] after past_lengths[r] positions of KV slot
        r (bound in `call`); return each row's logits [len(rows[r]), vocab] (a row of its own batch-1 call's),
        and with `hidden` also each row's hidden states [len(rows[r]), features] (ragged_hidden graphs).

        caches[r] is row r's request cache (its tokens are appended), or None for a row that only fills the
        graph's fixed row count: it may have no tokens (its attention's throwaway row lands past whatever its
        slot holds). greedy: every row wants only its argmax, so a short call may read the 8-bit LM head.
        """
        spec = self.spec
        if hidden and not self.ragged_hidden:
            raise GenerationError("this artifact's ragged-rows graph has no hidden-state output for the draft "
                                  "head: run `specdec distill` again")
        if len(rows) != spec.ragged_rows or any(c is not None and not r for c, r in zip(caches, rows)):
            raise ValueError(f"the ragged graph takes {spec.ragged_rows} rows, each request's with a token at least")
        for cache, row in zip(caches, rows):
            if cache is not None:
                cache.reserve(cache.length + len(row) + spec.attention_pad_rows)
        plan = ragged_rows(rows, past_lengths)
        head = self._head(greedy, plan)
        outputs = self._ragged_outputs(call.io)
        # The binding outlives the call: every output gets its shape (the hidden one whenever the graph has it).
        if not head and spec.greedy_head and self.greedy_head:
            outputs.bind(spec.greedy_head["input_name"], plan.head_rows, "cpu")
            outputs.empty(spec.greedy_head["approx_name"])
        result = self._run(self.ragged_session(), call, plan, head, outputs, states=self.ragged_hidden)
        ends = np.cumsum([len(r) for r in rows])[:-1]
        for cache, row in zip(caches, rows):
            if cache is not None:
                cache.append(cache.tensors, row)
        logits = np.split(result.logits, ends)
        return (logits, np.split(result.states, ends)) if hidden else logits

    def _ragged_outputs(self, io: ort.IOBinding) -> _Outputs:
        """Return how a ragged-rows call binds its outputs: into host buffers kept for every call's shape."""
        spec = self.spec

        def width(name: str) -> int:
            if name == spec.hidden_name:
                return self._hidden_width()
            if spec.greedy_head and name == spec.greedy_head["input_name"]:
                return self.greedy_head.weights.shape[1]
            return spec.vocab_size

        def bind(name: str, rows: int, device: str) -> Callable[[], np.ndarray]:
            buffer = self._bind_ragged_output(io, name, rows, width(name))  # from any device: onnxruntime copies
            return lambda: buffer[None]

        return _Outputs(bind, lambda name: self._bind_ragged_output(io, name, 0, width(name)))

    def _bind_ragged_output(self, io: ort.IOBinding, name: str, rows: int, width: int) -> np.ndarray:
        """Bind output `name` [1, rows, width] to the first rows of one host buffer of the graph's output type,
        kept for every call's shape (onnxruntime writes into it, from the device where the session runs there);
        return that view."""
        dtype = np.dtype(self._outputs.get(name, (np.float32,))[0])
        buffer = self._ragged_buffers.get(name)
        if buffer is None or buffer.shape[0] < rows or buffer.shape[1] != width or buffer.dtype != dtype:
            buffer = self._ragged_buffers[name] = np.empty((max(rows, 64), width), dtype=dtype)
        io.bind_output(name, "cpu", 0, dtype, [1, rows, width], buffer.ctypes.data)
        return buffer[:rows]

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
        limit = self.spec.kv_capacity_limit
        size = max(1, min(capacity or DEFAULT_CAPACITY, limit))
        return KVCache(tensors=self.pool.take(size), slicer=None, device=self.device,
                       max_positions=limit, pool=self.pool)

    def onnx_sessions(self) -> dict[str, ort.InferenceSession]:
        """Return this model's onnxruntime sessions by role: "model", "kv_slice" for a concat cache, and "ragged"
        once the ragged-rows graph is loaded."""
        sessions = {"model": self.session}
        if self.slicer is not None:
            sessions["kv_slice"] = self.slicer.session
        if self._ragged is not None:
            sessions["ragged"] = self._ragged
        return sessions

    def _output(self, call: CallBinding, name: str, rows: int, device: str, batch: int = 1) -> ort.OrtValue | int:
        """Bind output `name`: to a kept buffer (returned) for the shapes of steps and verify calls, else
        (a width neither the graph nor an earlier call has shown, or a prefill's many rows) to a per-call
        allocation (its index in get_outputs() returned), so a request does not hold a prompt-sized buffer."""
        dtype, width = self._outputs[name]
        if not isinstance(width, int) and name == self.spec.logits_name:
            width = self.spec.vocab_size
        if not isinstance(width, int) or rows > KEPT_OUTPUT_ROWS:
            return call.output_allocated(name, device)
        return call.output(name, (batch, rows, width), np.dtype(dtype), device)

    def _fetched(self, call: CallBinding, name: str, bound: ort.OrtValue | int) -> np.ndarray:
        """Return output `name` of the last call as an array (a view of its buffer)."""
        if not isinstance(bound, int):
            return bound.numpy()
        value = call.io.get_outputs()[bound]
        dtype, width = self._outputs[name]
        if not isinstance(width, int):
            # Learnt once: later steps and verify calls write into kept buffers, since a fetch of a
            # per-call allocation wraps every output of the call (~0.4 ms with SmolLM2's 60 KV outputs).
            self._outputs[name] = (dtype, value.shape()[-1])
        return value.numpy()

    def forward(self, cache: KVCache, token_ids: list[int], logits_rows: int | None = None,
                hidden: bool = False, greedy: bool = False) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """Run the graph on `token_ids` after the cache; return logits [rows, vocab] on the host.

        rows = `logits_rows` trailing positions (None: all len(token_ids)); a graph with a
        `logits_rows_name` input computes only those (a prefill needs 1), an older one
        computes all and the rest are dropped here. A graph with `min_rows` > 1 is fed that
        many positions at least (the extra ones lie past the cache's length and are dropped).
        The cache grows by len(token_ids) positions. Logits are cut to `vocab_limit` so ids
        that only pad an embedding matrix can never be produced. With `hidden` (a graph with
        `hidden_name`, see `specdec distill`) returns (logits, hidden states [len(token_ids),
        hidden] float32): every new position's LM-head input, for a drafter that reads the
        target's features (every row runs through the last layer then; a graph with a row-start input
        for its LM head, `head_row_start_name` or a greedy head's, still runs it on the `logits_rows`
        only). With `greedy` and a `greedy_head` (CPU), the rows hold only what greedy decoding reads:
        the fp32 logit of every token that may be its row's argmax, -inf elsewhere (specdec/runtime/greedy_head.py);
        calls over more than its MAX_ROWS rows read the fp32 head, unless the graph scores tokens alike in
        calls of every length.
        """
        rows = self._checked_rows(cache, token_ids, logits_rows, hidden)
        plan = single_rows(self._graph_rows(), token_ids, cache.length, rows, hidden)
        head = self._head(greedy, plan)
        call = self._cache_binding(cache, plan, hidden, head is not None)
        if self.spec.attention_mask_name:  # a host input, like the row counts
            call.io.bind_cpu_input(self.spec.attention_mask_name, np.ones((1, plan.total_length), dtype=np.int64))
        result = self._run(self.session, call, plan, head, self._plain_outputs(call), hidden,
                           plan.n_fed > self.long_call_rows, cache.inputs.bind)
        cache.count_call(result.seconds)
        if head:
            # Kept on the request's own cache, never on the shared session: another request's call may run now.
            cache.last_greedy_rows = result.greedy_rows
        if self.shared_kv:
            cache.append(cache.tensors, token_ids)
        else:
            cache.append(call.io.get_outputs()[:len(self._present_names)], token_ids)  # bound first
        return (result.logits, result.states) if hidden else result.logits

    def _checked_rows(self, cache: KVCache, token_ids: list[int], logits_rows: int | None, hidden: bool) -> int:
        """Return the logits rows a forward call wants; raise where the call cannot run."""
        n_new = len(token_ids)
        past = cache.length
        if n_new == 0:
            raise ValueError("forward needs at least one token")
        rows = n_new if logits_rows is None else logits_rows
        if not 1 <= rows <= n_new:
            raise ValueError(f"logits_rows must be 1..{n_new} for a call over {n_new} tokens, got {logits_rows}")
        if past + n_new > self.spec.max_positions:
            raise GenerationError(f"sequence of {past + n_new} tokens exceeds the model's "
                                  f"{self.spec.max_positions} positions")
        if hidden and not self.spec.hidden_name:
            raise GenerationError("this artifact's target graph has no hidden-state output: "
                                  "run `specdec distill` on it first")
        return rows

    def _cache_binding(self, cache: KVCache, plan: RowPlan, hidden: bool, greedy_head: bool) -> CallBinding:
        """Return the binding of a call on `cache` with its KV tensors bound: kept on the cache per kind of call
        for a shared buffer (reserved first: it may grow), a new one for a concat graph (it returns new present
        tensors every call: nothing to keep bound)."""
        if not self.shared_kv:
            call = CallBinding(self.session.io_binding())
            for name, value in zip(self._past_names, cache.tensors):
                call.io.bind_ortvalue_input(name, value)
            for name in self._present_names:
                call.output_allocated(name, self.device)
            return call
        cache.reserve(plan.total_length + self.spec.attention_pad_rows)  # the graph writes its pad rows there too
        call = cache.bindings.get((hidden, greedy_head))
        if call is None:
            call = cache.bindings[(hidden, greedy_head)] = CallBinding(self.session.io_binding())
        call.bind_cache(self._past_names, self._present_names, cache.tensors)
        return call

    def forward_batch(self, binding_for: Callable[[bool], CallBinding], caches: list[KVCache | None],
                      tokens: list[int], parked_lengths: list[int], capacity: int, greedy: bool) -> np.ndarray:
        """Run ONE call over len(caches) sequences, one new token each; return logits [len(caches), vocab].

        binding_for(greedy_head) returns the call's binding, every KV tensor bound to rows
        0..len(caches)-1 of the slot arena (SlotArena.binding), row i being caches[i]'s. A None row is
        parked: it writes a throwaway token at parked_lengths[i], past whatever its slot keeps. Each
        row attends over its own length (seqlens_k per row), so its logits are those of a batch-1 step
        over the same cache. A sequence must stay below `capacity` positions.
        """
        lengths = np.array([parked if c is None else c.length for c, parked in zip(caches, parked_lengths)],
                           dtype=np.int64)
        if any(c is not None and c.length >= capacity for c in caches):
            raise GenerationError(f"a sequence reached its slot's {capacity} positions")
        plan = batch_rows(self._graph_rows(), tokens, lengths)
        head = self._head(greedy, plan)
        call = binding_for(head is not None)
        logits = self._run(self.session, call, plan, head, self._plain_outputs(call, len(caches))).logits
        for cache, token in zip(caches, tokens):
            if cache is not None:
                cache.append(cache.tensors, [token])
        return logits

    def _graph_rows(self) -> GraphRows:
        """Return what this graph's inputs make of a call's rows (read each call: callers may swap the spec)."""
        spec = self.spec
        return GraphRows(spec.max_positions, spec.min_rows, keeps_rows=bool(spec.logits_rows_name),
                         head_row_start=bool(spec.greedy_head or spec.head_row_start_name))

    def _head(self, greedy: bool, plan: RowPlan) -> GreedyHead | None:
        """Return the 8-bit LM head a call of `plan` reads (greedy, and short enough), else None: the fp32 head."""
        return self.greedy_head if greedy and reads_greedy_head(self.spec, plan.returned) else None

    def _plain_outputs(self, call: CallBinding, batch: int = 1) -> _Outputs:
        """Return how a call of the plain graph binds its outputs: kept buffers for steps and verify calls."""
        def bind(name: str, rows: int, device: str) -> Callable[[], np.ndarray]:
            bound = self._output(call, name, rows, device, batch)
            return lambda: self._fetched(call, name, bound)

        return _Outputs(bind, lambda name: call.output_allocated(name, self.device))

    def _run(self, session: ort.InferenceSession, call: CallBinding, plan: RowPlan, head: GreedyHead | None,
             outputs: _Outputs, states: bool = False, long_call: bool = False,
             bind: Callable[[ort.IOBinding, str, np.ndarray], None] = ort.IOBinding.bind_cpu_input) -> _Result:
        """Bind `plan`'s call in `call` (its KV already bound; outputs through `outputs`) and run `session` once;
        return the logits rows the plan names (with `head`: the 8-bit LM head's, the fp32 logit of every token
        that may be its row's argmax, -inf elsewhere) and with `states` the hidden states of the fed tokens."""
        spec = self.spec
        _bind_feed(call.io, spec, plan, head is not None, long_call, bind)
        if head:
            outputs.empty(spec.logits_name)  # the fp32 head reads no row
            read_input = outputs.bind(spec.greedy_head["input_name"], plan.head_start + plan.head_rows, "cpu")
            read_logits = outputs.bind(spec.greedy_head["approx_name"], plan.head_rows, "cpu")
        else:
            read_logits = outputs.bind(spec.logits_name, plan.head_rows, self.device)
        read_states = outputs.bind(spec.hidden_name, plan.n_fed, "cpu") if states else None
        start = time.perf_counter()
        session.run_with_iobinding(call.io)
        seconds = time.perf_counter() - start
        # Copies (fancy indexing): the output buffers are written again by the binding's next call.
        sequences, rows = plan.logits_at
        greedy_rows = None
        if head:
            greedy_rows = (np.ascontiguousarray(read_input()[sequences, rows + plan.head_start]),
                           np.ascontiguousarray(read_logits()[sequences, rows, : self.vocab_limit]))
            logits = head.logits(*greedy_rows)
        else:
            logits = np.ascontiguousarray(read_logits()[sequences, rows, : self.vocab_limit])
        hidden = read_states()[plan.states_at].astype(np.float32, copy=False) if states else None
        return _Result(logits, hidden, greedy_rows, seconds)
