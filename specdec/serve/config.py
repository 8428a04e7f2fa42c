"""The server's settings: one dataclass the CLI and the Ray deployment fill in."""

from __future__ import annotations

import os
from dataclasses import dataclass

from specdec.models.errors import SpecdecError

CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"  # cgroup v2: "<quota> <period>" or "max <period>"


def available_cores(cpu_max: str = CGROUP_CPU_MAX) -> int:
    """Return the cores this process may use: its CPU affinity, capped by a cgroup v2 CPU quota.

    os.cpu_count() counts the node's cores; in a container limited to 2 CPUs on a 64-core node
    it would size 64 threads per generation.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open(cpu_max) as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return max(1, cores)


@dataclass(frozen=True)
class ServeConfig:
    """How one server process (or one Ray replica) serves one artifact."""

    artifact: str
    model_name: str | None = None  # the `model` clients send; None: the artifact folder's name
    max_concurrency: int = 1  # with max_batch 1: generations running at once (each in its own pool thread)
    # Requests decoded together by one batch engine (specdec/runtime/batch.py), each in a KV slot of
    # kv_capacity positions; 1: each generation runs alone on its own thread (max_concurrency of them).
    max_batch: int = 1
    kv_capacity: int = 1024
    # batch engine: a prompt that starts as a slot's context did skips those positions (only those a fresh prefill
    # computes bit for bit alike, so the output is the same without it)
    prefix_cache: bool = True
    # batch engine: prompt tokens prefilled per step, riding the running requests' call (BatchEngine's default)
    prefill_budget: int = 128
    # batch engine: while requests run, a step's prompt tokens keep it within this many times its cost without them
    # (their inter-token latency during a burst); None or 0: the budget alone
    prefill_itl_factor: float | None = None
    # batch engine: guess rows may add this share to a step's cost to keep replies reusable (guess_rows.py); 0: off
    reply_reuse_share: float = 0.0
    # batch engine: while no request waits or runs, compute kept replies again as a prefill does, so the chat's next
    # turn reuses them (batch_idle.py)
    reprefill_when_idle: bool = True
    max_queue: int = 16  # requests waiting for a slot; one more gets 429 + Retry-After
    request_timeout: float = 300.0  # seconds from arrival (queue included) until a request is cut off
    max_tokens_default: int = 256  # max_tokens when the request sets none
    # onnxruntime intra-op threads per generation; None: available_cores() // max_concurrency, so that
    # threads x concurrent generations <= cores (more only makes the runs fight for cores)
    threads: int | None = None
    provider: str = "auto"
    num_draft_tokens: int | str | None = None  # server default K (None: the artifact's)
    drafter: str = "auto"  # server default drafter
    # Bearer keys checked on every route but /health (and /metrics when public_metrics); empty: no key.
    api_keys: tuple[str, ...] = ()
    public_metrics: bool = False
    host: str = "127.0.0.1"  # the address bound: on a loopback one, requests must name a loopback Host
    max_body_bytes: int = 1 << 20  # larger POST bodies get 413
    stats_in_response: bool = False  # add per-request speculative stats ("specdec") to every response
    shutdown_grace: float = 30.0  # on SIGTERM, seconds running generations get to finish before cancel
    # A stream chunk the client does not take within this many seconds cancels the request (its slot is freed).
    write_timeout: float = 30.0
    header_timeout: float = 10.0  # seconds a connection may take to send a request's headers
    keep_alive_timeout: float = 5.0  # seconds an idle keep-alive connection stays open

    def validate(self) -> None:
        """Raise SpecdecError for an out-of-range setting."""
        if self.max_concurrency < 1:
            raise SpecdecError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.max_batch < 1:
            raise SpecdecError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.kv_capacity < 16:
            raise SpecdecError(f"kv_capacity must be >= 16 positions, got {self.kv_capacity}")
        if self.prefill_budget < 1:
            raise SpecdecError(f"prefill_budget must be >= 1 prompt token a step, got {self.prefill_budget}")
        if self.prefill_itl_factor and not self.prefill_itl_factor > 1:
            raise SpecdecError(f"prefill_itl_factor must be > 1 (0: off), got {self.prefill_itl_factor}")
        if not 0 <= self.reply_reuse_share <= 1:
            raise SpecdecError(f"reply_reuse_share must be in [0, 1], got {self.reply_reuse_share}")
        if self.max_body_bytes < 1024:
            raise SpecdecError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if any(not key or key != key.strip() for key in self.api_keys):
            raise SpecdecError("an API key must be non-empty, without surrounding spaces")
        if self.max_queue < 0:
            raise SpecdecError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.request_timeout <= 0:
            raise SpecdecError(f"request_timeout must be > 0 seconds, got {self.request_timeout}")
        if self.max_tokens_default < 1:
            raise SpecdecError(f"max_tokens_default must be >= 1, got {self.max_tokens_default}")
        for name in ("write_timeout", "header_timeout", "keep_alive_timeout"):
            if not getattr(self, name) > 0:
                raise SpecdecError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.threads is not None and self.threads < 1:
            raise SpecdecError(f"threads must be >= 1, got {self.threads}")

    @property
    def served_model_name(self) -> str:
        """Return the model id clients address (`model` in requests, `id` in /v1/models)."""
        return self.model_name or os.path.basename(os.path.normpath(self.artifact))

    @property
    def running_limit(self) -> int:
        """Return how many requests generate at once: the batch's slots, or the concurrent generations."""
        return self.max_batch if self.max_batch > 1 else self.max_concurrency

    def engine_threads(self, cores: int | None = None) -> int:
        """Return intra-op threads per call: `threads`, else every core for the batch engine's one call at a
        time, else cores // max_concurrency (at least 1)."""
        if self.threads is not None:
            return self.threads
        if self.max_batch > 1:
            return cores or available_cores()
        return max(1, (cores or available_cores()) // self.max_concurrency)

    def oversubscription(self, cores: int | None = None) -> str | None:
        """Return a one-line note when threads x concurrent generations exceed the cores, else None."""
        cores = cores or available_cores()
        threads = self.engine_threads(cores)
        if self.max_batch > 1 or threads * self.max_concurrency <= cores:
            return None
        return (f"{threads} threads x {self.max_concurrency} concurrent generations > {cores} cores: the "
                f"generations will compete for cores (leave --threads unset to size it to cores / concurrency)")
