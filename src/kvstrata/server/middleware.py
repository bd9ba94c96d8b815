"""The app's ASGI middleware (plain ASGI wrappers: BaseHTTPMiddleware would buffer the
event streams' cancellation): the API key every request but /health and /metrics
needs (`RequireApiKey`), and the count of HTTP requests answered, by path and status
(`CountRequests`).
"""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, Counter
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvstrata.server.errors import APIError
from kvstrata.server.validation import CHAT, COMPLETIONS

ROUTES = (COMPLETIONS, CHAT, "/v1/models", "/health", "/metrics")  # counted by path


def _route_path(scope: Scope) -> str:
    """The request's path within this app (without a mount's or proxy's root_path)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


class RequireApiKey:
    """ASGI middleware: every request but OPEN needs `Authorization: Bearer <api_key>`
    (compared in constant time); others get OpenAI's 401 error object."""

    OPEN = ("/health", "/metrics")  # what stays open (vLLM's rule); everything else,
    # under whatever root_path or mount, needs the key: it fails closed

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _route_path(scope) not in self.OPEN:
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.expected):
                error = APIError(
                    401,
                    "missing or wrong API key: send the header Authorization: Bearer <key> "
                    "with the key the server was started with (--api-key)",
                    type="authentication_error",
                    code="invalid_api_key",
                )
                response = JSONResponse(
                    error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"}
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class CountRequests:
    """ASGI middleware: `kvstrata_http_requests_total{path, status}` (a plain ASGI
    wrapper: BaseHTTPMiddleware would buffer the event streams' cancellation)."""

    def __init__(self, app: ASGIApp, registry: CollectorRegistry) -> None:
        self.app = app
        self.requests = Counter(
            "kvstrata_http_requests",
            "HTTP requests answered, by path and status",
            ["path", "status"],
            registry=registry,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [0]

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            path = scope.get("path", "")
            self.requests.labels(path if path in ROUTES else "other", str(status[0] or 500)).inc()
