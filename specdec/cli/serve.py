"""`specdec serve`: the OpenAI-compatible server, one process or Ray Serve replicas."""

from __future__ import annotations

import logging
import socket
import sys

import click

from specdec.cli.options import draft_tokens_callback, max_batch_callback, provider_option, threads_option
from specdec.console import one_line_errors
from specdec.runtime.config import DRAFTER_CHOICES
from specdec.models.errors import SpecdecError
from specdec.models.extras import missing_dependency


@click.command()
@click.argument("artifact", type=click.Path(file_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="Port to listen on (0: any free port; the line on stdout says which).")
@click.option("--model-name", default=None, help="The model id clients send (default: the artifact folder's name).")
@click.option("--max-batch", default="auto", show_default=True, metavar="N|auto", callback=max_batch_callback,
              help="Requests decoded together, one target call per step for all of them (continuous batching "
                   "with speculation; each request holds a KV slot). auto: twice the artifact's ragged-rows graph "
                   "rows (16 for a default export; its rows for int4 and --exact-steps exports, 8 without that "
                   "graph). 1: each request runs alone on its own thread, --max-concurrency of them.")
@click.option("--kv-capacity", type=click.IntRange(min=16), default=1024, show_default=True,
              help="Positions per KV slot (prompt + max_tokens must fit); the memory taken is logged at start.")
@click.option("--prefix-cache/--no-prefix-cache", default=True, show_default=True,
              help="With --max-batch > 1: a prompt that starts as an earlier request's did (chat history, a system "
                   "prompt) reuses that slot's KV and skips prefilling it: only positions a fresh prefill computes "
                   "bit for bit alike, so the output is the same without it. A reply's positions count where its "
                   "steps verified drafts (a 1-token step rounds otherwise, but on int4 and --exact-steps "
                   "artifacts): see --reply-reuse-share.")
@click.option("--prefill-budget", type=click.IntRange(min=1), default=128, show_default=True, metavar="TOKENS",
              help="With --max-batch > 1: prompt tokens prefilled per step, in aligned 64-token chunks, the oldest "
                   "prompt first; they ride the running requests' call, which thus still get a token every step. "
                   "Larger: a burst's prompts start in fewer steps; smaller: running requests wait less per token "
                   "(128 measured best of 64-512 for short chats on 2 cores).")
@click.option("--prefill-itl-factor", type=float, default=0.0, show_default=True, metavar="F",
              help="With --max-batch > 1: while requests run, a step takes only the prompt tokens that keep its "
                   "estimated cost (from measured call costs) within F times the step without them, so a running "
                   "request's time between tokens stays near F x its idle value during a burst, in 16-token "
                   "pieces (the oldest prompt always gets one). On 2 CPU cores a 16-token piece costs about a "
                   "light load's whole step, so F 2 measured ~4x idle ITL p99 there, against 7x without, and "
                   "slower first tokens. 0: the --prefill-budget alone.")
@click.option("--reply-reuse-share", type=click.FloatRange(0, 1), default=0.0, show_default=True, metavar="F",
              help="With --max-batch > 1 and the prefix cache: keep replies reusable by the chat's next turn. A "
                   "request that would decode one token alone verifies a 1-token guess (prompt lookup's, kept if "
                   "the target agrees) where that adds at most F to the step's measured cost, so its positions "
                   "are computed as a prefill computes them. Trades tokens/s for the next turn's first token "
                   "(2 CPU cores, F 0.5: turn 2's TTFT 0.51x turn 1's at 1 client, against 0.96x; "
                   "tokens/s -11% at 1 client, -12% at 8). 0: off.")
@click.option("--reprefill-when-idle/--no-reprefill-when-idle", default=True, show_default=True,
              help="With --max-batch > 1 and the prefix cache: once no request has waited or run for 50 ms, compute "
                   "the replies that 1-token steps left unreusable again as a prefill does, 16 positions a call, so "
                   "the chat's next turn skips them and pays for its new message only. A request arriving meanwhile "
                   "waits for one such call at most; a client that sends its next request at once never does.")
@click.option("--max-concurrency", type=click.IntRange(min=1), default=1, show_default=True,
              help="With --max-batch 1: generations running at once; engine threads default to cores / this.")
@click.option("--max-queue", type=click.IntRange(min=0), default=16, show_default=True,
              help="Requests waiting for a slot; beyond them, 429 with Retry-After. With --max-batch they wait in "
                   "the batch engine's own queue, which admits the one a free slot serves best (--prefix-cache).")
@click.option("--request-timeout", type=float, default=300.0, show_default=True,
              help="Seconds from arrival (queue included) before a request is cut off (504).")
@click.option("--max-tokens-default", type=click.IntRange(min=1), default=256, show_default=True,
              help="max_tokens when a request sets none.")
@threads_option("onnxruntime intra-op threads (default: every core with --max-batch > 1, else cores / "
                "max-concurrency).")
@provider_option()
@click.option("--num-draft-tokens", "-k", default=None, metavar="K|auto", callback=draft_tokens_callback,
              help="Default K (requests may set num_draft_tokens). Default: the artifact's.")
@click.option("--drafter", type=click.Choice(DRAFTER_CHOICES), default="auto", show_default=True,
              help="Default drafter (requests may set drafter).")
@click.option("--api-key", "api_keys", multiple=True, envvar="SPECDEC_API_KEY", metavar="KEY",
              help="Require 'Authorization: Bearer KEY' on every route but /health (repeat for several keys; "
                   "also read from SPECDEC_API_KEY).")
@click.option("--api-key-file", type=click.Path(dir_okay=False, exists=True), default=None,
              help="A file of keys, one per line (blank lines and # comments skipped), added to --api-key.")
@click.option("--public-metrics", is_flag=True,
              help="Serve /metrics without a key (for a scraper on a private network).")
@click.option("--allow-no-key", is_flag=True,
              help="Start on a non-loopback --host without any key (anyone who reaches the port can generate).")
@click.option("--max-body-bytes", type=click.IntRange(min=1024), default=1 << 20, show_default=True,
              help="Largest POST body; a larger one gets 413.")
@click.option("--stats-in-response", is_flag=True,
              help="Add each request's speculative stats under \"specdec\" (requests may set specdec_stats).")
@click.option("--shutdown-grace", type=float, default=30.0, show_default=True,
              help="On SIGTERM/SIGINT: seconds running generations get to finish before they are cancelled.")
@click.option("--write-timeout", type=click.FloatRange(min=0, min_open=True), default=30.0, show_default=True,
              help="Seconds a streamed chunk may wait for the client to take it; then the request is cancelled "
                   "and its slot freed (a client that opens a stream and stops reading).")
@click.option("--header-timeout", type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True,
              help="Seconds a connection may take to send a request's headers (slow-header clients).")
@click.option("--keep-alive-timeout", type=click.FloatRange(min=0, min_open=True), default=5.0, show_default=True,
              help="Seconds an idle keep-alive connection stays open.")
@click.option("--ray", "use_ray", is_flag=True, help="Serve as a Ray Serve deployment (the `ray` extra).")
@click.option("--replicas", type=click.IntRange(min=1), default=2, show_default=True, help="With --ray: replicas.")
@click.option("--replica-cpus", type=float, default=1.0, show_default=True, help="With --ray: CPUs per replica.")
@click.option("--replica-gpus", type=float, default=0.0, show_default=True, help="With --ray: GPUs per replica.")
@click.option("--ray-address", default=None, help="With --ray: join this Ray cluster (default: start a local one).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True)
@one_line_errors
def serve(artifact, host, port, model_name, max_batch, kv_capacity, prefix_cache, prefill_budget, prefill_itl_factor,
          reply_reuse_share, reprefill_when_idle, max_concurrency,
          max_queue, request_timeout, max_tokens_default, threads, provider, num_draft_tokens, drafter, api_keys,
          api_key_file, public_metrics, allow_no_key, max_body_bytes, stats_in_response, shutdown_grace, write_timeout,
          header_timeout, keep_alive_timeout, use_ray, replicas, replica_cpus, replica_gpus, ray_address,
          log_level) -> None:
    """Serve ARTIFACT over HTTP with OpenAI's API (/v1/chat/completions, /v1/completions), /health, /metrics."""
    from specdec.models.manifest import load_manifest
    from specdec.serve.config import ServeConfig
    from specdec.serve.guard import is_loopback

    if max_batch is None:
        max_batch = load_manifest(artifact, check_files=False).target.serving_slots
    keys = tuple(api_keys) + _keys_from_file(api_key_file)
    if not keys and not is_loopback(host) and not allow_no_key:
        raise SpecdecError(f"--host {host} is reachable from other machines and no --api-key is set: give a key "
                           "(--api-key, --api-key-file or SPECDEC_API_KEY), or pass --allow-no-key")

    config = ServeConfig(artifact=artifact, model_name=model_name, max_batch=max_batch, kv_capacity=kv_capacity,
                         prefix_cache=prefix_cache, prefill_budget=prefill_budget, prefill_itl_factor=prefill_itl_factor,
                         reply_reuse_share=reply_reuse_share, reprefill_when_idle=reprefill_when_idle,
                         max_concurrency=max_concurrency,
                         max_queue=max_queue, request_timeout=request_timeout,
                         max_tokens_default=max_tokens_default, threads=threads, provider=provider,
                         num_draft_tokens=num_draft_tokens, drafter=drafter, stats_in_response=stats_in_response,
                         shutdown_grace=shutdown_grace, api_keys=keys, public_metrics=public_metrics, host=host,
                         max_body_bytes=max_body_bytes, write_timeout=write_timeout,
                         header_timeout=header_timeout, keep_alive_timeout=keep_alive_timeout)
    config.validate()
    # A bad artifact, or slots its graph cannot batch, fail here in one line, before any port opens.
    manifest = load_manifest(artifact, check_files=True)
    refusal = manifest.target.slots_refusal(max_batch) if max_batch > 1 else None
    if refusal:
        raise SpecdecError(refusal)
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if use_ray:
        from specdec.serve import ray_app

        ray_app.run(config, host, port, replicas, replica_cpus, replica_gpus, ray_address, log_level=log_level)
        return
    _serve_one_process(config, host, port, log_level)


def _serve_one_process(config, host: str, port: int, log_level: str) -> None:
    try:
        import uvicorn

        from specdec.serve.app import create_app
        from specdec.serve.http import uvicorn_config
    except ImportError as err:
        raise missing_dependency(err, "specdec serve", "serve") from None
    failures: list[str] = []
    server: uvicorn.Server | None = None

    def on_load_error(message: str) -> None:
        failures.append(message)
        if server is not None:
            server.should_exit = True

    app = create_app(config, on_load_error=on_load_error)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        raise SpecdecError(f"cannot listen on {host}:{port}: {err.strerror}") from None
    server = uvicorn.Server(uvicorn_config(app, config, log_level, access_log=log_level == "debug"))
    bound = sock.getsockname()[1]
    note = config.oversubscription()
    if note:
        click.echo(f"note: {note}", err=True)
    click.echo(f"specdec serve: listening on http://{host}:{bound} (model '{config.served_model_name}', "
               f"{_running(config)}, queue {config.max_queue})")
    sys.stdout.flush()
    server.run(sockets=[sock])
    if failures:
        raise SpecdecError(failures[0])


def _running(config) -> str:
    if config.max_batch > 1:
        return f"batches of up to {config.max_batch} x {config.engine_threads()} threads, KV {config.kv_capacity}"
    return f"{config.max_concurrency} concurrent x {config.engine_threads()} threads"


def _keys_from_file(path: str | None) -> tuple[str, ...]:
    if path is None:
        return ()
    with open(path) as f:
        return tuple(line.strip() for line in f if line.strip() and not line.lstrip().startswith("#"))
