"""specdec's runtime: exact speculative decoding on onnxruntime. numpy + onnxruntime + tokenizers only.

    from specdec.runtime import Engine, GenerationConfig
    engine = Engine.load("artifacts/smollm2")
    result = engine.generate("Hello", GenerationConfig(max_new_tokens=32))
"""

import importlib

# Loaded on first use, so that `specdec.runtime.config` (what the CLI reads its defaults from)
# does not import onnxruntime.
_EXPORTS = {
    "Engine": "specdec.runtime.engine",
    "BatchEngine": "specdec.runtime.batch",
    "GenerationResult": "specdec.runtime.engine",
    "GenerationStream": "specdec.runtime.engine",
    "GenerationConfig": "specdec.runtime.config",
    "Iteration": "specdec.runtime.loop",
    "GenerationStats": "specdec.runtime.stats",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    """Return one of the public names, importing its module on first use."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'specdec.runtime' has no attribute '{name}'")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
