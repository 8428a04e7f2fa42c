"""Prompt sets for tuning and benchmarks: JSON lines of {"id", "group", "prompt", "chat"}."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specdec.models.errors import SpecdecError


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


def load_prompts(path: str | Path) -> list[PromptCase]:
    """Return the prompts of a JSON-lines file; raise SpecdecError naming the first bad line."""
    file = Path(path)
    if not file.is_file():
        raise SpecdecError(f"prompt file '{file}' does not exist")
    cases = []
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            cases.append(PromptCase(str(row.get("id", number)), str(row.get("group", "open")),
                                    str(row["prompt"]), bool(row.get("chat", True))))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise SpecdecError(f"{file}:{number}: expected a JSON object with a \"prompt\" field") from None
    if not cases:
        raise SpecdecError(f"prompt file '{file}' has no prompts")
    return cases
