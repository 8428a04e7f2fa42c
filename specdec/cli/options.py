"""Option parsing shared by `specdec generate`, `bench` and `serve` (one rule each, one place)."""

from __future__ import annotations

import click


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
