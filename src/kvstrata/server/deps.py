"""The `serve` extra: FastAPI and uvicorn, imported only when a server is built."""

from __future__ import annotations

import importlib.util

from kvstrata.core.errors import MissingExtraError

SERVE_PACKAGES = ("fastapi", "uvicorn")


def require_serve() -> None:
    """MissingExtraError naming `pip install 'kvstrata[serve]'` unless FastAPI and
    uvicorn are importable."""
    missing = [name for name in SERVE_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingExtraError(
            f"the HTTP server needs {' and '.join(missing)}, which "
            f"{'is' if len(missing) == 1 else 'are'} not installed: pip install 'kvstrata[serve]'"
        )
