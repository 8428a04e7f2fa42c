"""Atomic artifact writes: build in a hidden temp folder beside the output, then rename."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from specdec.models.errors import ExportError


def check_output_path(output: Path, force: bool) -> None:
    """Raise ExportError if `output` cannot become an artifact folder (a file, or exists without force)."""
    if output.exists() and not output.is_dir():
        raise ExportError(f"output '{output}' is a file; give a folder path")
    if output.exists() and any(output.iterdir()) and not force:
        raise ExportError(f"output folder '{output}' already exists; pass --force to replace it")
    for ancestor in output.resolve().parents:
        if ancestor.exists():
            if not ancestor.is_dir():
                raise ExportError(f"cannot create '{output}': '{ancestor}' is a file")
            break


STAGING_MARKER = ".specdec-staging"  # inside every staging folder an export makes: the process id that made it


def remove_stale_staging(output: Path) -> list[Path]:
    """Remove the hidden staging folders of earlier exports to `output` whose process is gone; return them.

    Only folders that hold specdec's marker are touched (never one another tool or a person made),
    and only when the process named in it no longer runs (a killed export), so a concurrent export
    keeps its own.
    """
    parent, removed = output.resolve().parent, []
    if not parent.is_dir():
        return removed
    for folder in parent.glob(f".{output.name}.partial-*"):
        marker = folder / STAGING_MARKER
        try:
            pid = int(marker.read_text().strip())
        except (OSError, ValueError):
            continue
        if not _running(pid):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def staged_folder(output: Path, force: bool) -> Iterator[Path]:
    """Yield a temp folder; on clean exit it replaces `output`, on any exception (Ctrl-C too) it is deleted.

    The temp folder lives in the output's parent so the final rename stays on one file system.
    """
    check_output_path(output, force)
    parent = output.resolve().parent
    created = [p for p in reversed(parent.parents) if not p.exists()] + ([parent] if not parent.exists() else [])
    parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(output)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.partial-", dir=parent))
    (staging / STAGING_MARKER).write_text(str(os.getpid()))
    try:
        yield staging
        (staging / STAGING_MARKER).unlink()
        if output.exists():
            # Move the old artifact aside first so at no moment is there a half artifact at `output`.
            trash = Path(tempfile.mkdtemp(prefix=f".{output.name}.old-", dir=parent))
            os.replace(output, trash / "old")
            os.replace(staging, output)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for folder in reversed(created):  # parents we made for this export, deepest first
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
