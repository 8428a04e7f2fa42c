"""specdec's benchmark suite (`specdec bench`): configurations side by side, anchors, reports.

The prompt sets it measures on ship in specdec.data (the exporter reads them too); named here as well, the
bench's default set.
"""

from specdec.data import PROMPT_SET_VERSION, PROMPTS_FILE

__all__ = ["PROMPTS_FILE", "PROMPT_SET_VERSION"]
