"""specdec's benchmark suite (`specdec bench`): configurations side by side, anchors, reports.

Installed as `specdec.benchmarks`; `prompts.jsonl` (the versioned prompt set) ships with it.
"""

from pathlib import Path

PROMPTS_FILE = Path(__file__).with_name("prompts.jsonl")
PROMPT_SET_VERSION = 1  # bump when prompts.jsonl changes: results are only comparable within a version
