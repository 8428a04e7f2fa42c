"""`specdec serve`: an OpenAI-compatible HTTP server over specdec's Engine (the `serve` extra).

    from specdec.serve import ServeConfig, create_app
    app = create_app(ServeConfig(artifact="artifacts/smollm2"))   # a FastAPI app; run it with uvicorn

The runtime (specdec.runtime) never imports this package: it stays numpy + onnxruntime.
"""

from specdec.serve.config import ServeConfig

__all__ = ["ServeConfig", "create_app"]


def create_app(config: ServeConfig, engine=None):
    """Return the FastAPI app serving `config.artifact` (or an already loaded `engine`)."""
    from specdec.serve.app import create_app as _create_app

    return _create_app(config, engine)
