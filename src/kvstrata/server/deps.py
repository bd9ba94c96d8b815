"""The `serve` extra: FastAPI and uvicorn, imported only when a server is built."""

from __future__ import annotations

import importlib.util

from kvstrata.errors import KvstrataError

SERVE_PACKAGES = ("fastapi", "uvicorn")


class MissingExtraError(KvstrataError, ImportError):
    """An optional dependency is not installed; the message names the extra to install."""


def require_serve() -> None:
    """MissingExtraError naming `pip install 'kvstrata[serve]'` unless FastAPI and
    uvicorn are importable."""
    missing = [name for name in SERVE_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingExtraError(
            f"the HTTP server needs {' and '.join(missing)}, which "
            f"{'is' if len(missing) == 1 else 'are'} not installed: pip install 'kvstrata[serve]'"
        )
