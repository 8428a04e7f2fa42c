"""What machine this is, for cache keys and reports. Standard library only: the CLI imports it without onnxruntime."""

from __future__ import annotations

import platform


def cpu_model() -> str:
    """Return the CPU's model name (Linux /proc/cpuinfo), else the platform's processor string."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
