"""The same app as a Ray Serve deployment: N replicas, each with its own engine and admission limits.

Ray Serve mounts the FastAPI app unchanged (`serve.ingress`); the app is built inside each
replica from a builder, because a live app (thread pool, metrics registry) does not pickle.

A local Ray (no `address`) is one node that nothing else joins, so its own servers (GCS,
raylet, agents, workers) are kept on the loopback address: see `local_ray_environment`.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import sys
import threading

from specdec.models.errors import SpecdecError
from specdec.models.extras import missing_dependency
from specdec.serve.config import ServeConfig, available_cores

# A local Ray's object store otherwise takes 30% of RAM; replicas pass only small HTTP bodies.
LOCAL_OBJECT_STORE_BYTES = 256 * 1024 * 1024
# Ray's switch for "this node is not part of a cluster": its node IP becomes 127.0.0.1 and its
# gRPC servers and agents then listen there instead of on every interface (read at `import ray`,
# and by every Ray process it starts, so it goes into the environment).
LOOPBACK_NODE_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
LOOPBACK = "127.0.0.1"


def local_ray_environment() -> None:
    """Set the environment a local, loopback-only Ray needs (before Ray is imported, ideally)."""
    os.environ.update(LOOPBACK_NODE_ENV)
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:  # Ray already imported in this process: its constant was read already
        constants.ENABLE_RAY_CLUSTER = False


def _ray_serve():
    try:
        import ray
        from ray import serve
    except ImportError as err:
        raise missing_dependency(err, "specdec serve --ray", "ray") from None
    return ray, serve


def replica_config(config: ServeConfig, cpus_per_replica: float) -> ServeConfig:
    """Return `config` with engine threads sized to one replica's CPUs (unless threads were set)."""
    if config.threads is not None:
        return config
    per_call = 1 if config.max_batch > 1 else config.max_concurrency  # the batch engine makes one call at a time
    return dataclasses.replace(config, threads=max(1, int(cpus_per_replica) // per_call))


def check_local_resources(replicas: int, cpus_per_replica: float, gpus_per_replica: float,
                          cpus: int | None = None) -> None:
    """Raise SpecdecError when a local Ray could never place `replicas` (it would wait forever)."""
    cpus = cpus if cpus is not None else available_cores()
    if cpus_per_replica <= 0:
        raise SpecdecError(f"--replica-cpus must be > 0, got {cpus_per_replica:g}")
    if gpus_per_replica < 0:
        raise SpecdecError(f"--replica-gpus must be >= 0, got {gpus_per_replica:g}")
    if replicas * cpus_per_replica > cpus + 1e-9:
        raise SpecdecError(f"{replicas} replicas x {cpus_per_replica:g} CPUs need {replicas * cpus_per_replica:g} "
                           f"CPUs; this machine has {cpus} (lower --replica-cpus or --replicas)")


def _bind_replica_grpc_to_loopback() -> None:
    """On a loopback node, keep the replica's inter-deployment gRPC server on 127.0.0.1 too.

    Ray Serve binds that one server to "[::]:0" whatever the node IP (ray/serve/_private/
    replica.py, Ray 2.60), the only listener the node setting does not reach. The replica's
    own constructor runs before that server starts, so wrapping the bind call here is enough.
    On a cluster node (node IP not loopback) nothing changes.
    """
    import ray
    from ray.serve._private import replica

    original = getattr(replica, "add_port_to_grpc_server", None)
    if original is None or getattr(original, "specdec_loopback", False):
        return
    if ray.util.get_node_ip_address() != LOOPBACK:
        return

    def bind(server, address: str):
        if address.startswith("[::]:"):
            address = f"{LOOPBACK}:{address[len('[::]:'):]}"
        return original(server, address)

    bind.specdec_loopback = True
    replica.add_port_to_grpc_server = bind


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
        max_ongoing_requests=config.running_limit + config.max_queue,
        # Ray's router holds at most this many when every replica is full (then Ray answers 503)
        max_queued_requests=max(1, config.max_queue),
        max_constructor_retry_count=2,  # a replica that cannot load its engine fails the deploy fast
        health_check_period_s=5,
        graceful_shutdown_timeout_s=config.shutdown_grace,  # running streams finish, as in one process
    )
    @serve.ingress()
    class SpecdecReplica:
        def __init__(self, replica_config: ServeConfig):
            self.config = replica_config
            _bind_replica_grpc_to_loopback()

        def __serve_build_asgi_app__(self):
            # built in the replica, which loads its engine before taking traffic
            self._specdec_app = create_app(self.config, load_in_background=False)  # Ray's ingress owns `app`
            return self._specdec_app

        def check_health(self) -> None:
            """Raise (Ray restarts the replica) when the engine failed or the batch scheduler died."""
            state = getattr(getattr(self, "_specdec_app", None), "state", None)
            state = getattr(state, "specdec", None)
            if state is not None:
                state.raise_if_unhealthy()

    return SpecdecReplica.bind(config)


APP_ARGS = ("replicas", "replica_cpus", "replica_gpus")


def app_builder(args: dict):
    """Return the Ray Serve application from a config file's `args` (`serve run`, KubeRay's RayService).

    `args` holds ServeConfig's fields (artifact required) plus replicas, replica_cpus and
    replica_gpus; the import path is `specdec.serve.ray_app:app_builder`.
    """
    args = dict(args)
    placement = {name: args.pop(name) for name in APP_ARGS if name in args}
    fields = {f.name for f in dataclasses.fields(ServeConfig)}
    unknown = sorted(set(args) - fields)
    if unknown or "artifact" not in args:
        raise SpecdecError(f"app_builder args: {'unknown ' + ', '.join(unknown) if unknown else 'artifact missing'}"
                           f" (use {', '.join(sorted(fields | set(APP_ARGS)))})")
    return build_app(ServeConfig(**args), int(placement.get("replicas", 1)),
                     float(placement.get("replica_cpus", 1.0)), float(placement.get("replica_gpus", 0.0)))


def free_port(host: str) -> int:
    """Return a port free on `host` now (Ray Serve's proxy takes a fixed port, not 0)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def run(config: ServeConfig, host: str, port: int, replicas: int, cpus_per_replica: float = 1.0,
        gpus_per_replica: float = 0.0, address: str | None = None, ready: "threading.Event | None" = None,
        log_level: str = "warning") -> None:
    """Start Ray (or join `address`), deploy, serve on host:port until SIGINT/SIGTERM, then shut down.

    Without `address`, a local Ray is started on the loopback address and stopped at the end.
    """
    if address is None:
        check_local_resources(replicas, cpus_per_replica, gpus_per_replica)
        local_ray_environment()
    ray, serve = _ray_serve()
    port = port or free_port(host)
    local = {} if address else {"object_store_memory": LOCAL_OBJECT_STORE_BYTES}
    context = ray.init(address=address, include_dashboard=False, logging_level="WARNING", **local)
    # Ray leaves this folder (logs, sockets) behind when it stops: say where it is.
    session_folder = context.address_info.get("session_dir", "Ray's temp folder")
    stop = threading.Event()
    try:
        # per-request access lines only at debug, as the one-process server does
        logging_config = {"log_level": log_level.upper(), "enable_access_log": log_level == "debug"}
        serve.start(http_options={"host": host, "port": port}, logging_config=logging_config)
        serve.run(build_app(config, replicas, cpus_per_replica, gpus_per_replica), name="specdec",
                  route_prefix="/", logging_config=logging_config)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        print(f"specdec serve (Ray Serve, {replicas} replicas x {cpus_per_replica:g} CPUs): listening on "
              f"http://{host}:{port} (model '{config.served_model_name}'); Ray keeps its session files in "
              f"{session_folder}", flush=True)
        if ready is not None:
            ready.set()
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
