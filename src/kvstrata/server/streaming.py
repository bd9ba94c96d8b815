"""The HTTP side of a response the engine takes time over: the client's disconnect
(`until_disconnect`) and the server-sent event stream (`EventStream`) of OpenAI's chunks
(`sse_events`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvstrata.engine.params import RequestOutput
from kvstrata.server.choices import Choices, ChoiceState, usage_of
from kvstrata.server.detokenizer import TokenInfo, TokenTexts
from kvstrata.server.errors import aborted_error, engine_error
from kvstrata.server.protocol import Request as Body
from kvstrata.server.responses import (
    SSE_DONE,
    ResponseHead,
    chat_logprobs,
    completion_logprobs,
    delta,
    sse,
)


class ClientGone(Exception):
    """The client disconnected before its response was ready (nothing to answer)."""


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


class EventStream(StreamingResponse):
    """Server-sent events whose generator, and the engine stream under it, are always
    closed when the response ends: normally, on a disconnect (Starlette cancels the
    sending task), on a send error, or before the generator ever started."""

    media_type = "text/event-stream"

    def __init__(
        self, content: AsyncIterator[bytes], outputs: Choices, on_close: Callable[[], None]
    ) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.outputs = outputs
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):  # even when cancelled
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            self.outputs.abort()  # the choices not finished
            self.on_close()


async def sse_events(
    outputs: Choices,
    first: tuple[int, RequestOutput],
    head: ResponseHead,
    body: Body,
    states: list[ChoiceState],
    texts: TokenTexts,
    stopping: Callable[[], bool],
) -> AsyncIterator[bytes]:
    """The SSE body: OpenAI chunks (each with its choice's index; with
    continuous_usage_stats, each with its choice's usage so far), an optional usage
    chunk once every choice has finished, then [DONE]; an error event if the engine
    gives up mid-way (`stopping`: whether the server is stopping, when it does)."""
    usage: bool | dict[str, Any] = body.include_usage
    try:
        for state in states if head.chat else ():
            if body.continuous_usage:
                usage = state.running_usage(None)
            role = delta(state.job.index, {"role": "assistant", "content": ""})
            yield sse(head.chunk([role], usage))
        index, out = first
        left = len(states)
        while True:
            if out.finish_reason == "abort":
                yield sse(aborted_error(out, stopping()).body())
                break
            state = states[index]
            text, tokens = await state.take(out)
            if body.continuous_usage:
                usage = state.running_usage(out)
            for choice in _output_choices(head, index, state, out, text, tokens, texts):
                yield sse(head.chunk([choice], usage))
            if out.finished:
                left -= 1
                if not left:
                    if usage:
                        yield sse(head.chunk([], usage_of(states, body.n)))
                    break
            index, out = await outputs.__anext__()
        yield SSE_DONE
    except Exception as exc:  # the stream ended without a final output
        yield sse(engine_error(exc).body())


def _output_choices(
    head: ResponseHead,
    index: int,
    state: ChoiceState,
    out: RequestOutput,
    text: str,
    tokens: list[TokenInfo],
    texts: TokenTexts,
) -> list[dict[str, Any]]:
    """The streamed choices one output of choice `index` makes (`text`, `tokens`: what
    it adds): chat, a content delta (when it has text or logprobs) then, when it
    finishes, a finish delta; completions, one choice (with text or tokens, or final)."""
    if not head.chat:
        lps = completion_logprobs(tokens) if state.pieces is not None else None
        keep = text or out.finished or tokens
        return [head.choice(index, text, out.finish_reason, lps)] if keep else []
    lps = chat_logprobs(tokens, texts) if state.pieces is not None and tokens else None
    choices = [delta(index, {"content": text}, logprobs=lps)] if text or lps else []
    if out.finished:
        choices.append(delta(index, {}, out.finish_reason))
    return choices
