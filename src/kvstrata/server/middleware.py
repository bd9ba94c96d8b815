"""The app's ASGI middleware (plain ASGI: BaseHTTPMiddleware would buffer the event
streams' cancellation): `LimitBody`, `RequireApiKey`, `CountRequests`.
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, Counter
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvstrata.core.units import format_bytes
from kvstrata.server.errors import APIError
from kvstrata.server.protocol import CHAT, COMPLETIONS

ROUTES = (COMPLETIONS, CHAT, "/v1/models", "/health", "/metrics")  # counted by path


async def _answer(error: APIError, scope: Scope, receive: Receive, send: Send, **kw: Any) -> None:
    await JSONResponse(error.body(), status_code=error.status, **kw)(scope, receive, send)


class RequireApiKey:
    """ASGI middleware: every request but OPEN needs `Authorization: Bearer <api_key>`
    (compared in constant time); others get OpenAI's 401 error object."""

    OPEN = ("/health", "/metrics")  # what stays open (vLLM's rule); everything else,
    # under whatever root_path or mount, needs the key: it fails closed

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, root = scope.get("path", ""), scope.get("root_path", "")
        if root and path.startswith(root):  # the path within this app (a mount's, a proxy's)
            path = path[len(root) :]
        if scope["type"] == "http" and path not in self.OPEN:
            given = [v for k, v in scope.get("headers") or () if k == b"authorization"]
            scheme, _, token = (given[0] if len(given) == 1 else b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.expected):
                several = "several Authorization headers: send one"
                why = several if len(given) > 1 else "missing or wrong API key"
                error = APIError(
                    401,
                    f"{why}: send the header Authorization: Bearer <key> "
                    "with the key the server was started with (--api-key)",
                    type="authentication_error",
                    code="invalid_api_key",
                )
                await _answer(error, scope, receive, send, headers={"WWW-Authenticate": "Bearer"})
                return
        await self.app(scope, receive, send)


class CountRequests:
    """ASGI middleware: `kvstrata_http_requests_total{path, status}`."""

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


class LimitBody:
    """ASGI middleware: a request body of more than `max_bytes` is a 413 — at once when
    its Content-Length says so (nothing read), else as soon as the bytes received pass
    it (a chunked body), so no more than `max_bytes` of it is ever held."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def too_large(self, size: str) -> APIError:
        return APIError(
            413,
            f"the request body is {size}: this server takes at most "
            f"{format_bytes(self.max_bytes)} ({self.max_bytes} bytes; --max-request-body)",
            code="request_too_large",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        lengths = [v for k, v in scope.get("headers") or () if k == b"content-length"]
        error = None
        if len(lengths) > 1 or any(not v.isdigit() for v in lengths):
            error = APIError(400, "one Content-Length header of digits, or none", code="bad_header")
        elif lengths and int(lengths[0]) > self.max_bytes:
            error = self.too_large(f"{int(lengths[0]):,} bytes (Content-Length)")
        if error is not None:
            await _answer(error, scope, receive, send)  # the body is never read
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:  # the app's handler answers it
                    raise self.too_large(f"more than {received:,} bytes")
            return message

        await self.app(scope, counting_receive, send)
