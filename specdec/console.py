"""What every specdec command line shares: one-line errors, unwinding on SIGTERM, elapsed-time progress lines,
and echoing what a command wrote into an artifact.

Below the CLI (specdec.cli) so that the `python -m specdec.benchmarks...` scripts use it too without importing
the CLI; it knows nothing of what the commands do.
"""

from __future__ import annotations

import functools
import json
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import click

from specdec.models.errors import SpecdecError


class Terminated(BaseException):
    """SIGTERM arrived (`timeout`, a process manager): raised so the command unwinds as it does on Ctrl-C.

    A BaseException, like KeyboardInterrupt, so that no `except Exception` on the way swallows it."""


def unwinds_on_sigterm(command):
    """Return `command` run so that SIGTERM raises Terminated in the main thread instead of ending the process at
    once: its staging folders and temporary files are removed on the way out, as on Ctrl-C (the default handler
    runs no cleanup). For the commands that write artifacts; `serve` keeps its own graceful shutdown."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            return command(*args, **kwargs)

        def raise_terminated(signum, frame):
            raise Terminated()

        previous = signal.signal(signal.SIGTERM, raise_terminated)
        try:
            return command(*args, **kwargs)
        finally:
            signal.signal(signal.SIGTERM, previous)

    return wrapper


def one_line_errors(command):
    """Turn specdec's errors (and a few predictable others) into `Error: ...` and exit code 1; Ctrl-C exits 130
    and SIGTERM (where the command unwinds on it) 143, each with one line."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except SpecdecError as err:
            raise click.ClickException(str(err)) from None
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)
        except Terminated:
            click.echo("terminated", err=True)
            sys.exit(128 + signal.SIGTERM)

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
