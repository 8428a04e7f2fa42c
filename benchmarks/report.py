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
        "",
        "Speedup = decode tokens/s over target-only decode tokens/s of the same prompt in the same repeat "
        "(prefill excluded). Theoretical = Theorem 3.8 from the run's measured alpha, c and mean K.",
        "",
        "## By prompt group",
        "",
        "| group | configuration | decode tok/s | speedup | theoretical | measured / theory | greedy = target-only |",
        "|---|---|---|---|---|---|---|",
    ]
    for g in groups:
        lines.append(f"| {g['group']} | {g['config']} | {g['decode_tokens_per_second']:.1f} | {g['speedup']:.2f}x | "
                     f"{g['theoretical_speedup']:.2f}x | {_pct(g['share_of_theory'])} | "
                     f"{'yes' if g['greedy_equal'] else 'NO'} |")
    lines += [
        "",
        "## By prompt",
        "",
        "| prompt | group | configuration | tok/s (end to end) | decode tok/s | speedup | alpha | tokens / target call "
        "| time draft / target / other | theoretical | greedy = target-only |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['prompt']} | {r['group']} | {r['config']} | {r['tokens_per_second']:.1f} | "
            f"{r['decode_tokens_per_second']:.1f} | {r['speedup']:.2f}x | {r['alpha']:.2f} | "
            f"{r['tokens_per_target_call']:.2f} | {_pct(r['draft_share'])} / {_pct(r['target_share'])} / "
            f"{_pct(r['other_share'])} | {r['theoretical_speedup']:.2f}x | {'yes' if r['greedy_equal'] else 'NO'} |"
        )
    if anchors:
        lines += [
            "",
            "## Anchors: the same model and prompts in what users would run instead",
            "",
            "End-to-end tokens/s (prefill included) on both sides; specdec's figure is the matching "
            "configuration in the same run.",
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
