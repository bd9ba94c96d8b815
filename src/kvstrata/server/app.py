"""The OpenAI-compatible HTTP app over an `Engine` (FastAPI).

    POST /v1/completions        prompt(s) (text or token ids) -> text; SSE with "stream"
    POST /v1/chat/completions   messages (chat template)      -> message; SSE with "stream"
    GET  /v1/models             the served model
    GET  /v1/models/{id}        its card (404 for another id)
    GET  /health                200 while the engine runs, 503 once it has stopped
    GET  /metrics               Prometheus text: the engine's metrics + HTTP requests

Each choice of a request (prompts x n) is its own engine request, submitted with a
callback that queues its outputs for the event loop (`Choices`); the event loop only
submits and aborts (both quick), the engine thread does every forward, and prompts are
tokenized and chat templates rendered in a worker thread. Every choice is checked
before any is submitted. A client that goes away — mid-stream or while waiting for a
whole completion — cancels its task, which closes its choices and so aborts their
requests (their blocks are freed at the engine's next step).
Errors are OpenAI error objects with a one-line message: a bad body or field 400,
an unknown model 404, a request the engine can never run 400, the engine stopped 503.
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from starlette.exceptions import HTTPException
from starlette.responses import StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvstrata.core.errors import ConfigError, KvstrataError
from kvstrata.engine.params import RequestOutput, RequestRejected, SamplingParams
from kvstrata.server import protocol as proto
from kvstrata.server.chat import chat_prompt_ids, check_messages, template_options
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


@dataclass
class Job:
    """One choice of a request: choice `index` (prompt_index * n + i), its engine
    request id, prompt and params; `echo_text`: the prompt's text (completions' echo);
    `after`: the choice whose first output it waits for (None: it starts at once)."""

    index: int
    prompt_index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    echo_text: str
    after: int | None = None


class Choices:
    """The engine requests of one HTTP request, one per choice: their outputs merged,
    in arrival order, as `(choice index, RequestOutput)`; iteration ends when every
    choice has finished. `start()` submits the choices that start at once (a refused
    one aborts the rest and raises); a choice with `after` is submitted when that
    choice's first output comes — the engine sends it as soon as that choice's first
    token is chosen (`first_output`), text or not: its prompt is computed and in the
    prefix cache by then, so the other choices of a prompt reuse its blocks instead of
    all computing it in the same step. Once `stopping()` (the server stops taking
    requests) they are not submitted: they end as aborted. `aclose()` aborts the ones
    not finished."""

    def __init__(
        self,
        engine: Any,
        jobs: list[Job],
        salt: str | None,
        stopping: Callable[[], bool] = lambda: False,
    ) -> None:
        self.engine = engine
        self.jobs = jobs
        self.salt = salt
        self.stopping = stopping
        self.queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()
        self.open: set[str] = set()  # submitted or waiting, not finished
        self.waiting: dict[int, list[Job]] = {}  # choice index -> the jobs after it

    def start(self) -> None:
        for job in self.jobs:
            if job.after is not None:
                self.waiting.setdefault(job.after, []).append(job)
        self._submit([job for job in self.jobs if job.after is None])
        self.open.update(job.request_id for job in self.jobs)

    def _submit(self, jobs: list[Job]) -> None:
        loop = asyncio.get_running_loop()
        try:
            for job in jobs:
                extra = {"first_output": True} if job.index in self.waiting else {}
                self.engine.submit(
                    job.prompt_ids,
                    job.params,
                    request_id=job.request_id,
                    on_output=self._callback(loop, job.index),
                    salt=self.salt,
                    **extra,
                )
                self.open.add(job.request_id)
        except BaseException:
            self.abort()
            raise

    def _callback(self, loop: asyncio.AbstractEventLoop, index: int) -> Callable:
        def on_output(out: RequestOutput) -> None:  # the engine thread
            try:
                loop.call_soon_threadsafe(self.queue.put_nowait, (index, out))
            except RuntimeError:  # the event loop is gone: nobody is listening
                self.engine.abort(out.request_id)

        return on_output

    def __aiter__(self) -> Choices:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if not self.open:
            raise StopAsyncIteration
        index, out = await self.queue.get()
        if out.finished:
            self.open.discard(out.request_id)
        if index in self.waiting and out.finish_reason != "abort":
            later = self.waiting.pop(index)
            if self.stopping():  # never started: they end as aborted (a 503)
                for job in later:
                    ended = RequestOutput(job.request_id, finish_reason="abort")
                    self.queue.put_nowait((job.index, ended))
            else:
                self._submit(later)
        return index, out

    def abort(self) -> None:
        self.waiting.clear()
        for request_id in self.open:  # (one never submitted: the engine ignores it)
            self.engine.abort(request_id)
        self.open.clear()

    async def aclose(self) -> None:
        self.abort()


class ChoiceState:
    """One choice's response as its outputs come: the echoed prompt in front of the
    first piece, the tokens whose logprobs each piece reports (`proto.ChoiceTokens`:
    each token's text and offset in the choice's text), the final output."""

    def __init__(
        self, job: Job, logprobs: proto.Logprobs, tokens: proto.ChoiceTokens | None = None
    ) -> None:
        self.job = job
        self.top = logprobs.top
        self.echo = logprobs.echo
        self.pieces = tokens  # set when logprobs are asked for
        self.started = False
        self.generated = 0  # characters of generated text so far
        self.text: list[str] = []  # every piece (whole responses)
        self.tokens: list[proto.TokenInfo] = []
        self.held: list[proto.TokenInfo] = []  # generated tokens past the text sent
        self.final: RequestOutput | None = None

    @property
    def scores_prompt(self) -> bool:
        """Whether the next output brings the echoed prompt's logprobs (a long job)."""
        return not self.started and self.echo and self.pieces is not None

    def take(self, out: RequestOutput) -> tuple[str, list[proto.TokenInfo]]:
        """The text of `out` and its tokens with their logprobs (empty unless asked
        for), the echoed prompt (and its tokens) in front of the first."""
        text, tokens = out.text, []
        self.generated += len(out.text)
        if not self.started:
            self.started = True
            if self.echo:
                text = self.job.echo_text + text
                if self.pieces is not None:
                    prompt = out.prompt_logprobs or [None] * len(self.job.prompt_ids)
                    tokens += self.pieces.prompt(self.job.prompt_ids, prompt, self.job.echo_text)
        if self.pieces is not None:
            # a token goes out once the text sent covers it: the engine holds back text
            # that may still become a stop string, and a stop string cuts it at the end
            self.held += self.pieces.generated(out)
            if out.finished:
                self.pieces.clip(self.held, self.generated)
                sent = len(self.held)
            else:
                end, sent = self.pieces.base + self.generated, 0
                while sent < len(self.held):
                    info = self.held[sent]
                    if info.offset + len(info.text) > end:
                        break
                    sent += 1
            tokens += self.held[:sent]
            del self.held[:sent]
        if out.finished:
            self.final = out
        return text, tokens

    def running_usage(self, out: RequestOutput | None) -> dict[str, Any]:
        """This choice's usage so far (continuous_usage_stats; vLLM's numbers: its
        prompt's tokens and the tokens it generated so far)."""
        if out is None:
            return proto.usage(len(self.job.prompt_ids), 0, 0)
        return proto.usage(out.prompt_tokens, out.completion_tokens, out.cached_tokens)


async def take(state: ChoiceState, out: RequestOutput) -> tuple[str, list[proto.TokenInfo]]:
    """state.take(out); in a worker thread when it places a whole echoed prompt's
    tokens (a few decodes each), so the event loop goes on meanwhile."""
    if state.scores_prompt:
        return await asyncio.to_thread(state.take, out)
    return state.take(out)


def usage_of(states: list[ChoiceState], n: int) -> dict[str, Any]:
    """`usage` of finished choices: each prompt once (its first choice's numbers), the
    completion tokens of every choice."""
    finals = [s.final for s in states]
    assert all(f is not None for f in finals)
    firsts = [f for i, f in enumerate(finals) if i % n == 0]
    return proto.usage(
        sum(f.prompt_tokens for f in firsts),
        sum(f.completion_tokens for f in finals),
        sum(f.cached_tokens for f in firsts),
    )


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
        self.texts = proto.TokenTexts(tokenizer)
        self.eos_ids = set(getattr(engine, "eos_ids", ()) or ())
        store_config = getattr(getattr(engine, "store", None), "config", None)
        self.block_size = int(getattr(store_config, "block_size", 0) or 0)

    def stop_requests(self) -> None:
        """Abort every request being answered and refuse new ones (503): their streams
        end with an error event, whole completions with a 503. For a server shutting
        down once its grace period is over."""
        self.stopping = True
        for request_id in list(self.active):
            self.engine.abort(request_id)

    # -- GET ------------------------------------------------------------------------------
    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_card()]}

    def model_card(self, model_id: str | None = None) -> dict[str, Any]:
        """The served model's card (GET /v1/models/{id}: a 404 for another id)."""
        if model_id is not None and model_id != self.model_name:
            raise APIError(
                404,
                f"model={model_id!r} is invalid: this server serves {self.model_name!r} "
                "(GET /v1/models)",
                type="not_found_error",
                param="model",
                code="model_not_found",
            )
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "kvstrata",
            "max_model_len": self.engine.max_model_len,
        }

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
        head = ResponseHead(
            id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=self.model_name,
        )
        logprobs = proto.logprobs_request(body, endpoint)
        # tokenizing, rendering a chat template, checking: off the event loop
        jobs = await asyncio.to_thread(self.jobs, body, endpoint, head.id, fields.n, logprobs)
        if self.stopping:  # stop_requests came meanwhile: submit nothing
            raise APIError(503, "the server is shutting down", code="unavailable")
        states = [ChoiceState(job, logprobs, self.choice_tokens(job, logprobs)) for job in jobs]
        choices = Choices(self.engine, jobs, fields.salt, lambda: self.stopping)
        ids = {job.request_id for job in jobs}
        self.active.update(ids)
        try:
            choices.start()
            if fields.stream:
                first = await until_disconnect(request, _next(choices))
                if first[1].finish_reason == "abort":
                    raise aborted_error(first[1], self.stopping)
                events = self.events(choices, first, head, chat, fields, states)
                return EventStream(events, choices, lambda: self.active.difference_update(ids))
            aborted = await until_disconnect(request, _collect(choices, states))
        except ClientGone:
            await self.finish(ids, choices)
            return Response(status_code=499)  # nobody reads it (nginx's "client closed")
        except (APIError, asyncio.CancelledError):
            await self.finish(ids, choices)
            raise
        except Exception as exc:
            await self.finish(ids, choices)
            raise engine_error(exc) from None
        if aborted is not None:  # the engine ended one choice: the others end too
            await self.finish(ids, choices)
            raise aborted_error(aborted, self.stopping)
        self.active.difference_update(ids)
        return JSONResponse(self.response(head, chat, states, fields.n))

    def choice_tokens(self, job: Job, logprobs: proto.Logprobs) -> proto.ChoiceTokens | None:
        """What places a choice's tokens in its text (None: no logprobs asked for)."""
        if logprobs.top is None:
            return None
        p = job.params
        stop_ids = {*p.stop_token_ids, *(() if p.ignore_eos else self.eos_ids)}
        return proto.ChoiceTokens(self.engine.tokenizer, self.texts, job.prompt_ids, stop_ids)

    def jobs(
        self, body: dict[str, Any], endpoint: str, head_id: str, n: int, logprobs: proto.Logprobs
    ) -> list[Job]:
        """The request's choices: prompts x n, in vLLM's order (index = prompt * n + i),
        each checked by the engine (a request it can never run is a 400 before any
        choice is submitted). Runs in a worker thread."""
        bias = proto.logit_bias(body, self.vocab_size)
        tokenizer = self.engine.tokenizer
        if endpoint == CHAT:
            add_generation_prompt, template_kwargs = template_options(body, tokenizer)
            messages = check_messages(body.get("messages"))
            ids = chat_prompt_ids(tokenizer, messages, add_generation_prompt, template_kwargs)
            prompts: list[tuple[list[int], str]] = [(ids, "")]
            default_max = self.room_for(ids)
        else:
            prompts = []
            given = proto.completion_prompts(body, self.vocab_size)
            proto.check_choices(n, len(given))  # before tokenizing them all
            for prompt in given:
                try:
                    ids = self.engine.encode(prompt)
                except KvstrataError as exc:
                    raise engine_error(exc) from None
                if isinstance(prompt, str):
                    text = prompt
                elif logprobs.echo and tokenizer is not None:
                    text = proto.prompt_text(tokenizer, ids)
                else:
                    text = ""
                prompts.append((ids, text))
            default_max = proto.DEFAULT_COMPLETION_TOKENS
        proto.check_choices(n, len(prompts))
        params = proto.sampling_params(body, endpoint, default_max, logprobs, bias)
        # choices 1.. of a prompt wait for choice 0 to compute it, when it holds a full
        # block to share (a request scoring its prompt shares nothing: no lookup)
        share = n > 1 and params.prompt_logprobs is None
        jobs = []
        for p, (ids, text) in enumerate(prompts):
            after = p * n if share and 0 < self.block_size < len(ids) else None
            for i in range(n):
                index = p * n + i
                rid = head_id if len(prompts) * n == 1 else f"{head_id}-{index}"
                job = Job(index, p, rid, ids, proto.choice_params(params, i), text)
                job.after = after if i else None
                jobs.append(job)
        check = getattr(self.engine, "check", None)
        for job in jobs if check is not None else ():
            try:
                check(job.prompt_ids, job.params)
            except KvstrataError as exc:
                raise engine_error(exc) from None
        return jobs

    def response(
        self, head: ResponseHead, chat: bool, states: list[ChoiceState], n: int
    ) -> dict[str, Any]:
        """The whole (non-streamed) response of finished choices."""
        choices = []
        for state in states:
            assert state.final is not None
            text, reason = "".join(state.text), state.final.finish_reason
            lps = None
            if state.pieces is not None:
                state.pieces.clip(state.tokens, state.generated)  # at a stop string
                lps = (
                    proto.chat_logprobs(state.tokens, self.texts)
                    if chat
                    else proto.completion_logprobs(state.tokens)
                )
            make = proto.chat_choice if chat else proto.completion_choice
            choices.append(make(state.job.index, text, reason, lps))
        use = usage_of(states, n)
        return head.chat(choices, use) if chat else head.completion(choices, use)

    async def finish(self, request_ids: set[str], outputs: Any) -> None:
        """Forget a request's choices and close them (an abort unless finished)."""
        self.active.difference_update(request_ids)
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
        outputs: Choices,
        first: tuple[int, RequestOutput],
        head: ResponseHead,
        chat: bool,
        fields: proto.CommonFields,
        states: list[ChoiceState],
    ) -> AsyncIterator[bytes]:
        """The SSE body: OpenAI chunks (each with its choice's index; with
        continuous_usage_stats, each with its choice's usage so far), an optional usage
        chunk once every choice has finished, then [DONE]; an error event if the engine
        gives up mid-way. Leaving early closes `outputs` (abort)."""
        usage: bool | dict[str, Any] = fields.include_usage
        try:
            if chat:
                for state in states:
                    delta = {"role": "assistant", "content": ""}
                    if fields.continuous_usage:
                        usage = state.running_usage(None)
                    yield proto.sse(head.chat_chunk(state.job.index, delta, None, usage))
            index, out = first
            left = len(states)
            while True:
                if out.finish_reason == "abort":
                    yield proto.sse(aborted_error(out, self.stopping).body())
                    break
                state = states[index]
                text, tokens = await take(state, out)
                if fields.continuous_usage:
                    usage = state.running_usage(out)
                lps = None
                if chat:
                    if state.pieces is not None and tokens:
                        lps = proto.chat_logprobs(tokens, self.texts)
                    if text or lps:
                        delta = {"content": text}
                        yield proto.sse(head.chat_chunk(index, delta, None, usage, lps))
                    if out.finished:
                        yield proto.sse(head.chat_chunk(index, {}, out.finish_reason, usage))
                else:
                    if state.pieces is not None:
                        lps = proto.completion_logprobs(tokens)
                    if text or out.finished or tokens:
                        chunk = head.completion_chunk(index, text, out.finish_reason, usage, lps)
                        yield proto.sse(chunk)
                if out.finished:
                    left -= 1
                    if not left:
                        if usage:
                            yield proto.sse(head.usage_chunk(chat, usage_of(states, fields.n)))
                        break
                index, out = await outputs.__anext__()
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


async def _next(outputs: Choices) -> tuple[int, RequestOutput]:
    return await outputs.__anext__()


async def _collect(outputs: Choices, states: list[ChoiceState]) -> RequestOutput | None:
    """Run every choice to its end, gathering its text and logprobs into `states`;
    the output of a choice the engine aborted (None when all finished)."""
    async for index, out in outputs:
        if out.finish_reason == "abort":
            return out
        state = states[index]
        text, tokens = await take(state, out)
        state.text.append(text)
        state.tokens.extend(tokens)
    if any(s.final is None for s in states):
        raise KvstrataError("the engine ended the request without a final output")
    return None


def build_app(
    engine: Any, served_model_name: str | None = None, api_key: str | None = None
) -> FastAPI:
    """The OpenAI-compatible app over `engine` (module docstring).

    Args:
        engine: A running kvstrata.engine.Engine; its owner shuts it down.
        served_model_name: The model name clients use (default: engine.model_name).
        api_key: When set, every request but /health and /metrics (open, as in vLLM)
            must send `Authorization: Bearer <it>` (a 401 otherwise).

    Returns:
        A FastAPI app (serve it with uvicorn).
    """
    name = engine.model_name if served_model_name is None else served_model_name
    if not isinstance(name, str) or not name.strip():
        raise ConfigError.field("served_model_name", name, "a non-empty model name")
    if api_key is not None and not (
        isinstance(api_key, str)
        and api_key
        and api_key.isascii()
        and api_key.isprintable()
        and api_key == api_key.strip()
    ):
        raise ConfigError.field(
            "api_key",
            "<hidden>" if isinstance(api_key, str) else api_key,
            "printable ASCII without spaces around it (what an HTTP header can carry), "
            "or leave it out",
        )
    server = OpenAIServer(engine, name)
    app = FastAPI(title="kvstrata", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    if api_key is not None:
        app.add_middleware(RequireApiKey, api_key=api_key)
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

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if not model_id:  # "/v1/models/": the list
            return server.models()
        return server.model_card(model_id)

    @app.get("/health")
    async def health() -> Response:
        return server.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return await server.metrics()

    return app
