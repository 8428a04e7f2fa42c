"""How much speculation could pay in a full batch on this machine: an upper bound from measured facts.

Two measurements, then arithmetic. (1) Each prompt of the load runs alone with prompt lookup at a large K
(greedy, the single loop): per iteration, how many drafts lookup proposed and how many the target accepted.
(2) The batch engine's calls are timed on this machine: the batched decode call over the lanes' rows and
the ragged-rows call over 8, 12, ... tokens spread across the rows. Then `lanes` closed-loop clients are
replayed step by step (`replay`): each step a policy gives every lane its K, and the lane commits the
accepted drafts among them plus one token.

- plain: no drafts, one token a lane, in the cheaper of the batched and the ragged call;
- oracle: each lane drafts exactly the tokens the target will accept (foresight no plan has); the step is
  one ragged call over every lane's 1 + accepted tokens;
- lookup: each lane verifies everything lookup proposed (up to K), the naive batch;
- plan: the batch engine's own choice (batch_plan.choose_draft_lengths_ragged over each request's record, at
  the serving K), without the engine's noise: what its estimates lose against the oracle.

oracle / plain bounds what any choice of K per request can gain over plain batching here, before prefills
(the same in all; they only dilute the ratio). Greedy outputs are the same under every policy, so the tokens are.
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from specdec.data import PROMPTS_FILE
from specdec.runtime.machine import cpu_model
from specdec.runtime.batch_plan import DraftCandidate, DraftRecord, choose_draft_lengths_ragged
from specdec.runtime.prompts import PromptCase, load_prompts

DEFAULT_PROMPTS = PROMPTS_FILE
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


@dataclass
class LaneShadow:
    """Drafts lookup proposed that the plan left unverified (batch_plan.ShadowDraft, as counts): settled after
    `steps_left` more plain steps, when the target's tokens have met a wrong draft or all of them."""

    drafted: int
    accepted: int
    steps_left: int


@dataclass
class Lane:
    """One closed-loop client of a replay: where its request is in its trace, and that request's own record."""

    trace: int
    iteration: int = 0
    consumed: int = 0  # tokens of the current iteration committed so far (its accepted drafts, then one more)
    record: DraftRecord = field(default_factory=DraftRecord)  # the request's own, as the batch engine keeps it
    shadows: list[LaneShadow] = field(default_factory=list)  # lookups it left unverified, not yet settled

    def left(self, trace: Trace) -> tuple[int, int]:
        """Return (drafts lookup proposes now, how many of them the target accepts) in the current iteration."""
        return (max(trace.drafted[self.iteration] - self.consumed, 0),
                max(trace.accepted[self.iteration] - self.consumed, 0))


# A policy: the K of every lane this step, from the lanes and the traces.
Policy = Callable[[list[Lane], list[Trace]], list[int]]


def plain_policy(lanes: list[Lane], traces: list[Trace]) -> list[int]:
    """Return no drafts for any lane."""
    return [0] * len(lanes)


def oracle_policy(lanes: list[Lane], traces: list[Trace]) -> list[int]:
    """Return, per lane, exactly the drafts the target will accept (foresight no plan has)."""
    return [lane.left(traces[lane.trace])[1] for lane in lanes]


def lookup_policy(k: int) -> Policy:
    """Return the policy that verifies every draft lookup proposes, up to k."""
    return lambda lanes, traces: [min(lane.left(traces[lane.trace])[0], k) for lane in lanes]


def plan_policy(k: int, batch_seconds: Callable[[int], float], ragged_seconds: Callable[[int], float],
                margin: float) -> Policy:
    """Return the batch engine's plan (batch_plan.choose_draft_lengths_ragged over each request's own record) for
    lookups of up to k drafts, priced by these call costs."""

    def choose(lanes: list[Lane], traces: list[Trace]) -> list[int]:
        found = [min(lane.left(traces[lane.trace])[0], k) for lane in lanes]
        asking = [i for i, n in enumerate(found) if n]
        candidates = [DraftCandidate(found[i], 0.5, kept=lanes[i].record.kept(found[i])) for i in asking]
        ks = [0] * len(lanes)
        if candidates:
            chosen = choose_draft_lengths_ragged(candidates, len(lanes) - len(candidates), batch_seconds,
                                                 ragged_seconds, margin=margin)
            for i, n in zip(asking, chosen):
                ks[i] = n
        for i in asking:  # as the engine does, a lane that decodes plainly follows what lookup proposed
            if ks[i] == 0:
                accepted = min(lanes[i].left(traces[lanes[i].trace])[1], found[i])
                lanes[i].shadows.append(LaneShadow(found[i], accepted, min(accepted + 1, found[i])))
        return ks

    return choose


def replay(traces: list[Trace], lanes: int, policy: Policy, step_seconds: Callable[[list[int]], float],
           requests_per_lane: int = 24, name: str = "") -> Replay:
    """Return the replay of `lanes` clients, lane j running traces j, j + 1, ... (cyclic, from its own start), until
    the first lane has run `requests_per_lane` requests (so every step is a full batch, as under closed-loop load).

    Each step the policy gives every lane its K (at most what lookup proposes now); a lane commits its accepted
    drafts of them plus one token. A K under the iteration's accepted drafts leaves the rest of that copy for its
    next step (lookup proposes the continuation); one token with no draft is the target's next, as plainly
    decoded. step_seconds(tokens per lane) prices one step.
    """
    state = [Lane(j % len(traces)) for j in range(lanes)]
    done = [0] * lanes
    tokens = steps = verify_tokens = 0
    seconds = 0.0
    while min(done) < requests_per_lane:
        ks = policy(state, traces)
        for j, (lane, k) in enumerate(zip(state, ks)):
            trace = traces[lane.trace]
            proposed, accepted = lane.left(trace)
            if k > proposed:
                raise ValueError(f"policy {name!r} drafted {k} where lookup proposes {proposed}")
            kept = min(k, accepted)
            lane.record.observe(k, kept)
            _follow_shadows(lane, k)
            lane.consumed += kept + 1
            tokens += kept + 1
            if lane.consumed > trace.accepted[lane.iteration]:  # the iteration's last token is committed
                lane.iteration, lane.consumed = lane.iteration + 1, 0
                if lane.iteration == len(trace.accepted):  # the request is done: the client sends the next
                    state[j] = Lane((lane.trace + 1) % len(traces))
                    done[j] += 1
        fed = [1 + k for k in ks]
        seconds += step_seconds(fed)
        verify_tokens += sum(fed)
        steps += 1
    return Replay(name, lanes, tokens, seconds, steps, verify_tokens)


def _follow_shadows(lane: Lane, k: int) -> None:
    """Settle each of a lane's shadows into its record once its plain steps reached its end (all dropped when the
    lane verifies drafts of its own, as the engine does)."""
    if k:
        lane.shadows = []
        return
    for shadow in lane.shadows:
        shadow.steps_left -= 1
        if shadow.steps_left == 0:
            lane.record.observe(shadow.drafted, shadow.accepted)
    lane.shadows = [shadow for shadow in lane.shadows if shadow.steps_left > 0]


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


@dataclass(frozen=True)
class CallPrices:
    """What a step costs here: the batched decode call over the lanes (None: the plain graph does not batch) and
    the ragged call by total tokens, timed at some totals and linear between (and beyond) them."""

    lanes: int
    batched: float | None
    ragged_by_tokens: dict[int, float]

    def ragged(self, total: int) -> float:
        """Return the ragged call's seconds over `total` tokens."""
        known, totals = self.ragged_by_tokens, sorted(self.ragged_by_tokens)
        if total in known:
            return known[total]
        lo = max([t for t in totals if t < total], default=totals[0])
        hi = min([t for t in totals if t > total], default=totals[-1])
        if lo == hi:
            lo, hi = (totals[-2], totals[-1]) if total > totals[-1] else (totals[0], totals[1])
        return known[lo] + (known[hi] - known[lo]) * (total - lo) / (hi - lo)

    def plain(self, rows: int) -> float:
        """Return a step of `rows` one-token rows: the cheaper of the batched and the ragged call."""
        return self.ragged(rows) if self.batched is None else min(self.batched, self.ragged(rows))

    def step(self, fed: list[int]) -> float:
        """Return the seconds of a step feeding fed[j] tokens to lane j."""
        total = sum(fed)
        return self.plain(total) if total == len(fed) else self.ragged(total)


def lane_counts(text: str) -> list[int]:
    """Return the sorted client counts of a comma-separated list such as "2,4,8" (argparse type: a bad list is
    refused before any work)."""
    try:
        counts = sorted({int(part) for part in text.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected whole numbers separated by commas, got {text!r}") from None
    if counts[0] < 1:
        raise argparse.ArgumentTypeError(f"client counts must be >= 1, got {text!r}")
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path, help="artifact folder with a ragged-rows graph (specdec export)")
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="the load's prompts (JSON lines)")
    parser.add_argument("--lanes", type=lane_counts, default="2,4,8", help="client counts to replay, comma separated (at most the "
                        "ragged graph's rows; 1 is priced on that graph too, not the single loop's calls)")
    parser.add_argument("-k", type=int, default=16, help="lookup's K in the recorded runs (the oracle's ceiling)")
    parser.add_argument("--plan-k", type=int, default=4,
                        help="the K the replayed plan may give a lookup (the artifact's default K under serve)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="answer length, as in the serve load")
    parser.add_argument("--threads", type=int, default=2, help="onnxruntime intra-op threads")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per shape (the fastest is kept)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    from specdec.models.errors import SpecdecError
    from specdec.runtime import BatchEngine, Engine
    from specdec.runtime.batch import DRAFT_MARGIN

    try:
        lanes = args.lanes
        # one shared thread pool, as `specdec serve` loads a batching engine
        engine = Engine.load(args.artifact, provider="cpu", threads=args.threads, shared_threads=True)
        started = time.time()
        prompts = load_prompts(args.prompts)
        print(f"recording {len(prompts)} prompts alone with prompt lookup at K {args.k}", file=sys.stderr)
        traces = record_traces(engine, prompts, args.k, args.max_new_tokens)
        batch = BatchEngine(engine, max_batch=max(lanes))
        try:
            rows = []
            for n in lanes:
                print(f"timing the calls of {n} lanes, replaying", file=sys.stderr)
                plain, ragged = time_steps(batch, n, max_tokens=n * (args.k + 1), repeats=args.repeats)
                prices = CallPrices(n, plain, ragged)
                policies = {"plain": plain_policy, "oracle": oracle_policy, "lookup": lookup_policy(args.k),
                            "plan": plan_policy(args.plan_k, prices.plain, prices.ragged, DRAFT_MARGIN)}
                runs = {name: replay(traces, n, policy, prices.step, name=name) for name, policy in policies.items()}
                flat = {name: replay(traces, n, policies[name], lambda fed: 1.0, name=name).tokens_per_second
                        for name in ("plain", "lookup")}
                base = runs["plain"].tokens_per_second
                rows.append({"lanes": n, "batched_call_s": plain if plain is not None else ragged[n],
                             "ragged_call_s": ragged, **{f"{p}_tok_s": r.tokens_per_second for p, r in runs.items()},
                             **{f"{p}_vs_plain": runs[p].tokens_per_second / base
                                for p in ("oracle", "lookup", "plan")},
                             "flat_lookup_vs_plain": flat["lookup"] / flat["plain"],
                             "replays": [asdict(r) for r in runs.values()]})
        finally:
            batch.shutdown()
    except (SpecdecError, OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    report = {"cpu": cpu_model() or "unknown CPU", "threads": args.threads, "artifact": str(args.artifact),
              "k": args.k, "plan_k": args.plan_k, "seconds": time.time() - started,
              "traces": [asdict(t) for t in traces], "lanes": rows}
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"{report['cpu']}, {args.threads} threads, {args.artifact}, lookup K {args.k}, {args.max_new_tokens} tokens")
    for t in traces:
        print(f"  {t.prompt_id:>10} ({t.group}): {len(t.accepted)} iterations, "
              f"{sum(t.drafted)} drafted, {sum(t.accepted)} accepted of {t.new_tokens} tokens")
    print(f"| lanes | batched call ms | plain tok/s | oracle / plain | lookup / plain | plan (K {args.plan_k}) / plain "
          "| flat step: lookup / plain |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['lanes']} | {row['batched_call_s'] * 1e3:.1f} | {row['plain_tok_s']:.1f} | "
              f"{row['oracle_vs_plain']:.2f}x | {row['lookup_vs_plain']:.2f}x | {row['plan_vs_plain']:.2f}x | "
              f"{row['flat_lookup_vs_plain']:.2f}x |")
    for row in rows:
        print(f"  ragged call ms by tokens at {row['lanes']} lanes: "
              + ", ".join(f"{n}: {s * 1e3:.1f}" for n, s in sorted(row["ragged_call_s"].items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
