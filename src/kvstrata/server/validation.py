"""What a parsed request (`server.protocol`) asks of the engine, checked across its
fields: the logprobs, the sampling fields as `SamplingParams`, the choices and the work
against the server's ceiling; each refusal a one-line 400 naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from kvstrata.engine.params import MAX_SEED, SamplingParams
from kvstrata.server.errors import APIError, invalid
from kvstrata.server.protocol import ChatRequest, Request

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default
MAX_CHOICES = 256  # choices per request at most: prompts x n (each an engine request)
LOGPROB_ENTRIES_PER_TOKEN = 4  # logprob entries a request may ask for per ceiling token

# the SamplingParams fields a request field of the same name feeds
_SAMPLING_FIELDS = [f.name for f in fields(SamplingParams) if f.name in Request.model_fields]


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


def sampling_params(body: Request, default_max_tokens: int, logprobs: Logprobs) -> SamplingParams:
    """The request's SamplingParams (OpenAI defaults: temperature 1, top_p 1; max_tokens
    `default_max_tokens`, or chat's max_completion_tokens); a 400 naming the field."""
    kwargs: dict[str, Any] = {"max_tokens": default_max_tokens, "temperature": DEFAULT_TEMPERATURE}
    for name in _SAMPLING_FIELDS:
        if getattr(body, name) is not None:
            kwargs[name] = getattr(body, name)
    field, given = "max_tokens", getattr(body, "max_completion_tokens", None)
    if given is not None:  # chat's newer name for max_tokens
        if body.max_tokens not in (None, given):
            raise invalid(
                field,
                body.max_tokens,
                f"the same as max_completion_tokens ({given!r}), or give only one of them",
            )
        kwargs["max_tokens"], field = given, "max_completion_tokens"
    if kwargs.get("top_k") == -1:
        kwargs["top_k"] = 0  # vLLM's "no top-k"
    # max_tokens 0 (echo only): the prompt alone, computed (its cached prefix reused)
    # and nothing generated; scored only when logprobs asks for its tokens' logprobs
    if kwargs["max_tokens"] == 0 and not logprobs.echo:
        raise invalid(
            field,
            0,
            "a whole number >= 1 (0 only with echo: true on /v1/completions, "
            "to return the prompt and generate nothing)",
        )
    kwargs["logprobs"] = logprobs.top
    if logprobs.echo and logprobs.top is not None:
        kwargs["prompt_logprobs"] = logprobs.top
    return SamplingParams(**kwargs)  # a ConfigError: min_tokens past max_tokens


def choice_params(params: SamplingParams, i: int) -> SamplingParams:
    """The params of choice i of a prompt: with a seed, seed + i (vLLM's rule), so the
    choices differ and each is reproducible."""
    if i == 0 or params.seed is None:
        return params
    return replace(params, seed=(params.seed + i) % (MAX_SEED + 1))
