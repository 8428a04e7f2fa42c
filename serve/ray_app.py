"""The same app as a Ray Serve deployment: N replicas, each with its own engine and admission limits.

Ray Serve mounts the FastAPI app unchanged (`serve.ingress`); the app is built inside each
replica from a builder, because a live app (thread pool, metrics registry) does not pickle.
"""

from __future__ import annotations

import dataclasses
import functools
import signal
import threading

from specdec.models.errors import MissingDependencyError
from specdec.serve.config import ServeConfig

# A local Ray's object store otherwise takes 30% of RAM; replicas pass only small HTTP bodies.
LOCAL_OBJECT_STORE_BYTES = 256 * 1024 * 1024


def _ray_serve():
    try:
        import ray
        from ray import serve
    except ImportError:
        raise MissingDependencyError("Ray Serve is not installed; pip install 'specdec[ray]'") from None
    return ray, serve


def replica_config(config: ServeConfig, cpus_per_replica: float) -> ServeConfig:
    """Return `config` with engine threads sized to one replica's CPUs (unless threads were set)."""
    if config.threads is not None:
        return config
    return dataclasses.replace(config, threads=max(1, int(cpus_per_replica) // config.max_concurrency))


def build_app(config: ServeConfig, replicas: int, cpus_per_replica: float = 1.0, gpus_per_replica: float = 0.0):
    """Return the bound Ray Serve application (replicas x the specdec app)."""
    _, serve = _ray_serve()
    from specdec.serve.app import create_app

    config = replica_config(config, cpus_per_replica)
    config.validate()

    @serve.deployment(
        name="specdec",
        num_replicas=replicas,
        ray_actor_options={"num_cpus": cpus_per_replica, "num_gpus": gpus_per_replica},
        # every request reaches the app, whose own admission answers 429 beyond its queue
        max_ongoing_requests=config.max_concurrency + config.max_queue,
        health_check_period_s=5,
    )
    @serve.ingress()
    class SpecdecReplica:
        def __init__(self, replica_config: ServeConfig):
            self.config = replica_config

        def __serve_build_asgi_app__(self):
            # built in the replica, which loads its engine before taking traffic
            return create_app(self.config, load_in_background=False)

    return SpecdecReplica.bind(config)


def run(config: ServeConfig, host: str, port: int, replicas: int, cpus_per_replica: float = 1.0,
        gpus_per_replica: float = 0.0, address: str | None = None, ready: "threading.Event | None" = None) -> None:
    """Start Ray (or join `address`), deploy, serve on host:port until SIGINT/SIGTERM, then shut down."""
    ray, serve = _ray_serve()
    local = {} if address else {"object_store_memory": LOCAL_OBJECT_STORE_BYTES}
    ray.init(address=address, include_dashboard=False, logging_level="WARNING", **local)
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(build_app(config, replicas, cpus_per_replica, gpus_per_replica), name="specdec", route_prefix="/")
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        print(f"specdec serve (Ray Serve, {replicas} replicas): listening on http://{host}:{port}", flush=True)
        if ready is not None:
            ready.set()
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
