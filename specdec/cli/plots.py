"""PNG plots for `specdec tune` and `specdec bench` (matplotlib, from the `bench` extra)."""

from __future__ import annotations

from pathlib import Path

from specdec.models.extras import missing_dependency


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise missing_dependency(err, "plots (--no-plot skips them)", "bench") from None
    return plt


def plot_tune(report, path: Path) -> Path:
    """Write expected vs measured speedup over K as a PNG; return its path."""
    plt = _pyplot()
    ks = [row.k for row in report.rows]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    ax.plot(ks, [row.expected_paper for row in report.rows], "--", color="gray", label="expected (Thm 3.8)")
    ax.plot(ks, [row.expected for row in report.rows], "-o", ms=3, label="expected, measured call costs t(n) and K drafted")
    measured = [(row.k, row.measured) for row in report.rows if row.measured is not None]
    if measured:
        ax.plot(*zip(*measured), "-s", ms=4, label="measured")
    ax.axhline(1.0, color="black", lw=0.6)
    if report.auto_measured is not None:
        label = f"measured auto (cap {len(report.rows)})"
        if report.recommended_k == "auto":
            label += ", recommended"
        ax.axhline(report.auto_measured, color="tab:purple", lw=0.9, ls="-.", label=label)
    if report.recommended_k != "auto":
        ax.axvline(report.recommended_k, color="tab:green", lw=0.8, ls=":", label=f"recommended K={report.recommended_k}")
    ax.set_xlabel("draft tokens per target call (K)")
    ax.set_ylabel("speedup over target-only")
    ax.set_title(f"{report.drafter} drafter: alpha={report.alpha:.2f}, c={report.cost_ratio:.3f}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def plot_bench(rows: list[dict], path: Path) -> Path:
    """Write measured (bars) and theoretical (dots) speedup per prompt and configuration as a PNG."""
    plt = _pyplot()
    prompts = list(dict.fromkeys(row["prompt"] for row in rows))
    configs = [c for c in dict.fromkeys(row["config"] for row in rows) if c != "target-only"]
    width = 0.8 / max(len(configs), 1)
    fig, ax = plt.subplots(figsize=(max(7, 1.3 * len(prompts)), 4.5), dpi=120)
    for i, config in enumerate(configs):
        xs, measured, theory = [], [], []
        for j, prompt in enumerate(prompts):
            match = [r for r in rows if r["prompt"] == prompt and r["config"] == config]
            if match:
                xs.append(j + (i - (len(configs) - 1) / 2) * width)
                measured.append(match[0]["speedup"])
                theory.append(match[0]["theoretical_speedup"])
        bars = ax.bar(xs, measured, width, label=config)
        ax.plot(xs, theory, "o", color=bars.patches[0].get_facecolor(), mec="black", ms=4)
    ax.axhline(1.0, color="black", lw=0.6)
    ax.set_xticks(range(len(prompts)))
    ax.set_xticklabels(prompts, rotation=20)
    ax.set_ylabel("speedup over target-only (bars: measured, dots: theory)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)
