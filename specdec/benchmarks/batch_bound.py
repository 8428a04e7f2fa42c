"""How much speculation could pay in a full batch on this machine: an upper bound from measured facts.

Two measurements, then arithmetic. (1) Each prompt of the load runs alone with prompt lookup at a large K
(greedy, the single loop): per iteration, how many drafts lookup proposed and how many the target accepted.
(2) The batch engine's calls are timed on this machine: the batched decode call over the lanes' rows and
the ragged-rows call over 8, 12, ... tokens spread across the rows. Then `lanes` closed-loop clients are
replayed step by step: every step advances each lane's request by one iteration.

- plain: each lane commits one token a step, in the cheaper of the batched and the ragged call;
- oracle: each lane drafts exactly the tokens the target will accept (foresight no plan has) and commits
  them plus one; the step is one ragged call over every lane's 1 + accepted tokens;
- lookup: each lane verifies everything lookup proposed (up to K), the naive batch.

oracle / plain bounds what any choice of K per request can gain over plain batching here, before prefills
(the same in both; they only dilute the ratio). Greedy outputs are the same in all three, so the tokens are.
The same replays priced with a flat step (a call costs the same whatever it feeds: the memory-bound regime a
GPU keeps at these sizes) give the `flat` column, where drafting everything lookup finds costs nothing and
oracle and lookup are one figure: arithmetic on this machine's traces, not a GPU measurement.

    python -m specdec.benchmarks.batch_bound artifacts/smollm2 --lanes 2,4,8 --threads 2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from specdec.runtime.calibration import cpu_model
from specdec.runtime.prompts import PromptCase, load_prompts

DEFAULT_PROMPTS = Path(__file__).with_name("prompts.jsonl")
RAGGED_TOTALS_PER_ROW = (1, 1.5, 2, 3, 4, 6, 8)  # tokens per row of the timed ragged calls (totals spread evenly)


@dataclass(frozen=True)
class Trace:
    """One prompt's run alone with prompt lookup: per iteration, the drafts proposed and the drafts accepted."""

    prompt_id: str
    group: str
    drafted: tuple[int, ...]
    accepted: tuple[int, ...]

    @property
    def new_tokens(self) -> int:
        """Return the tokens the run committed after its first (each iteration: accepted drafts + one)."""
        return sum(self.accepted) + len(self.accepted)


@dataclass(frozen=True)
class Replay:
    """What `lanes` clients committed in a replay, and the seconds its steps cost."""

    policy: str
    lanes: int
    tokens: int
    seconds: float
    steps: int
    verify_tokens: int  # tokens in all target calls of the replay (rows included)

    @property
    def tokens_per_second(self) -> float:
        """Return committed tokens per second of target calls."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def replay(traces: list[Trace], lanes: int, policy: str, step_seconds: Callable[[list[int]], float],
           requests_per_lane: int = 24) -> Replay:
    """Return the replay of `lanes` clients, lane j running traces j, j + 1, ... (cyclic, from its own start), until the first lane
    has run `requests_per_lane` requests (so every step is a full batch, as under closed-loop load).

    policy: "plain" (one token per lane a step), "oracle" (a lane verifies its iteration's accepted drafts)
    or "lookup" (it verifies every proposed draft). step_seconds(tokens per lane) prices one step.
    """
    if policy not in ("plain", "oracle", "lookup"):
        raise ValueError(f"unknown policy {policy!r}")
    position = [[j % len(traces), 0] for j in range(lanes)]  # (trace, iteration or token) per lane
    done = [0] * lanes
    tokens = steps = verify_tokens = 0
    seconds = 0.0
    while min(done) < requests_per_lane:
        fed, committed = [], 0
        for lane, (t, i) in enumerate(position):
            trace = traces[t]
            if policy == "plain":
                fed.append(1)
                committed += 1
                finished = i + 1 >= trace.new_tokens
            else:
                drafts = trace.accepted[i] if policy == "oracle" else trace.drafted[i]
                fed.append(1 + drafts)
                committed += 1 + trace.accepted[i]
                finished = i + 1 >= len(trace.accepted)
            position[lane][1] += 1
            if finished:
                position[lane] = [(t + 1) % len(traces), 0]
                done[lane] += 1
        seconds += step_seconds(fed)
        tokens += committed
        verify_tokens += sum(fed)
        steps += 1
    return Replay(policy, lanes, tokens, seconds, steps, verify_tokens)


def record_traces(engine, prompts: list[PromptCase], k: int, max_new_tokens: int) -> list[Trace]:
    """Return each prompt's trace: a greedy single-loop run with prompt lookup at a fixed K."""
    from specdec.runtime import GenerationConfig

    traces = []
    for prompt in prompts:
        iterations = []
        config = GenerationConfig(max_new_tokens=max_new_tokens, num_draft_tokens=k, drafter="ngram",
                                  chat=prompt.chat)
        engine.generate(prompt.prompt, config,
                        on_iteration=lambda it: None if it.prefill else iterations.append(it))
        traces.append(Trace(prompt.id, prompt.group, tuple(len(it.drafted) for it in iterations),
                            tuple(it.num_accepted for it in iterations)))
    return traces


def time_steps(batch, lanes: int, max_tokens: int, repeats: int) -> tuple[float | None, dict[int, float]]:
    """Return (the batched decode call over `lanes` rows, None where the plain graph does not batch (int4: its
    steps run in the ragged graph), {total tokens: the ragged call with them spread evenly over the lanes}).

    Both read the fp32 LM head: the 8-bit greedy head's bound check fails on the timing calls' made-up tokens,
    and where it holds it makes short (plain) calls cheaper, so the fp32 head is the kinder measure for
    speculation."""
    plain = batch.time_batched_call(lanes, repeats=repeats) if batch.arena.plain_batches else None
    ragged = {}
    for per_row in RAGGED_TOTALS_PER_ROW:
        total = int(round(per_row * lanes))
        if total > max_tokens or total in ragged:
            continue
        spread = [total // lanes + (1 if j < total % lanes else 0) for j in range(lanes)]
        ragged[total] = batch.time_ragged_call(spread, repeats=repeats)
    return plain, ragged


def step_pricer(plain: float | None, ragged: dict[int, float]) -> Callable[[list[int]], float]:
    """Return step_seconds(tokens per lane): the cheaper call for an all-ones step, else the ragged call's
    time at that total, linear between (and beyond) the totals timed."""
    totals = sorted(ragged)

    def ragged_seconds(total: int) -> float:
        if total in ragged:
            return ragged[total]
        lo = max([t for t in totals if t < total], default=totals[0])
        hi = min([t for t in totals if t > total], default=totals[-1])
        if lo == hi:
            lo, hi = (totals[-2], totals[-1]) if total > totals[-1] else (totals[0], totals[1])
        return ragged[lo] + (ragged[hi] - ragged[lo]) * (total - lo) / (hi - lo)

    def step_seconds(fed: list[int]) -> float:
        total = sum(fed)
        if total == len(fed) and plain is not None:
            return min(plain, ragged_seconds(total))
        return ragged_seconds(total)

    return step_seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path, help="artifact folder with a ragged-rows graph (specdec export)")
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="the load's prompts (JSON lines)")
    parser.add_argument("--lanes", default="2,4,8", help="client counts to replay, comma separated (at most the "
                        "ragged graph's rows; 1 is priced on that graph too, not the single loop's calls)")
    parser.add_argument("-k", type=int, default=16, help="lookup's K in the recorded runs (the oracle's ceiling)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="answer length, as in the serve load")
    parser.add_argument("--threads", type=int, default=2, help="onnxruntime intra-op threads")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per shape (the fastest is kept)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    from specdec.models.errors import SpecdecError
    from specdec.runtime import BatchEngine, Engine

    try:
        lanes = sorted({int(n) for n in args.lanes.split(",")})
        engine = Engine.load(args.artifact, provider="cpu", threads=args.threads, shared_threads=True)  # as serve runs it
        started = time.time()
        traces = record_traces(engine, load_prompts(args.prompts), args.k, args.max_new_tokens)
        batch = BatchEngine(engine, max_batch=max(lanes))
        try:
            rows = []
            for n in lanes:
                plain, ragged = time_steps(batch, n, max_tokens=n * (args.k + 1), repeats=args.repeats)
                price = step_pricer(plain, ragged)
                runs = {p: replay(traces, n, p, price) for p in ("plain", "oracle", "lookup")}
                flat = {p: replay(traces, n, p, lambda fed: 1.0).tokens_per_second for p in ("plain", "oracle", "lookup")}
                rows.append({"lanes": n, "batched_call_s": plain if plain is not None else ragged[n], "ragged_call_s": ragged,
                             **{f"{p}_tok_s": r.tokens_per_second for p, r in runs.items()},
                             "oracle_vs_plain": runs["oracle"].tokens_per_second / runs["plain"].tokens_per_second,
                             "lookup_vs_plain": runs["lookup"].tokens_per_second / runs["plain"].tokens_per_second,
                             "flat_oracle_vs_plain": flat["oracle"] / flat["plain"],
                             "flat_lookup_vs_plain": flat["lookup"] / flat["plain"],
                             "replays": [asdict(r) for r in runs.values()]})
        finally:
            batch.shutdown()
    except (SpecdecError, OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    report = {"cpu": cpu_model() or "unknown CPU", "threads": args.threads, "artifact": str(args.artifact), "k": args.k,
              "seconds": time.time() - started, "traces": [asdict(t) for t in traces], "lanes": rows}
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"{report['cpu']}, {args.threads} threads, {args.artifact}, lookup K {args.k}, {args.max_new_tokens} tokens")
    for t in traces:
        print(f"  {t.prompt_id:>10} ({t.group}): {len(t.accepted)} iterations, "
              f"{sum(t.drafted)} drafted, {sum(t.accepted)} accepted of {t.new_tokens} tokens")
    print("| lanes | batched call ms | plain tok/s | oracle tok/s | lookup tok/s | oracle / plain | lookup / plain "
          "| flat step: lookup / plain |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['lanes']} | {row['batched_call_s'] * 1e3:.1f} | {row['plain_tok_s']:.1f} | "
              f"{row['oracle_tok_s']:.1f} | {row['lookup_tok_s']:.1f} | {row['oracle_vs_plain']:.2f}x | "
              f"{row['lookup_vs_plain']:.2f}x | {row['flat_lookup_vs_plain']:.2f}x |")
    for row in rows:
        print(f"  ragged call ms by tokens at {row['lanes']} lanes: "
              + ", ".join(f"{n}: {s * 1e3:.1f}" for n, s in sorted(row["ragged_call_s"].items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
