"""Shared CLI plumbing: one-line errors, elapsed-time progress lines, and what a command wrote into an artifact."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path

import click

from specdec.models.errors import SpecdecError


def one_line_errors(command):
    """Turn specdec's errors (and a few predictable others) into `Error: ...` and exit code 1."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except SpecdecError as err:
            raise click.ClickException(str(err)) from None
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)

    return wrapper


def elapsed_progress():
    """Return a progress callback that prints `[  12.3s] message` to stderr, timed from now."""
    import time

    started = time.perf_counter()

    def progress(message: str) -> None:
        click.echo(f"[{time.perf_counter() - started:7.1f}s] {message}", err=True)

    return progress


def echo_record(artifact: Path, record: dict, as_json: bool, summary: Callable[[Path, dict], str]) -> None:
    """Print the record a command wrote into ARTIFACT's manifest: JSON under --json, else summary(artifact, record)."""
    click.echo(json.dumps(record, indent=2) if as_json else summary(artifact, record))
