"""specdec's runtime: exact speculative decoding on onnxruntime. numpy + onnxruntime + tokenizers only.

    from specdec.runtime import Engine, GenerationConfig
    engine = Engine.load("artifacts/smollm2")
    result = engine.generate("Hello", GenerationConfig(max_new_tokens=32))
"""

from specdec.runtime.engine import Engine, GenerationConfig, GenerationResult, GenerationStream
from specdec.runtime.loop import Iteration
from specdec.runtime.stats import GenerationStats

__all__ = ["Engine", "GenerationConfig", "GenerationResult", "GenerationStats", "GenerationStream", "Iteration"]
