"""Prometheus metrics under the names vLLM and llama.cpp's server use, so their dashboards work.

vLLM's names come from prometheus_client (a counter `vllm:x` is exposed as `vllm:x_total`,
as vLLM's own are). llama.cpp writes its counters by hand without the `_total` suffix
(`llamacpp:spec_decode_num_drafts`, ggml-org/llama.cpp#26389), so those lines are written
here the same way. specdec's own (rejected, cancelled) carry the `specdec:` prefix.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specdec.runtime.loop import Iteration
from specdec.runtime.timeline import FirstTokenTimeline

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                   40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.4, 0.75, 1.0,
               2.5)


class ServerMetrics:
    """One registry per app (tests run several apps in one process)."""

    def __init__(self, model_name: str):
        self.registry = registry = CollectorRegistry()
        self.model = model_name
        label = ["model_name"]
        self.running = Gauge("vllm:num_requests_running", "Requests generating now.", label, registry=registry)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for a generation slot.", label,
                             registry=registry)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of the batch engine's KV slot positions in use.",
                              label, registry=registry)
        self.batch_size = Histogram("specdec:batch_size", "Sequences in each batched target call.", label,
                                    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64), registry=registry)
        self.success = Counter("vllm:request_success", "Finished requests, by finish reason.",
                               label + ["finished_reason"], registry=registry)
        self.rejected = Counter("specdec:requests_rejected", "Requests turned away (overloaded: 429; draining: 503).",
                                label + ["reason"], registry=registry)
        self.cancelled = Counter("specdec:requests_cancelled",
                                 "Generations stopped before their end (client disconnect, deadline, shutdown).",
                                 label + ["reason"], registry=registry)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", label, registry=registry)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", label, registry=registry)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Arrival to first text piece.", label,
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between streamed text pieces.", label,
                             buckets=ITL_BUCKETS, registry=registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to last token.", label,
                             buckets=LATENCY_BUCKETS, registry=registry)
        # Where the first token's time went (specdec/runtime/timeline.py): server, then the engine's parts, then stream.
        self.ttft_parts = Histogram("specdec:ttft_part_seconds", "Time to first token split by part: server (arrival "
                                    "to the engine), step_boundary, slot_wait, chunk_wait, prefill (the engine's), "
                                    "stream (first token to first piece sent).", label + ["part"],
                                    buckets=LATENCY_BUCKETS, registry=registry)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Time waiting for a slot.", label,
                                    buckets=LATENCY_BUCKETS, registry=registry)
        self.drafts = Counter("vllm:spec_decode_num_drafts", "Iterations that verified drafted tokens.", label,
                              registry=registry)
        self.draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Drafted tokens.", label, registry=registry)
        self.accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens", "Drafted tokens accepted.", label,
                                       registry=registry)
        self.accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                        "Drafts accepted at each draft position (0 = first drafted token).",
                                        label + ["position"], registry=registry)
        # vLLM V1's prefix-cache counters, in prompt tokens (--prefix-cache: hits are positions not prefilled)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      label, registry=registry)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens whose KV the prefix cache held.", label,
                                   registry=registry)
        self._prefix_counted = (0, 0)
        for metric in (self.running, self.waiting, self.prompt_tokens, self.generation_tokens, self.drafts,
                       self.draft_tokens, self.accepted_tokens, self.prefix_queries, self.prefix_hits):
            metric.labels(model_name)  # present at 0 from the start, as dashboards expect
        self._spec_lock = threading.Lock()
        self._spec = {"drafts": 0, "draft_tokens": 0, "accepted": 0}
        self._spec_per_pos: dict[int, int] = {}
        self._load = (0, 0)

    def observe_iteration(self, iteration: Iteration) -> None:
        """Count one decode iteration's drafts (called from the generation's thread)."""
        drafted = len(iteration.drafted)
        if iteration.prefill or drafted == 0:
            return
        accepted = iteration.num_accepted
        self.drafts.labels(self.model).inc()
        self.draft_tokens.labels(self.model).inc(drafted)
        self.accepted_tokens.labels(self.model).inc(accepted)
        for position in range(accepted):
            self.accepted_per_pos.labels(self.model, str(position)).inc()
        with self._spec_lock:
            self._spec["drafts"] += 1
            self._spec["draft_tokens"] += drafted
            self._spec["accepted"] += accepted
            for position in range(accepted):
                self._spec_per_pos[position] = self._spec_per_pos.get(position, 0) + 1

    def observe_ttft_parts(self, timeline: FirstTokenTimeline | None, arrival: float, first_piece: float) -> None:
        """Count where a request's first-token time went, from a batch engine's timeline (nothing without one)."""
        parts = timeline.parts() if timeline is not None else None
        if parts is None:
            return
        parts = {"server": timeline.submitted - arrival, **parts, "stream": first_piece - timeline.first_token}
        for part, seconds in parts.items():
            self.ttft_parts.labels(self.model, part).observe(max(seconds, 0.0))

    def observe_batch(self, rows: int) -> None:
        """Count one batched target call over `rows` sequences (called from the batch engine's thread)."""
        self.batch_size.labels(self.model).observe(rows)

    def set_load(self, running: int, waiting: int, kv_usage: float | None = None) -> None:
        """Set the running and waiting gauges, and the KV usage where a batch engine holds slots."""
        if kv_usage is not None:
            self.kv_usage.labels(self.model).set(kv_usage)
        self.running.labels(self.model).set(running)
        self.waiting.labels(self.model).set(waiting)
        self._load = (running, waiting)

    def set_prefix_cache(self, queried: int, hits: int) -> None:
        """Bring the prefix-cache counters up to the batch engine's totals (prompt tokens looked up, reused)."""
        counted_queries, counted_hits = self._prefix_counted
        self.prefix_queries.labels(self.model).inc(max(queried - counted_queries, 0))
        self.prefix_hits.labels(self.model).inc(max(hits - counted_hits, 0))
        self._prefix_counted = (max(queried, counted_queries), max(hits, counted_hits))

    def exposition(self) -> bytes:
        """Return the Prometheus text: prometheus_client's metrics, then llama.cpp's hand-written lines."""
        return generate_latest(self.registry) + self._llamacpp_lines().encode()

    def _llamacpp_lines(self) -> str:
        with self._spec_lock:
            spec, per_pos = dict(self._spec), dict(self._spec_per_pos)
        running, waiting = self._load
        rows = [("llamacpp:requests_processing", "gauge", "Number of requests processing.", running),
                ("llamacpp:requests_deferred", "gauge", "Number of requests deferred.", waiting),
                ("llamacpp:spec_decode_num_drafts", "counter", "Total number of speculative drafts.",
                 spec["drafts"]),
                ("llamacpp:spec_decode_num_draft_tokens", "counter", "Total draft tokens generated.",
                 spec["draft_tokens"]),
                ("llamacpp:spec_decode_num_accepted_tokens", "counter", "Total draft tokens accepted.",
                 spec["accepted"])]
        lines = []
        for name, kind, help_text, value in rows:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value:g}"]
        name = "llamacpp:spec_decode_num_accepted_tokens_per_pos"
        if per_pos:
            lines += [f"# HELP {name} Accepted draft tokens at each draft position.", f"# TYPE {name} counter"]
            lines += [f'{name}{{position="{p}"}} {per_pos[p]}' for p in sorted(per_pos)]
        return "\n".join(lines) + "\n"
