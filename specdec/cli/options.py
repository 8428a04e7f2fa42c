"""Options shared by several `specdec` commands: one declaration each, with the command's own default and help."""

from __future__ import annotations

import click

from specdec.runtime.config import PROVIDER_CHOICES


def parse_draft_tokens(value: str | None) -> int | str | None:
    """Return K as an int, "auto", or None (unset); raise click.BadParameter for anything else."""
    if value is None or value == "auto":
        return value
    try:
        k = int(value)
    except ValueError:
        raise click.BadParameter(f"must be an integer >= 1 or 'auto', got '{value}'") from None
    if k < 1:
        raise click.BadParameter(f"must be >= 1 (or 'auto'), got {k}")
    return k


def draft_tokens_callback(ctx, param, value: str | None) -> int | str | None:
    """Return parse_draft_tokens(value): click's callback form."""
    return parse_draft_tokens(value)


def max_batch_callback(ctx, param, value: str) -> int | None:
    """Return --max-batch as a number of slots, or None for `auto` (the artifact's serving_slots)."""
    if value == "auto":
        return None
    try:
        slots = int(value)
    except ValueError:
        slots = 0
    if slots < 1:
        raise click.BadParameter(f"must be a whole number >= 1 or 'auto', got {value!r}")
    return slots


def minutes_option(default: float, help: str):
    """Return the --minutes option: the whole run's time budget, `default` minutes unless given."""
    return click.option("--minutes", type=float, default=default, show_default=True, help=help)


def seed_option(help: str):
    """Return the --seed option: an integer, 0 unless given."""
    return click.option("--seed", type=int, default=0, show_default=True, help=help)


def prompt_count_option(help: str):
    """Return the --prompts option of a run that has the target answer prompts: how many (None: the budget decides)."""
    return click.option("--prompts", type=click.IntRange(min=1), default=None, help=help)


def max_new_tokens_option(default: int, help: str, lowest: int, highest: int | None = None):
    """Return the --max-new-tokens option: a token count in [lowest, highest], `default` unless given."""
    return click.option("--max-new-tokens", type=click.IntRange(lowest, highest), default=default, show_default=True,
                        help=help)


def provider_option(help: str | None = None):
    """Return the --provider option: onnxruntime's execution provider, auto unless given."""
    return click.option("--provider", type=click.Choice(PROVIDER_CHOICES), default="auto", show_default=True,
                        help=help)


def threads_option(help: str):
    """Return the --threads option: a thread count (None: the command's default, which `help` says)."""
    return click.option("--threads", type=click.IntRange(min=1), default=None, help=help)


def json_option(help: str):
    """Return the --json flag, passed to the command as `as_json`."""
    return click.option("--json", "as_json", is_flag=True, help=help)
