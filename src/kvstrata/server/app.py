"""The OpenAI-compatible HTTP app over an `Engine` (FastAPI).

    POST /v1/completions        prompt (text or token ids) -> text; SSE with "stream"
    POST /v1/chat/completions   messages (chat template)   -> message; SSE with "stream"
    GET  /v1/models             the served model
    GET  /health                200 while the engine runs, 503 once it has stopped
    GET  /metrics               Prometheus text: the engine's metrics + HTTP requests

Every request goes through the async `Engine.stream`; the event loop only submits
and aborts (both quick), the engine thread does every forward. A client that goes away
— mid-stream or while waiting for a whole completion — cancels its task, which leaves
the stream and so aborts the request (its blocks are freed at the engine's next step).
Errors are OpenAI error objects with a one-line message: a bad body or field 400,
an unknown model 404, a request the engine can never run 400, the engine stopped 503.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from starlette.exceptions import HTTPException
from starlette.responses import StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvstrata.engine.params import RequestOutput, RequestRejected
from kvstrata.errors import ConfigError, KvstrataError
from kvstrata.server import protocol as proto
from kvstrata.server.chat import chat_prompt_ids, check_messages
from kvstrata.server.protocol import CHAT, COMPLETIONS, APIError, ResponseHead

ROUTES = (COMPLETIONS, CHAT, "/v1/models", "/health", "/metrics")

CHAT_DEFAULT_MAX_TOKENS = 2048  # chat without max_tokens: see Server.room_for


class ClientGone(Exception):
    """The client disconnected before its response was ready (nothing to answer)."""


def engine_running(engine: Any) -> bool:
    """Whether the engine takes requests (not shut down, not stopped on an error)."""
    return bool(engine.is_running)


def engine_error(exc: BaseException) -> APIError:
    """The HTTP answer to an exception raised by Engine.submit / Engine.stream."""
    message = str(exc)
    if isinstance(exc, RequestRejected):
        return APIError(400, message, param=proto.field_of(message), code="request_rejected")
    if isinstance(exc, ConfigError):
        return APIError(400, message, param=proto.field_of(message), code="invalid_value")
    if isinstance(exc, KvstrataError):  # EngineStopped: "the engine is shut down"
        return APIError(503, f"{message}: this server cannot take requests", code="unavailable")
    return APIError(500, f"{type(exc).__name__}: {message}", code="internal_error")


def aborted_error(out: RequestOutput, stopping: bool = False) -> APIError:
    """The HTTP answer to a request the engine ended with "abort" (not the client's)."""
    if stopping:
        return APIError(
            503, "the server is shutting down: the request was stopped", code="unavailable"
        )
    if out.error is None or out.error.startswith("the engine stopped"):
        why = out.error or "the engine shut down"
        return APIError(503, f"{why} before the request finished", code="unavailable")
    return APIError(500, f"the engine gave up on the request: {out.error}", code="engine_error")


async def until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Await `work`, cancelling it (and raising ClientGone) if the client disconnects
    first. The request body must have been read: `receive` then only reports the
    disconnect (or the end of the response)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            # Wait for its cleanup even if we are being cancelled ourselves, so nobody
            # touches the stream while the task still runs it.
            with anyio.CancelScope(shield=True):
                await asyncio.wait({task})
    if not task.cancelled():
        return task.result()  # the result, or work's own exception
    raise ClientGone


async def aclose_shielded(agen: Any) -> None:
    """Close an async generator even inside a cancelled scope (its finally aborts)."""
    with anyio.CancelScope(shield=True):
        await agen.aclose()


class EventStream(StreamingResponse):
    """Server-sent events whose generator, and the engine stream under it, are always
    closed when the response ends: normally, on a disconnect (Starlette cancels the
    sending task), on a send error, or before the generator ever started."""

    media_type = "text/event-stream"

    def __init__(
        self, content: AsyncIterator[bytes], outputs: Any, on_close: Callable[[], None]
    ) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.outputs = outputs
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await aclose_shielded(self.body_iterator)
            await aclose_shielded(self.outputs)  # aborts the request unless it finished
            self.on_close()


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


class OpenAIServer:
    """The endpoints' logic over one engine (`build_app` wires them to routes)."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.created = int(time.time())
        self.http_registry = CollectorRegistry()
        self.active: set[str] = set()  # ids of the requests being answered
        self.stopping = False
        tokenizer = engine.tokenizer
        self.vocab_size = int(getattr(engine, "vocab_size", 0) or len(tokenizer))

    def stop_requests(self) -> None:
        """Abort every request being answered and refuse new ones (503): their streams
        end with an error event, whole completions with a 503. For a server shutting
        down once its grace period is over."""
        self.stopping = True
        for request_id in list(self.active):
            self.engine.abort(request_id)

    # -- GET ------------------------------------------------------------------------------
    def models(self) -> dict[str, Any]:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "kvstrata",
            "max_model_len": self.engine.max_model_len,
        }
        return {"object": "list", "data": [card]}

    def health(self) -> Response:
        if engine_running(self.engine):
            return JSONResponse({"status": "ok"})
        return JSONResponse(APIError(503, "the engine has stopped").body(), status_code=503)

    async def metrics(self) -> Response:
        def scrape() -> bytes:
            return generate_latest(self.engine.metrics.registry) + generate_latest(
                self.http_registry
            )

        return Response(await anyio.to_thread.run_sync(scrape), media_type=CONTENT_TYPE_LATEST)

    # -- POST -----------------------------------------------------------------------------
    async def generate(self, request: Request, endpoint: str) -> Response:
        if self.stopping:
            raise APIError(503, "the server is shutting down", code="unavailable")
        body = proto.parse_json_body(await request.body())
        fields = proto.check_fields(body, endpoint)
        if fields.model is not None and fields.model != self.model_name:
            raise APIError(
                404,
                f"model={fields.model!r} does not exist: this server serves "
                f"{self.model_name!r} (GET /v1/models)",
                param="model",
                code="model_not_found",
            )
        chat = endpoint == CHAT
        prompt: str | list[int]
        if chat:
            prompt = chat_prompt_ids(self.engine.tokenizer, check_messages(body.get("messages")))
            default_max = self.room_for(prompt)
        else:
            prompt = proto.completion_prompt(body, self.vocab_size)
            default_max = proto.DEFAULT_COMPLETION_TOKENS
        params = proto.sampling_params(body, endpoint, default_max)
        head = ResponseHead(
            id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=self.model_name,
        )
        outputs = self.engine.stream(prompt, params, request_id=head.id, salt=fields.salt)
        self.active.add(head.id)
        try:
            if fields.stream:
                first = await until_disconnect(request, _next(outputs))
                if first.finish_reason == "abort":
                    raise aborted_error(first, self.stopping)
                events = self.events(outputs, first, head, chat, fields.include_usage)
                return EventStream(events, outputs, lambda: self.active.discard(head.id))
            text, final = await until_disconnect(request, _collect(outputs))
        except ClientGone:
            await self.finish(head.id, outputs)
            return Response(status_code=499)  # nobody reads it (nginx's "client closed")
        except (APIError, asyncio.CancelledError):
            await self.finish(head.id, outputs)
            raise
        except Exception as exc:
            await self.finish(head.id, outputs)
            raise engine_error(exc) from None
        self.active.discard(head.id)
        if final.finish_reason == "abort":
            raise aborted_error(final, self.stopping)
        answer = head.chat if chat else head.completion
        return JSONResponse(answer(text, final.finish_reason, final))

    async def finish(self, request_id: str, outputs: Any) -> None:
        """Forget a request and close its stream (an abort unless it finished)."""
        self.active.discard(request_id)
        await aclose_shielded(outputs)

    def room_for(self, prompt_ids: list[int]) -> int:
        """Chat's default max_tokens: the rest of the model's positions (as OpenAI and
        vLLM), at most CHAT_DEFAULT_MAX_TOKENS (each running request reserves its
        prompt + max_tokens, so "the whole context" would run chats one at a time),
        lowered to what all tiers together can hold for this prompt."""
        limit = self.engine.max_model_len
        room = max(1, (limit or len(prompt_ids) + 4096) - len(prompt_ids))
        room = min(room, CHAT_DEFAULT_MAX_TOKENS)
        check = getattr(self.engine, "check", None)
        if check is None or _fits(check, prompt_ids, room):
            return room
        lo, hi = 0, room  # lo fits (or is 0), hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if _fits(check, prompt_ids, mid) else (lo, mid)
        return max(lo, 1)  # 1 that does not fit: submit names the budget to raise

    async def events(
        self,
        outputs: Any,
        first: RequestOutput,
        head: ResponseHead,
        chat: bool,
        include_usage: bool,
    ) -> AsyncIterator[bytes]:
        """The SSE body: OpenAI chunks, an optional usage chunk, then [DONE]; an error
        event if the engine gives up mid-way. Leaving early closes `outputs` (abort)."""
        try:
            if chat:
                yield proto.sse(
                    head.chat_chunk({"role": "assistant", "content": ""}, None, include_usage)
                )
            out = first
            while True:
                if out.finish_reason == "abort":
                    yield proto.sse(aborted_error(out, self.stopping).body())
                    break
                if chat:
                    if out.text:
                        yield proto.sse(head.chat_chunk({"content": out.text}, None, include_usage))
                    if out.finished:
                        yield proto.sse(head.chat_chunk({}, out.finish_reason, include_usage))
                elif out.text or out.finished:
                    yield proto.sse(
                        head.completion_chunk(out.text, out.finish_reason, include_usage)
                    )
                if out.finished:
                    if include_usage:
                        yield proto.sse(head.usage_chunk(chat, out))
                    break
                out = await outputs.__anext__()
            yield proto.SSE_DONE
        except Exception as exc:  # the stream ended without a final output
            yield proto.sse(engine_error(exc).body())
        finally:
            await aclose_shielded(outputs)


def _fits(check: Callable[..., None], prompt_ids: list[int], max_tokens: int) -> bool:
    from kvstrata.engine.params import SamplingParams

    try:
        check(prompt_ids, SamplingParams(max_tokens=max_tokens))
    except (RequestRejected, ConfigError):
        return False
    return True


async def _next(outputs: Any) -> RequestOutput:
    return await outputs.__anext__()


async def _collect(outputs: Any) -> tuple[str, RequestOutput]:
    parts = []
    async for out in outputs:
        parts.append(out.text)
        if out.finished:
            return "".join(parts), out
    raise KvstrataError("the engine ended the request without a final output")


def build_app(engine: Any, served_model_name: str | None = None) -> FastAPI:
    """The OpenAI-compatible app over `engine` (module docstring).

    Args:
        engine: A running kvstrata.engine.Engine; its owner shuts it down.
        served_model_name: The model name clients use (default: engine.model_name).

    Returns:
        A FastAPI app (serve it with uvicorn).
    """
    name = engine.model_name if served_model_name is None else served_model_name
    if not isinstance(name, str) or not name.strip():
        raise ConfigError.field("served_model_name", name, "a non-empty model name")
    server = OpenAIServer(engine, name)
    app = FastAPI(title="kvstrata", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.add_middleware(CountRequests, registry=server.http_registry)

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

    @app.post(COMPLETIONS)
    async def completions(request: Request) -> Response:
        return await server.generate(request, COMPLETIONS)

    @app.post(CHAT)
    async def chat_completions(request: Request) -> Response:
        return await server.generate(request, CHAT)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return server.models()

    @app.get("/health")
    async def health() -> Response:
        return server.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return await server.metrics()

    return app
