"""The endpoints' logic over one engine (`OpenAIServer`). A completion or chat request is
parsed, its choices (prompts x n, each its own engine request) built and checked by the
engine in a worker thread (the event loop only submits and aborts), submitted, and
answered whole or as an event stream; a client that goes away aborts its requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvstrata.core.errors import ConfigError, KvstrataError
from kvstrata.engine.params import RequestRejected, SamplingParams
from kvstrata.server.chat import chat_messages, chat_prompt_ids, encode_text, template_options
from kvstrata.server.choices import Choices, ChoiceState, Job, collect, usage_of
from kvstrata.server.detokenizer import ChoiceTokens, TokenTexts, prompt_text
from kvstrata.server.errors import APIError, aborted_error, engine_error, invalid
from kvstrata.server.limits import ServeLimits, longest_token_chars
from kvstrata.server.parsing import closest_field, parse_request
from kvstrata.server.protocol import (
    CHAT,
    ChatRequest,
    CompletionRequest,
    Limits,
    too_long,
)
from kvstrata.server.protocol import Request as Body
from kvstrata.server.responses import ResponseHead, chat_logprobs, completion_logprobs
from kvstrata.server.streaming import (
    ClientGone,
    EventStream,
    sse_events,
    until_disconnect,
)
from kvstrata.server.validation import (
    DEFAULT_COMPLETION_TOKENS,
    Logprobs,
    check_choices,
    check_work,
    choice_params,
    logprobs_request,
    sampling_params,
)
from kvstrata.workload.chunks import Chunks, find_documents

log = logging.getLogger(__name__)
IGNORED_HEADER = "X-Kvstrata-Ignored-Fields"  # the unknown request fields left out
CHAT_DEFAULT_MAX_TOKENS = 2048  # chat without max_tokens: see OpenAIServer.room_for


class OpenAIServer:
    """The endpoints over one engine (`app.build_app` routes to them)."""

    def __init__(self, engine: Any, model_name: str, limits: ServeLimits | None = None) -> None:
        limits = limits or ServeLimits()
        self.engine = engine
        self.model_name = model_name
        self.created = int(time.time())
        self.http_registry = CollectorRegistry()
        self.active: set[str] = set()  # ids of the requests being answered
        self.stopping = False
        tokenizer = engine.tokenizer
        self.texts = TokenTexts(tokenizer)
        self.block_size = engine.store.config.block_size
        # a prompt string longer than the model's positions x its longest token cannot
        # fit: refused before it is tokenized (tokenizing costs many times the text's
        # bytes in memory: docs/MEASUREMENTS.md)
        longest, positions = longest_token_chars(tokenizer), engine.max_model_len
        bound = positions * longest if positions and longest else None
        self.limits = Limits(engine.vocab_size or len(tokenizer), bound, limits.strict_fields)
        self.warned_fields: set[str] = set()  # ignored field names already logged
        self.ceiling = limits.request_tokens(engine)
        self.trust_special_tokens = limits.trust_special_tokens

    def stop_requests(self) -> None:
        """Abort every request being answered and refuse new ones (503), once a shutting
        down server's grace period is over."""
        self.stopping = True
        for request_id in list(self.active):
            self.engine.abort(request_id)

    # -- GET ------------------------------------------------------------------------------
    async def models(self) -> dict[str, Any]:
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

    async def health(self) -> Response:
        if self.engine.is_running:  # not shut down, not stopped on an error
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
        """POST /v1/completions or /v1/chat/completions: the request checked, its
        choices built off the event loop, then answered (`answer`)."""
        if self.stopping:
            raise APIError(503, "the server is shutting down", code="unavailable")
        body = self.parsed(await request.body(), endpoint)
        chat = endpoint == CHAT
        kind = "chatcmpl" if chat else "cmpl"
        head = ResponseHead(f"{kind}-{uuid.uuid4().hex}", int(time.time()), self.model_name, chat)
        logprobs = logprobs_request(body)
        try:  # tokenizing, rendering a chat template, checking: off the event loop
            jobs = await asyncio.to_thread(self.jobs, body, head.id, logprobs)
        except KvstrataError as exc:  # the engine refused a prompt or its params
            raise engine_error(exc) from None
        if self.stopping:  # stop_requests came meanwhile: submit nothing
            raise APIError(503, "the server is shutting down", code="unavailable")
        states = [ChoiceState(job, logprobs, self.choice_tokens(job, logprobs)) for job in jobs]
        response = await self.answer(request, jobs, states, head, body)
        if body.ignored_fields:
            response.headers[IGNORED_HEADER] = ", ".join(body.ignored_fields)
        return response

    def parsed(self, raw: bytes, endpoint: str) -> Body:
        """The request body checked against the endpoint's fields and this server's model."""
        body = parse_request(raw, endpoint, self.limits)
        self.warn_ignored(body.ignored_fields, endpoint)
        if body.model is not None and body.model != self.model_name:
            raise APIError(
                404,
                f"model={body.model!r} does not exist: this server serves "
                f"{self.model_name!r} (GET /v1/models)",
                param="model",
                code="model_not_found",
            )
        return body

    async def render(self, request: Request, endpoint: str) -> Response:
        """POST /v1/completions/render or /v1/chat/completions/render (vLLM's render API):
        the token ids a request's prompt becomes (the chat template applied), generating
        nothing. A KV-aware router (vllm-router's kv_aware) asks it to score a text or
        chat request against the blocks the replicas' KV events announce. Completions: a
        list with one item per prompt; chat: one item. Each is vLLM's `GenerateRequest`
        shape: request_id, token_ids, sampling_params, model."""
        body = self.parsed(await request.body(), endpoint)
        logprobs = logprobs_request(body)
        try:  # tokenizing and rendering a chat template: off the event loop
            prompts, default_max = await asyncio.to_thread(self.prompts, body, logprobs.echo)
            params = sampling_params(body, default_max, logprobs)
        except KvstrataError as exc:
            raise engine_error(exc) from None
        sampling = {
            name: value
            for name, value in dataclasses.asdict(params).items()
            if isinstance(value, (bool, int, float, str, list, tuple)) or value is None
        }
        items = [
            {
                "request_id": f"render-{uuid.uuid4().hex}",
                "token_ids": ids,
                "sampling_params": sampling,
                "model": self.model_name,
            }
            for ids, _ in prompts
        ]
        response = JSONResponse(items[0] if endpoint == CHAT else items)
        if body.ignored_fields:
            response.headers[IGNORED_HEADER] = ", ".join(body.ignored_fields)
        return response

    def warn_ignored(self, names: tuple[str, ...], endpoint: str) -> None:
        """Log each ignored field name once (its first request), with the closest known
        field when one is close (a misspelling)."""
        for name in names:
            if name not in self.warned_fields:
                self.warned_fields.add(name)
                log.warning(
                    "kvstrata: requests to %s give the field %r, which kvstrata does not "
                    "know: ignored%s (named in %s; --strict-fields refuses it)",
                    endpoint,
                    name,
                    closest_field(name, endpoint),
                    IGNORED_HEADER,
                )

    async def answer(
        self,
        request: Request,
        jobs: list[Job],
        states: list[ChoiceState],
        head: ResponseHead,
        body: Body,
    ) -> Response:
        """Submit the choices and answer: an event stream once the first output comes,
        else the whole response (a 499 nobody reads when the client went away first)."""
        choices = Choices(self.engine, jobs, body.salt, lambda: self.stopping)
        ids = {job.request_id for job in jobs}
        self.active.update(ids)
        try:
            choices.start()
            if body.stream:
                first = await until_disconnect(request, choices.__anext__())
                if first[1].finish_reason == "abort":
                    raise aborted_error(first[1], self.stopping)
                events = sse_events(
                    choices, first, head, body, states, self.texts, lambda: self.stopping
                )
                return EventStream(events, choices, lambda: self.active.difference_update(ids))
            aborted = await until_disconnect(request, collect(choices, states))
        except ClientGone:
            self.finish(ids, choices)
            return Response(status_code=499)  # nobody reads it (nginx's "client closed")
        except (APIError, asyncio.CancelledError):
            self.finish(ids, choices)
            raise
        except Exception as exc:
            self.finish(ids, choices)
            raise engine_error(exc) from None
        if aborted is not None:  # the engine ended one choice: the others end too
            self.finish(ids, choices)
            raise aborted_error(aborted, self.stopping)
        self.active.difference_update(ids)
        return JSONResponse(self.response(head, states, body.n))

    def choice_tokens(self, job: Job, logprobs: Logprobs) -> ChoiceTokens | None:
        """What places a choice's tokens in its text (None: no logprobs asked for)."""
        if logprobs.top is None:
            return None
        p = job.params
        stop_ids = {*p.stop_token_ids, *(() if p.ignore_eos else self.engine.eos_ids)}
        return ChoiceTokens(self.engine.tokenizer, self.texts, job.prompt_ids, stop_ids)

    def jobs(self, body: Body, head_id: str, logprobs: Logprobs) -> list[Job]:
        """The request's choices, in vLLM's order (index = prompt * n + i), each checked
        by the engine before any is submitted. In a worker thread."""
        n = body.n
        split_documents(body)
        prompts, default_max = self.prompts(body, logprobs.echo)
        params = sampling_params(body, default_max, logprobs)
        check_work([len(ids) for ids, _ in prompts], n, params, logprobs, self.ceiling)
        # choices 1.. of a prompt wait for choice 0 to compute it, when it holds a full
        # block to share (a request scoring its prompt shares nothing: no lookup)
        share = n > 1 and params.prompt_logprobs is None
        jobs = []
        blend = self.documents(body, [ids for ids, _ in prompts], params)
        for p, (ids, text) in enumerate(prompts):
            after = p * n if share and 0 < self.block_size < len(ids) else None
            for i in range(n):
                index = p * n + i
                rid = head_id if len(prompts) * n == 1 else f"{head_id}-{index}"
                job = Job(index, p, rid, ids, choice_params(params, i), text, after if i else None)
                if blend is not None:
                    job.chunks, job.blend_recompute = blend[p], body.blend_recompute
                jobs.append(job)
        for job in jobs:
            self.engine.check(job.prompt_ids, job.params)
        return jobs

    def documents(
        self, body: Body, prompts: list[list[int]], params: SamplingParams
    ) -> list[Chunks] | None:
        """Each prompt as Chunks with the request's `documents` found in its tokens
        (None without documents); one-line 400s for what cannot blend."""
        if body.documents is None:
            return None
        refusal = self.engine.blend_refusal
        if refusal is not None:
            raise RequestRejected(refusal)
        if params.prompt_logprobs is not None:
            raise invalid(
                "documents",
                f"<{len(body.documents)} documents>",
                "omitted with prompt_logprobs (a blended prompt has no logits before its end)",
            )
        tokenizer = self.engine.tokenizer
        split = not self.trust_special_tokens
        doc_ids = [
            encode_text(tokenizer, d, split, add_special_tokens=False) for d in body.documents
        ]
        return [find_documents(ids, doc_ids) for ids in prompts]

    def prompts(self, body: Body, echo: bool) -> tuple[list[tuple[list[int], str]], int]:
        """The request's prompts as (token ids, the text echo puts in front), and the
        max_tokens of a request that gives none (chat: room_for). In a worker thread."""
        tokenizer = self.engine.tokenizer
        trust = self.trust_special_tokens
        if isinstance(body, ChatRequest):
            add_generation_prompt, template_kwargs = template_options(body, tokenizer)
            messages = chat_messages(body.messages)
            chars, bound = sum(len(m["content"]) for m in messages), self.limits.max_prompt_chars
            if bound is not None and chars > bound:
                raise invalid("messages", f"<{chars} chars>", too_long(chars, bound))
            ids = chat_prompt_ids(
                tokenizer, messages, add_generation_prompt, template_kwargs, trust
            )
            return [(ids, "")], self.room_for(ids)
        assert isinstance(body, CompletionRequest)
        prompts: list[tuple[list[int], str]] = []
        given = body.prompt
        check_choices(body.n, len(given))  # before tokenizing them all
        # a chat model's control tokens: only from token ids, unless callers are trusted
        split = not trust and bool(getattr(tokenizer, "chat_template", None))
        for prompt in given:
            if split and isinstance(prompt, str):
                ids = encode_text(tokenizer, prompt, True)
            else:
                ids = self.engine.encode(prompt)
            if isinstance(prompt, str):
                text = prompt
            elif echo and tokenizer is not None:
                text = prompt_text(tokenizer, ids)
            else:
                text = ""
            prompts.append((ids, text))
        return prompts, DEFAULT_COMPLETION_TOKENS

    def response(self, head: ResponseHead, states: list[ChoiceState], n: int) -> dict[str, Any]:
        """The whole (non-streamed) response of finished choices."""
        choices = []
        for state in states:
            assert state.final is not None
            lps, tokens = None, state.tokens  # (cut at a stop string by take)
            if state.pieces is not None:
                lps = (
                    chat_logprobs(tokens, self.texts) if head.chat else completion_logprobs(tokens)
                )
            text, reason = "".join(state.text), state.final.finish_reason
            choices.append(head.choice(state.job.index, text, reason, lps))
        return head.response(choices, usage_of(states, n))

    def finish(self, request_ids: set[str], choices: Choices) -> None:
        """Forget a request's choices and abort the ones not finished."""
        self.active.difference_update(request_ids)
        choices.abort()

    def room_for(self, prompt_ids: list[int]) -> int:
        """Chat's default max_tokens: the rest of the model's positions (as OpenAI and
        vLLM), at most CHAT_DEFAULT_MAX_TOKENS (each running request reserves its
        prompt + max_tokens, so "the whole context" would run chats one at a time),
        lowered to what all tiers together can hold for this prompt."""
        limit = self.engine.max_model_len or len(prompt_ids) + 4096
        room = min(max(1, limit - len(prompt_ids)), CHAT_DEFAULT_MAX_TOKENS)
        if self._fits(prompt_ids, room):
            return room
        lo, hi = 0, room  # lo fits (or is 0), hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self._fits(prompt_ids, mid) else (lo, mid)
        return max(lo, 1)  # 1 that does not fit: submit names the budget to raise

    def _fits(self, prompt_ids: list[int], max_tokens: int) -> bool:
        try:
            self.engine.check(prompt_ids, SamplingParams(max_tokens=max_tokens))
        except (RequestRejected, ConfigError):
            return False
        return True


def split_documents(body: Body) -> None:
    """`document_separator`: the text between two markers is a document; the markers
    go, the documents join `documents` (completions' text prompts, chat contents)."""
    sep = body.document_separator
    if sep is None:
        return
    docs: list[str] = []

    def split(text: str) -> str:
        pieces = text.split(sep)
        docs.extend(p for p in pieces[1:-1] if p)
        return "".join(pieces)

    if isinstance(body, ChatRequest):
        for message in body.messages:
            if isinstance(message.content, str):
                message.content = split(message.content)
    else:
        assert isinstance(body, CompletionRequest)
        if len(body.prompt) != 1 or not isinstance(body.prompt[0], str):
            raise invalid("document_separator", sep, "one text prompt (not token ids)")
        body.prompt = [split(p) for p in body.prompt]
    if not docs:
        raise invalid(
            "document_separator",
            sep,
            "a marker found around each document: text, <marker>document<marker>..., the question",
        )
    body.documents = docs
