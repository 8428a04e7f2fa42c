"""Prompt sets for tuning and benchmarks: JSON lines of {"id", "group", "prompt", "chat"}."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

from specdec.models.errors import SpecdecError

T = TypeVar("T")


@dataclass(frozen=True)
class PromptCase:
    """One prompt of a set."""

    id: str
    group: str  # "grounded" (answer copies from the prompt) or "open"
    prompt: str
    chat: bool = True


# Used by `specdec tune` when no --prompts file is given: one grounded, one open.
DEFAULT_PROMPTS = (
    PromptCase("rewrite", "grounded",
               "Rewrite this in simpler words, keeping every fact: The committee approved the budget on "
               "Tuesday after a long debate. The new budget increases funding for public libraries by ten "
               "percent and for school buses by five percent, and it cuts spending on road repairs."),
    PromptCase("story", "open", "Write a short story about a robot who learns to paint."),
)


def read_json_lines(path: str | Path, what: str, read: Callable[[dict, int], T]) -> list[T]:
    """Return `read(row, line number)` for each JSON object of a JSON-lines file (blank lines skipped); raise
    SpecdecError naming the file and the first bad line (`what`: what the file holds, for the messages)."""
    file = Path(path)
    if not file.is_file():
        raise SpecdecError(f"{what} file '{file}' does not exist")
    out = []
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            out.append(read(json.loads(line), number))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError) as err:
            raise SpecdecError(f"{file}:{number}: {err}") from None
    if not out:
        raise SpecdecError(f"{what} file '{file}' has nothing in it")
    return out


def load_prompts(path: str | Path) -> list[PromptCase]:
    """Return the prompts of a JSON-lines file; raise SpecdecError naming the first bad line."""
    def case(row: dict, number: int) -> PromptCase:
        try:
            return PromptCase(str(row.get("id", number)), str(row.get("group", "open")), str(row["prompt"]),
                              bool(row.get("chat", True)))
        except (KeyError, TypeError, AttributeError):
            raise ValueError('expected a JSON object with a "prompt" field') from None

    return read_json_lines(path, "prompt", case)
