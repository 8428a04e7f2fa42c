"""The prompt sets specdec ships: the bench's versioned set and its held-out set (JSON lines, runtime.prompts).

Here, below every package that reads them: `specdec bench` measures on them, and `specdec distill` keeps its
training prompts off them.
"""

from pathlib import Path

PROMPTS_FILE = Path(__file__).with_name("prompts.jsonl")
HELDOUT_PROMPTS_FILE = Path(__file__).with_name("prompts-heldout.jsonl")  # the prompts the defaults were checked on
PROMPT_SET_VERSION = 1  # bump when prompts.jsonl changes: results are only comparable within a version
