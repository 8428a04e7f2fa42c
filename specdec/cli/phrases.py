"""`specdec phrases`: count the target's own usual continuations into the artifact, for the n-gram drafter."""

from __future__ import annotations

import os
from pathlib import Path

import click

from specdec.cli.options import (json_option, max_new_tokens_option, minutes_option, prompt_count_option,
                                 seed_option, threads_option)
from specdec.console import echo_record, elapsed_progress, one_line_errors, unwinds_on_sigterm
from specdec.runtime.phrases import PhraseTableConfig

DEFAULTS = PhraseTableConfig()


@click.command()
@click.argument("artifact", type=click.Path(file_okay=False, path_type=Path))
@minutes_option(10.0, "Budget for the whole run: loading the target, answering prompts (most of it), counting and the "
                      "held-out check. More answers make a table that is right more often.")
@seed_option("Seeds the order of the shipped prompts; with --prompts, a run is repeated exactly.")
@prompt_count_option("Prompts the target answers (default: as many as --minutes allows).")
@click.option("--prompts-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="JSON lines with a \"prompt\" field each (the format of `specdec bench --prompts`), answered "
                   "instead of the shipped prompts: e.g. a sample of your own traffic, where the table is right "
                   "more often than on the shipped prompts' styles.")
@max_new_tokens_option(160, "Longest answer the target writes per prompt.", lowest=8)
@click.option("--batch", type=click.IntRange(min=1), default=64, show_default=True,
              help="Prompts the target answers at once.")
@click.option("--max-n", type=click.IntRange(min=1, max=8), default=DEFAULTS.max_n, show_default=True,
              help="Longest context (tokens) the table keys on; the longest known context decides a proposal.")
@click.option("--min-count", type=click.IntRange(min=1), default=DEFAULTS.min_count, show_default=True,
              help="A follower is proposed only if the target wrote it at least this often after the context...")
@click.option("--min-share", type=click.FloatRange(0.0, 1.0), default=DEFAULTS.min_share, show_default=True,
              help="...and at least this share of the times the context occurred.")
@threads_option("CPU threads for PyTorch (default: all cores).")
@json_option("Print the table's record (the manifest's entry) as JSON.")
@one_line_errors
@unwinds_on_sigterm
def phrases(artifact: Path, minutes: float, seed: int, prompts: int | None, prompts_file: Path | None,
            max_new_tokens: int, batch: int, max_n: int, min_count: int, min_share: float, threads: int | None,
            as_json: bool) -> None:
    """Have ARTIFACT's target answer shipped prompts and write a table of its usual continuations into it.

    With the table, the n-gram drafter (`specdec generate --drafter ngram`) also proposes where the
    context holds nothing to copy: the token the target itself most often wrote after the last 1-4
    tokens, when it wrote it at least --min-count times and --min-share of the time. No training;
    proposals are one-hot, so output stays exactly the target's. Needs the export extra (PyTorch).
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as in `specdec distill`: no spinning at OpenMP barriers
    from specdec.exporter.phrases import PhrasesConfig, build_phrases

    config = PhrasesConfig(artifact=artifact, minutes=minutes, seed=seed, prompts=prompts, prompts_file=prompts_file,
                           max_new_tokens=max_new_tokens, batch_size=batch, threads=threads,
                           table=PhraseTableConfig(max_n=max_n, min_count=min_count, min_share=min_share))
    manifest = build_phrases(config, progress=elapsed_progress())
    echo_record(artifact, manifest.phrase_table.built, as_json, _summary)


def _summary(artifact: Path, built: dict) -> str:
    """Return the line saying what table the run counted and wrote into `artifact`."""
    held = built["heldout"]
    return (f"phrase table written into {artifact}: {built['confident_contexts']} confident contexts from "
            f"{built['answers']} answers ({built['tokens']} tokens) in {built['minutes']} min; on held-out answers "
            f"it proposes at {held['proposes']:.1%} of positions, first token right {held['first_right']:.1%}")
