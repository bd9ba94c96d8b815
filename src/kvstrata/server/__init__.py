"""An OpenAI-compatible HTTP server over `kvstrata.engine.Engine` (the `serve` extra:
FastAPI + uvicorn, imported only when an app is built).

    from kvstrata.server import build_app
    app = build_app(engine)                 # FastAPI; serve it with uvicorn
    kvstrata serve --model default --port 8000   # the same from the command line
"""

from __future__ import annotations

from typing import Any

from kvstrata.core.errors import MissingExtraError
from kvstrata.server.deps import require_serve


def build_app(
    engine: Any,
    served_model_name: str | None = None,
    api_key: str | None = None,
    limits: Any = None,
) -> Any:
    """The FastAPI app serving `engine` (a running Engine; its owner shuts it down) as
    `served_model_name` (default engine.model_name); with `api_key`, every request but
    /health and /metrics needs `Authorization: Bearer <api_key>` (a 401 otherwise, also
    for two such headers); `limits`: a ServeLimits (default ServeLimits()).
    MissingExtraError when FastAPI or uvicorn is not installed."""
    require_serve()
    from kvstrata.server.app import build_app as _build_app

    return _build_app(engine, served_model_name, api_key, limits)


__all__ = ["MissingExtraError", "build_app", "require_serve"]
