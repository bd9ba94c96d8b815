"""What a parsed request (`server.protocol`) asks that needs several fields at once: the
common fields, the logprobs, the sampling fields as `SamplingParams` and the work against
the server's ceiling; each refusal a one-line 400 naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from kvstrata.core.errors import ConfigError
from kvstrata.engine.params import MAX_SEED, SamplingParams
from kvstrata.server.errors import APIError, field_of, invalid
from kvstrata.server.protocol import ChatRequest, Request

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default
MAX_CHOICES = 256  # choices per request at most: prompts x n (each an engine request)
LOGPROB_ENTRIES_PER_TOKEN = 4  # logprob entries a request may ask for per ceiling token

# the SamplingParams fields a request field of the same name feeds
_SAMPLING_FIELDS = [f.name for f in fields(SamplingParams) if f.name in Request.model_fields]


@dataclass(frozen=True)
class CommonFields:
    """What both endpoints read besides the prompt and the sampling fields."""

    model: str | None
    stream: bool
    include_usage: bool
    salt: str | None
    n: int = 1
    continuous_usage: bool = False  # a running `usage` on every chunk (vLLM's option)


def check_fields(body: Request) -> CommonFields:
    """The common fields with their defaults, and the checks between them."""
    stream = bool(body.stream)
    options = body.stream_options
    if options is not None and not stream:
        raise invalid("stream_options", options.model_dump(), "only allowed when stream is true")
    include_usage = bool(options and options.include_usage)
    # vLLM's: with include_usage, every chunk carries its choice's usage so far
    continuous = include_usage and bool(options and options.continuous_usage_stats)
    # the tenant salt: "salt", or "cache_salt" as vLLM names it (a client moving between
    # the two servers keeps its tenants apart)
    salt, cache_salt = body.salt, body.cache_salt
    if salt is not None and cache_salt is not None and salt != cache_salt:
        raise invalid("cache_salt", cache_salt, "the same tenant as salt, or give one of them")
    salt = salt if salt is not None else cache_salt
    return CommonFields(body.model, stream, include_usage, salt, body.n or 1, continuous)


def check_choices(n: int, num_prompts: int) -> None:
    """A 400 when prompts x n passes MAX_CHOICES (each choice is an engine request)."""
    if n * num_prompts > MAX_CHOICES:
        raise invalid(
            "n",
            n,
            f"n x prompts at most {MAX_CHOICES} per request ({num_prompts} prompts x n={n} = "
            f"{n * num_prompts}): send fewer prompts per request, or a lower n",
        )


@dataclass(frozen=True)
class Logprobs:
    """What a request asks of logprobs: `top` most likely tokens per token (None: no
    logprobs), `echo`: the prompt goes in front of the text (completions), with its
    tokens' logprobs when `top` is set."""

    top: int | None = None
    echo: bool = False


def logprobs_request(body: Request) -> Logprobs:
    """The request's logprobs / top_logprobs (chat) and echo (completions)."""
    if not isinstance(body, ChatRequest):
        return Logprobs(body.logprobs, bool(body.echo))  # type: ignore[attr-defined]
    top = body.top_logprobs
    if top and not body.logprobs:
        raise invalid("top_logprobs", top, "only with logprobs: true (or leave it out)")
    return Logprobs((top or 0) if body.logprobs else None)


def check_work(
    prompt_lengths: list[int], n: int, params: SamplingParams, logprobs: Logprobs, ceiling: int
) -> None:
    """A 400 with the numbers when the request asks for more than `ceiling` tokens of
    work (every choice's prompt + max_tokens), or for more logprob entries than
    LOGPROB_ENTRIES_PER_TOKEN x ceiling (scored tokens x (top + 1))."""
    tokens = sum((length + params.max_tokens) * n for length in prompt_lengths)
    if tokens > ceiling:
        raise APIError(
            400,
            f"the request asks for {tokens:,} tokens of work ({len(prompt_lengths)} prompts "
            f"of {sum(prompt_lengths):,} tokens together + max_tokens {params.max_tokens}, "
            f"x n={n}); this server takes at most {ceiling:,} per request "
            "(--max-request-tokens): lower n or max_tokens, or split the request",
            param="n" if n > 1 else "max_tokens",
            code="request_too_large",
        )
    if logprobs.top is None:
        return
    scored = sum((length if logprobs.echo else 0) + params.max_tokens for length in prompt_lengths)
    entries = scored * n * (logprobs.top + 1)
    if entries > ceiling * LOGPROB_ENTRIES_PER_TOKEN:
        raise APIError(
            400,
            f"the request asks for {entries:,} logprob entries ({scored * n:,} tokens x "
            f"(logprobs {logprobs.top} + 1), n={n}); this server returns at most "
            f"{ceiling * LOGPROB_ENTRIES_PER_TOKEN:,} per request: lower logprobs, n or "
            "max_tokens",
            param="logprobs",
            code="request_too_large",
        )


def sampling_params(
    body: Request,
    default_max_tokens: int,
    logprobs: Logprobs | None = None,
) -> SamplingParams:
    """The request's SamplingParams (OpenAI defaults: temperature 1, top_p 1; max_tokens
    `default_max_tokens`); a 400 naming the request field otherwise."""
    logprobs = logprobs or Logprobs()
    source = _field_sources(body)
    kwargs: dict[str, Any] = {"max_tokens": default_max_tokens, "temperature": DEFAULT_TEMPERATURE}
    for field, name in source.items():
        value = getattr(body, name)
        if value is not None:
            kwargs[field] = value
    if kwargs.get("top_k") == -1:
        kwargs["top_k"] = 0  # vLLM's "no top-k"
    max_tokens = kwargs["max_tokens"]
    # max_tokens 0 (echo only): the prompt alone, computed (its cached prefix reused)
    # and nothing generated; scored only when logprobs asks for its tokens' logprobs
    if max_tokens == 0 and not logprobs.echo:
        raise invalid(
            source["max_tokens"],
            max_tokens,
            "a whole number >= 1 (0 only with echo: true on /v1/completions, "
            "to return the prompt and generate nothing)",
        )
    kwargs["logprobs"] = logprobs.top
    if logprobs.echo and logprobs.top is not None:
        kwargs["prompt_logprobs"] = logprobs.top
    try:
        return SamplingParams(**kwargs)
    except ConfigError as exc:
        message = str(exc)
        field = field_of(message)
        name = source.get(field or "", field)
        if field and name != field:
            message = name + message[len(field) :]
        raise APIError(400, message, param=name, code="invalid_value") from None


def _field_sources(body: Request) -> dict[str, str]:
    """SamplingParams field -> the request field that feeds it: chat's
    max_completion_tokens, when given, feeds max_tokens (a different max_tokens
    beside it is a 400)."""
    source = {name: name for name in _SAMPLING_FIELDS}
    given = getattr(body, "max_completion_tokens", None)
    if given is not None:
        if body.max_tokens is not None and body.max_tokens != given:
            raise invalid(
                "max_tokens",
                body.max_tokens,
                f"the same as max_completion_tokens ({given!r}), or give only one of them",
            )
        source["max_tokens"] = "max_completion_tokens"
    return source


def choice_params(params: SamplingParams, i: int) -> SamplingParams:
    """The params of choice i of a prompt: with a seed, seed + i (vLLM's rule), so the
    choices differ and each is reproducible."""
    if i == 0 or params.seed is None:
        return params
    return replace(params, seed=(params.seed + i) % (MAX_SEED + 1))
