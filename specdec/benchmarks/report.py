"""Benchmark reports: Markdown tables and the JSON document behind them."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import asdict
from typing import Callable, Sequence

from specdec.benchmarks.anchors import DIFFERS, EQUAL, PAST_MAX_NEW_TOKENS, SETTLE_SECONDS, greedy_agreement


def _pct(x: float) -> str:
    return f"{x:.0%}"


def cell(value: float | None, spec: str = "{:.2f}") -> str:
    """Return a table cell: `value` formatted by `spec` (e.g. "{:.2f}x"), or "-" where there is no value."""
    return "-" if value is None else spec.format(value)


def _section(title: str, columns: Sequence[str], prose: str = "") -> list[str]:
    """Return the Markdown lines that open a report section: its heading, the prose (if any), a table's header row
    and rule; the caller appends the table's rows."""
    return ["", f"## {title}", *(["", prose] if prose else []), "", "| " + " | ".join(columns) + " |",
            "|" + "---|" * len(columns)]


def _prompt_set_name(meta: dict) -> str:
    """Return "v1" for the shipped, versioned prompt set, else the prompt file's name."""
    if meta.get("prompt_set_version") is not None:
        return f"v{meta['prompt_set_version']}"
    return meta.get("prompt_set_file", "custom")


def _auto_table_origin(meta: dict) -> str:
    """Return the sentence saying where `auto`'s t(n) table came from in this run."""
    if meta.get("call_costs_source") == "cache":
        return ("Before its first run, `auto` read t(n) over 1..(its K cap + 1) tokens from the call-cost cache, "
                "timed by an earlier process on this machine (the artifact has no t(n) from `specdec tune`).")
    if meta.get("call_costs_source") == "tune":
        return "`auto` read t(n) from the artifact (`specdec tune`)."
    if meta.get("calibration_seconds"):
        return (f"Before its first run, `auto` timed target calls over 1..(its K cap + 1) tokens once "
                f"({meta['calibration_seconds']:.1f} s, outside every timed run: the artifact has no t(n) from "
                "`specdec tune`).")
    return ""




def target_vs_genai_rows(specdec: dict[str, list[tuple[float, float]]], anchor_runs: Sequence,
                         prompt_tokens: dict[str, int], specdec_prefills: dict[str, list[float]] | None = None,
                         paired_prefills: dict[str, list[tuple[float, float]]] | None = None) -> list[dict]:
    """Return per prompt: specdec target-only against onnxruntime-genai greedy, decode tokens/s and
    time to first token (medians on each side), and their ratios.

    specdec maps a prompt id to its target-only runs' (decode tokens/s, prefill seconds);
    specdec_prefills, where given, to every prefill of the prompt timed in the run (TTFT is their
    median; genai's is the median of its greedy runs' prefills and their `prefill_samples`).
    paired_prefills, where given, to rounds of (specdec, genai) prefills run back to back: the row
    then holds `paired_ttft_ratio`, the median of the rounds' ratios, and their range.
    [] when genai did not run or did not time its phases.
    """
    out = []
    for prompt_id, pairs in specdec.items():
        genai = [r for r in anchor_runs if r.system == "onnxruntime-genai greedy" and r.prompt_id == prompt_id
                 and r.decode_tokens_per_second is not None]
        if not genai or not pairs:
            continue
        decode = statistics.median(p[0] for p in pairs)
        prefills = (specdec_prefills or {}).get(prompt_id) or [p[1] for p in pairs]
        genai_prefills = [r.prefill_seconds for r in genai] + [s for r in genai for s in r.prefill_samples]
        ttft, genai_ttft = statistics.median(prefills), statistics.median(genai_prefills)
        genai_decode = statistics.median(r.decode_tokens_per_second for r in genai)
        out.append({"prompt": prompt_id, "prompt_tokens": prompt_tokens[prompt_id],
                    "decode_tokens_per_second": decode, "genai_decode_tokens_per_second": genai_decode,
                    "decode_ratio": decode / genai_decode, "ttft_seconds": ttft, "genai_ttft_seconds": genai_ttft,
                    "ttft_ratio": ttft / genai_ttft, "runs": (len(pairs), len(genai)),
                    "prefills": (len(prefills), len(genai_prefills))})
        rounds = (paired_prefills or {}).get(prompt_id)
        if rounds:
            ratios = [mine / theirs for mine, theirs in rounds]
            out[-1].update(paired_ttft_ratio=statistics.median(ratios), paired_ttft_range=(min(ratios), max(ratios)),
                           paired_rounds=len(rounds))
    return out


def geometric_mean(values: Sequence[float]) -> float:
    """Return the geometric mean of positive `values` (0.0 for none)."""
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else 0.0


def target_vs_genai_section(rows: Sequence[dict]) -> list[str]:
    """Return Markdown lines for specdec target-only against genai greedy, prompt by prompt ([] without genai)."""
    if not rows:
        return []
    prose = ("The same greedy decoding of the same model on both sides, at the same thread count (header). Decode "
             "tokens/s: tokens after the first over the time after the prefill, medians over the repeats. Time to "
             "first token: the prefill call (genai: `append_tokens` of the prompt), the median of every prefill of "
             "the prompt timed in the run (specdec: its target-only and n-gram runs, which prefill alike; genai: its "
             "greedy runs and 3 more prefills before each, in a worker that warmed up on the prompt): one prefill "
             "varies by +-30% here. genai runs each prompt right after specdec's runs of it.")
    columns = ["prompt", "prompt tokens", "specdec decode tok/s", "genai decode tok/s", "specdec / genai",
               "specdec TTFT (ms)", "genai TTFT (ms)", "specdec / genai"]
    paired = all("paired_ttft_ratio" in r for r in rows)
    if paired:
        prose += (f" Paired: after the runs, {rows[0]['paired_rounds']} rounds per prompt of one specdec and one "
                  "genai prefill back to back (who goes first alternates), so a burst of load falls on both, each "
                  f"after {SETTLE_SECONDS:g} s idle (a call that starts within ~10 ms of the other process's runs "
                  "~9% slower); the median of the rounds' ratios, and their range. The goal reads the paired ratio.")
        columns.append("TTFT specdec / genai, paired")
    lines = _section("Target-only against onnxruntime-genai greedy, prompt by prompt", columns, prose)
    for r in rows:
        lines.append(f"| {r['prompt']} | {r['prompt_tokens']} | {r['decode_tokens_per_second']:.1f} | "
                     f"{r['genai_decode_tokens_per_second']:.1f} | {r['decode_ratio']:.2f}x | "
                     f"{r['ttft_seconds'] * 1e3:.0f} | {r['genai_ttft_seconds'] * 1e3:.0f} | {r['ttft_ratio']:.2f}x |"
                     + (f" {r['paired_ttft_ratio']:.2f}x ({r['paired_ttft_range'][0]:.2f}-{r['paired_ttft_range'][1]:.2f}) |"
                        if paired else ""))
    lines.append(f"| geometric mean | | | | {geometric_mean([r['decode_ratio'] for r in rows]):.2f}x | | | "
                 f"{geometric_mean([r['ttft_ratio'] for r in rows]):.2f}x |"
                 + (f" {geometric_mean([r['paired_ttft_ratio'] for r in rows]):.2f}x |" if paired else ""))
    return lines


def markdown_report(meta: dict, groups: Sequence[dict], rows: Sequence[dict], anchors: Sequence[dict],
                    replays: Sequence[dict] = (), situations: Sequence[dict] = (),
                    head_to_head: Sequence[dict] = ()) -> str:
    """Return the whole report as Markdown."""
    lines = [
        "# specdec benchmark results",
        "",
        f"- date: {meta['date']}",
        f"- machine: {meta['machine']}",
        f"- command: `{meta['command']}`",
        f"- artifact: {meta['artifact']} (target {meta['target']}, draft {meta['draft']})"
        + (f"; target graph: {meta['target_graph']}" if meta.get("target_graph") else ""),
        f"- prompt set: {_prompt_set_name(meta)} ({meta['prompts']} prompts, sha256 {meta['prompt_set_sha256'][:12]}), "
        f"greedy, max_new_tokens {meta['max_new_tokens']}, {meta['repeats']} repeats, configurations alternate "
        "within each prompt and repeat; figures are medians over repeats",
        f"- versions: {', '.join(f'{k} {v}' for k, v in meta['versions'].items())}",
        *[f"- settings, {system}: {text}" for system, text in meta.get("settings", {}).items()],
        "- target step times (1/5/8 new tokens at past 64/256/1024, specdec vs plain optimum vs "
        "onnxruntime-genai graphs): [STEPS.md](STEPS.md), written by `make bench`",
        "",
        "Speedup = decode tokens/s over target-only decode tokens/s of the same prompt in the same repeat "
        "(prefill excluded). Theory = Theorem 3.8 from each run's measured alpha, c and the K each iteration "
        "drafted, (a) as in the paper (verifying K+1 tokens costs one step) and (b) with the call costs "
        f"measured in this run: a call over n tokens costs t(n) 1-token steps, {_call_costs(meta)} (the "
        "speculative runs' own target calls, each divided by the target-only step at the same past length in "
        "the same prompt and repeat, medians by tokens per call; on average each extra token costs "
        f"{meta['verify_cost']:.3f}). "
        + _auto_table_origin(meta),
    ]
    lines += _section("By prompt group", ["group", "configuration", "decode tok/s", "speedup", "theory (paper)",
                                          "measured / theory", "theory (measured call costs)", "measured / theory",
                                          "greedy = target-only"])
    for g in groups:
        lines.append(f"| {g['group']} | {g['config']} | {g['decode_tokens_per_second']:.1f} | {g['speedup']:.2f}x | "
                     f"{g['theoretical_speedup']:.2f}x | {_pct(g['share_of_theory'])} | "
                     f"{g['theoretical_speedup_verify']:.2f}x | {_pct(g['share_of_theory_verify'])} | "
                     f"{'yes' if g['greedy_equal'] else 'NO'} |")
    lines += _section("By prompt", ["prompt", "group", "configuration", "tok/s (end to end)", "decode tok/s",
                                    "speedup", "alpha", "tokens / target call", "time draft / target / other",
                                    "theory (paper / call costs)", "greedy = target-only"])
    for r in rows:
        lines.append(
            f"| {r['prompt']} | {r['group']} | {r['config']} | {r['tokens_per_second']:.1f} | "
            f"{r['decode_tokens_per_second']:.1f} | {r['speedup']:.2f}x | {r['alpha']:.2f} | "
            f"{r['tokens_per_target_call']:.2f} | {_pct(r['draft_share'])} / {_pct(r['target_share'])} / "
            f"{_pct(r['other_share'])} | {r['theoretical_speedup']:.2f}x / {r['theoretical_speedup_verify']:.2f}x | "
            f"{'yes' if r['greedy_equal'] else 'NO'} |"
        )
    lines += target_vs_genai_section(head_to_head)
    lines += replay_section(meta, replays)
    lines += situation_section(situations)
    if anchors:
        lines += _section(
            "Anchors: the same model and prompts in what users would run instead",
            ["group", "anchor", "anchor tok/s", "specdec configuration", "specdec tok/s", "specdec / anchor",
             "anchor greedy tokens = specdec's"],
            "End-to-end tokens/s (prefill included) on both sides, medians; specdec's figure is the matching "
            "configuration in the same run. onnxruntime-genai runs each prompt right after specdec's runs of it "
            "(alternating); transformers runs once, after all repeats. An anchor's tokens/s counts at most "
            "max_new_tokens tokens per run. Its greedy tokens are compared with specdec's target-only tokens for the "
            "same prompt (first repeat), token by token, leaving out a final end-of-sequence token.")
        for a in anchors:
            lines.append(f"| {a['group']} | {a['system']} | {a['tokens_per_second']:.1f} | {a['compare_to']} | "
                         f"{a['specdec_tokens_per_second']:.1f} | {a['ratio']:.2f}x | "
                         f"{_agreement_cell(a, meta['max_new_tokens'])} |")
        lines += _agreement_notes(anchors, meta["max_new_tokens"])
    return "\n".join(lines) + "\n"


def anchor_rows(anchor_runs: Sequence, spec_rows: Sequence[dict], prompt_groups: dict[str, str],
                baseline_ids: dict[str, list[int]], comparisons: dict[str, str], max_new_tokens: int,
                eos_token_ids: Sequence[int], logit_gap: Callable[[str, int], float] | None = None) -> list[dict]:
    """Return per (group, anchor system) medians next to the specdec configuration it is compared with.

    comparisons maps an anchor system to the specdec configuration name it competes with.
    Each anchor run's tokens are checked against specdec's target-only greedy tokens for
    the prompt (baseline_ids); logit_gap(prompt_id, position), when given, returns the
    target's top-2 logit gap where a run first differs (small: a near-tie that rounding
    decides, not a wrong token).
    """
    out = []
    gaps: dict[tuple[str, int], float] = {}
    for system, compare_to in comparisons.items():
        runs = [r for r in anchor_runs if r.system == system]
        if not runs:
            continue
        for group in dict.fromkeys(prompt_groups.values()):
            sel = [r for r in runs if prompt_groups[r.prompt_id] == group]
            spec = [r for r in spec_rows if r["group"] == group and r["config"] == compare_to]
            if not sel or not spec:
                continue
            anchor_tps = statistics.median(r.tokens_per_second for r in sel)
            spec_tps = statistics.median(r["tokens_per_second"] for r in spec)
            disagreements = []
            for r in sel:
                agreement = greedy_agreement(baseline_ids[r.prompt_id], r.token_ids, max_new_tokens, eos_token_ids)
                if agreement.kind == EQUAL:
                    continue
                record = {"prompt": r.prompt_id, **asdict(agreement)}
                if agreement.kind == DIFFERS and logit_gap is not None:
                    where = (r.prompt_id, agreement.position)
                    if where not in gaps:  # repeats of a deterministic anchor part at the same token
                        gaps[where] = logit_gap(*where)
                    record["top2_logit_gap"] = gaps[where]
                disagreements.append(record)
            out.append({"group": group, "system": system, "tokens_per_second": anchor_tps, "compare_to": compare_to,
                        "specdec_tokens_per_second": spec_tps, "ratio": spec_tps / anchor_tps if anchor_tps else 0.0,
                        "greedy_equal": f"{len(sel) - len(disagreements)}/{len(sel)}",
                        "greedy_disagreements": disagreements})
    return out


def _agreement_notes(anchors: Sequence[dict], max_new_tokens: int) -> list[str]:
    """Return Markdown lines explaining the kinds of disagreement the anchor table shows (none: none)."""
    kinds = {}
    for a in anchors:
        for d in a["greedy_disagreements"]:
            kinds.setdefault(d["kind"], set()).add(a["system"])
    lines = []
    if PAST_MAX_NEW_TOKENS in kinds:
        systems = sorted(kinds[PAST_MAX_NEW_TOKENS])
        known = (" (transformers' prompt lookup does not cut its drafts to the tokens left: see "
                 "huggingface/transformers pull request 47195)" if any(s.startswith("transformers") for s in systems)
                 else "")
        lines += ["", f"{' and '.join(systems)} returned more tokens than the {max_new_tokens} asked for, equal to "
                  f"specdec's up to there: the last verify call kept drafts beyond the limit{known}. The tokens "
                  "beyond it are not counted in tokens/s."]
    if DIFFERS in kinds:
        lines += ["", "Where an anchor's greedy tokens differ, the gap between the target's two highest logits "
                  "there (specdec's graph) says why: a gap near zero is a near-tie that the order of floating-point "
                  "sums decides, not a different model."]
    return lines


def _agreement_cell(row: dict, max_new_tokens: int) -> str:
    """Return the "anchor greedy tokens = specdec's" cell: the count, then what the other runs did."""
    notes = []
    past = [d["extra_tokens"] for d in row["greedy_disagreements"] if d["kind"] == PAST_MAX_NEW_TOKENS]
    if past:
        notes.append(f"{len(past)} equal over all {max_new_tokens} tokens, then went on: "
                     + ", ".join(f"+{n}" for n in past))
    differs = Counter(
        f"{d['prompt']} differs from token {d['position']}"
        + (f" (top-2 logit gap {d['top2_logit_gap']:.3g})" if "top2_logit_gap" in d else "")
        for d in row["greedy_disagreements"] if d["kind"] == DIFFERS)
    notes += [note + (f" (x{count})" if count > 1 else "") for note, count in differs.items()]
    return row["greedy_equal"] + (f"; {'; '.join(notes)}" if notes else "")


def replay_section(meta: dict, replays: Sequence[dict]) -> list[str]:
    """Return Markdown lines for the replay of n-gram drafting over each prompt's greedy output."""
    if not replays:
        return []
    ks = list(replays[0]["replay_speedup"])
    lines = _section(
        "What n-gram drafting could reach on this machine (replay)",
        ["prompt", "group", f"measured {replays[0]['measured_config']}", *(f"replay K={k}" for k in ks),
         "best K (bound)", "tokens / call at the bound"],
        "Greedy output does not depend on the drafter, so each prompt's target-only output (first repeat) is "
        "replayed through the n-gram drafter offline, with this run's costs: a call over n tokens costs "
        f"t(n) steps as above (beyond the longest measured call, {meta['verify_cost']:.3f} per extra token), "
        f"a rollback {meta['rollback_cost']:.3f} steps. "
        "\"Best K\" is the cheapest possible choice of K at every iteration (dynamic programming over the "
        "output: no rejected draft is ever verified), an upper bound for any draft-length policy with this "
        "drafter on this hardware. The fixed-K replays look up suffixes of 2..4 tokens, as a fixed K does; the "
        "bound looks up 1..4, as `auto` does (skipping a proposal is one of its choices, so more proposals "
        "never lower it). The replayed fixed-K column next to the measured one checks the cost model.")
    for r in replays:
        lines.append(f"| {r['prompt']} | {r['group']} | {cell(r['measured_speedup'], '{:.2f}x')} | "
                     + " | ".join(f"{r['replay_speedup'][k]:.2f}x" for k in ks)
                     + f" | {r['oracle_speedup']:.2f}x | {r['oracle_tokens_per_call']:.2f} |")
    return lines


def situation_section(situations: Sequence[dict]) -> list[str]:
    """Return the table of how `auto` fared per drafting situation ([] when no auto run drafted)."""
    if not situations:
        return []
    lines = _section(
        "What `auto` saw: its iterations by drafting situation",
        ["group", "situation", "iterations", "share of iterations", "drafted per iteration", "alpha"],
        "`auto` keeps one acceptance estimate per situation the drafter reports before proposing (n-gram: "
        "the matched n-gram was seen once, always followed by the same token (repeated), or followed by "
        "different tokens (ambiguous); 1-token matches apart). All repeats of all prompts in the group.")
    for r in situations:
        lines.append(f"| {r['group']} | {r['situation']} | {r['iterations']} | {_pct(r['iteration_share'])} | "
                     f"{r['drafted_per_iteration']:.2f} | {cell(r['alpha'])} |")
    return lines


def _call_costs(meta: dict) -> str:
    """Return the measured t(n) as 't(1) 1.00, t(2) 1.09, ...' ('none measured' without a table)."""
    costs = meta.get("call_costs") or {}
    return ", ".join(f"t({n}) {t:.2f}" for n, t in costs.items()) or "none measured"
