"""The OpenAI-compatible HTTP app over an `Engine` (FastAPI).

    POST /v1/completions        prompt(s) (text or token ids) -> text; SSE with "stream"
    POST /v1/chat/completions   messages (chat template)      -> message; SSE with "stream"
    GET  /v1/models             the served model
    GET  /v1/models/{id}        its card (404 for another id)
    GET  /health                200 while the engine runs, 503 once it has stopped
    GET  /metrics               Prometheus text: the engine's metrics + HTTP requests

The endpoints' logic is `routes.OpenAIServer`. Errors are OpenAI error objects with a
one-line message: a bad body or a request the engine can never run 400, a body past the
limit 413, an unknown model 404, the engine stopped 503.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from kvstrata.core.errors import ConfigError
from kvstrata.server.errors import APIError, engine_error
from kvstrata.server.limits import ServeLimits
from kvstrata.server.middleware import CountRequests, LimitBody, RequireApiKey
from kvstrata.server.protocol import CHAT, COMPLETIONS
from kvstrata.server.routes import OpenAIServer


def build_app(
    engine: Any,
    served_model_name: str | None = None,
    api_key: str | None = None,
    limits: ServeLimits | None = None,
) -> FastAPI:
    """The app over `engine` (the arguments: `kvstrata.server.build_app`)."""
    name = engine.model_name if served_model_name is None else served_model_name
    if not isinstance(name, str) or not name.strip():
        raise ConfigError.field("served_model_name", name, "a non-empty model name")
    header_safe = isinstance(api_key, str) and api_key.isascii() and api_key.isprintable()
    if api_key is not None and not (header_safe and api_key and api_key == api_key.strip()):
        raise ConfigError.field(
            "api_key",
            "<hidden>" if isinstance(api_key, str) else api_key,
            "printable ASCII without spaces around it (what an HTTP header can carry), "
            "or leave it out",
        )
    limits = limits or ServeLimits()
    server = OpenAIServer(engine, name, limits)
    app = FastAPI(title="kvstrata", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.add_middleware(LimitBody, max_bytes=limits.max_body_bytes)  # inside the key check
    if api_key is not None:
        app.add_middleware(RequireApiKey, api_key=api_key)
    app.add_middleware(CountRequests, registry=server.http_registry)
    _add_error_handlers(app)
    _add_routes(app, server)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Starlette's errors (an unknown path, a wrong method) and any but an APIError (a
    500) as OpenAI error objects too."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(APIError(exc.status_code, message).body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(engine_error(exc).body(), status_code=500)


def _add_routes(app: FastAPI, server: OpenAIServer) -> None:
    @app.post(COMPLETIONS)
    async def completions(request: Request) -> Response:
        return await server.generate(request, COMPLETIONS)

    @app.post(CHAT)
    async def chat_completions(request: Request) -> Response:
        return await server.generate(request, CHAT)

    @app.post(COMPLETIONS + "/render")
    async def render_completions(request: Request) -> Response:
        return await server.render(request, COMPLETIONS)

    @app.post(CHAT + "/render")
    async def render_chat(request: Request) -> Response:
        return await server.render(request, CHAT)

    app.get("/v1/models")(server.models)

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if not model_id:  # "/v1/models/": the list
            return await server.models()
        return server.model_card(model_id)

    app.get("/health")(server.health)
    app.get("/metrics")(server.metrics)
