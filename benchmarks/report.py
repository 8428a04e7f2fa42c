"""Benchmark reports: Markdown tables and the JSON document behind them."""

from __future__ import annotations

import statistics
from typing import Sequence


def _pct(x: float) -> str:
    return f"{x:.0%}"


def markdown_report(meta: dict, groups: Sequence[dict], rows: Sequence[dict], anchors: Sequence[dict]) -> str:
    """Return the whole report as Markdown."""
    lines = [
        "# specdec benchmark results",
        "",
        f"- date: {meta['date']}",
        f"- machine: {meta['machine']}",
        f"- command: `{meta['command']}`",
        f"- artifact: {meta['artifact']} (target {meta['target']}, draft {meta['draft']})",
        f"- prompt set: v{meta['prompt_set_version']} ({meta['prompts']} prompts, sha256 {meta['prompt_set_sha256'][:12]}), "
        f"greedy, max_new_tokens {meta['max_new_tokens']}, {meta['repeats']} repeats, configurations alternate "
        "within each prompt and repeat; figures are medians over repeats",
        f"- versions: {', '.join(f'{k} {v}' for k, v in meta['versions'].items())}",
        "- target step times (1/5/8 new tokens at past 64/256/1024, specdec vs plain optimum vs "
        "onnxruntime-genai graphs): [STEPS.md](STEPS.md), written by the same `make bench`",
        "",
        "Speedup = decode tokens/s over target-only decode tokens/s of the same prompt in the same repeat "
        "(prefill excluded). Theory = Theorem 3.8 from each run's measured alpha, c and the K each iteration "
        "drafted, (a) as in the paper (verifying K+1 tokens costs one step) and (b) with the verify cost "
        f"measured in this run: each extra verified token costs {meta['verify_cost']:.3f} of a 1-token step.",
        "",
        *goals_section(groups, rows, anchors),
        "## By prompt group",
        "",
        "| group | configuration | decode tok/s | speedup | theory (paper) | measured / theory | "
        "theory (measured verify cost) | measured / theory | greedy = target-only |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for g in groups:
        lines.append(f"| {g['group']} | {g['config']} | {g['decode_tokens_per_second']:.1f} | {g['speedup']:.2f}x | "
                     f"{g['theoretical_speedup']:.2f}x | {_pct(g['share_of_theory'])} | "
                     f"{g['theoretical_speedup_verify']:.2f}x | {_pct(g['share_of_theory_verify'])} | "
                     f"{'yes' if g['greedy_equal'] else 'NO'} |")
    lines += [
        "",
        "## By prompt",
        "",
        "| prompt | group | configuration | tok/s (end to end) | decode tok/s | speedup | alpha | tokens / target call "
        "| time draft / target / other | theory (paper / verify cost) | greedy = target-only |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['prompt']} | {r['group']} | {r['config']} | {r['tokens_per_second']:.1f} | "
            f"{r['decode_tokens_per_second']:.1f} | {r['speedup']:.2f}x | {r['alpha']:.2f} | "
            f"{r['tokens_per_target_call']:.2f} | {_pct(r['draft_share'])} / {_pct(r['target_share'])} / "
            f"{_pct(r['other_share'])} | {r['theoretical_speedup']:.2f}x / {r['theoretical_speedup_verify']:.2f}x | "
            f"{'yes' if r['greedy_equal'] else 'NO'} |"
        )
    if anchors:
        lines += [
            "",
            "## Anchors: the same model and prompts in what users would run instead",
            "",
            "End-to-end tokens/s (prefill included) on both sides, medians; specdec's figure is the matching "
            "configuration in the same run. onnxruntime-genai runs after each specdec repeat (alternating); "
            "transformers runs once, after all repeats.",
            "",
            "| group | anchor | anchor tok/s | specdec configuration | specdec tok/s | specdec / anchor | "
            "anchor greedy text = specdec |",
            "|---|---|---|---|---|---|---|",
        ]
        for a in anchors:
            lines.append(f"| {a['group']} | {a['system']} | {a['tokens_per_second']:.1f} | {a['compare_to']} | "
                         f"{a['specdec_tokens_per_second']:.1f} | {a['ratio']:.2f}x | {a['greedy_equal_text']} |")
    return "\n".join(lines) + "\n"


def anchor_rows(anchor_runs: Sequence, spec_rows: Sequence[dict], prompt_groups: dict[str, str],
                spec_text: dict[str, str], decode, comparisons: dict[str, str]) -> list[dict]:
    """Return per (group, anchor system) medians next to the specdec configuration it is compared with.

    comparisons maps an anchor system to the specdec configuration name it competes with.
    """
    out = []
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
            equal = sum(decode(r.token_ids).strip() == spec_text[r.prompt_id].strip() for r in sel)
            out.append({"group": group, "system": system, "tokens_per_second": anchor_tps, "compare_to": compare_to,
                        "specdec_tokens_per_second": spec_tps, "ratio": spec_tps / anchor_tps if anchor_tps else 0.0,
                        "greedy_equal_text": f"{equal}/{len(sel)}"})
    return out


def goals_section(groups: Sequence[dict], rows: Sequence[dict], anchors: Sequence[dict]) -> list[str]:
    """Return Markdown lines checking the project's stated goals against this run's figures."""
    lines = ["## Goals, checked on this run", "", "| goal | group | figure | met |", "|---|---|---|---|"]

    def add(goal: str, group: str, figure: str, met: bool) -> None:
        lines.append(f"| {goal} | {group} | {figure} | {'yes' if met else 'no'} |")

    for a in anchors:
        if a["system"] == "onnxruntime-genai greedy":
            add("specdec target-only >= 0.9x onnxruntime-genai greedy", a["group"], f"{a['ratio']:.2f}x", a["ratio"] >= 0.9)
    for a in anchors:
        if a["system"] == "transformers prompt-lookup":
            add("specdec n-gram >= 2x transformers prompt lookup", a["group"], f"{a['ratio']:.2f}x", a["ratio"] >= 2.0)
    for g in groups:
        if g["config"] != "target-only":
            add(f"{g['config']} >= 85% of theory (figure: paper / measured verify cost; judged on the latter)",
                g["group"],
                f"{_pct(g['share_of_theory'])} / {_pct(g['share_of_theory_verify'])}", g["share_of_theory_verify"] >= 0.85)
    ngram_fixed = [g for g in groups if g["config"].startswith("ngram K=") and g["group"] == "grounded"]
    for g in ngram_fixed:
        add(f"{g['config']} >= 2x target-only on grounded prompts (median)", "grounded", f"{g['speedup']:.2f}x",
            g["speedup"] >= 2.0)
    auto_open = [r for r in rows if r["config"] == "ngram auto" and r["group"] == "open"]
    if auto_open:
        worst = min(auto_open, key=lambda r: r["speedup"])
        add("ngram auto never below 0.95x on open prompts", "open", f"min {worst['speedup']:.2f}x ({worst['prompt']})",
            worst["speedup"] >= 0.95)
    lines.append("")
    return lines
