"""Request bodies checked, without HTTP: the JSON body, the fields each endpoint
accepts (unknown ones and unsupported features refused, neutral values let through),
the prompts, the logprobs asked for, and the sampling fields into `SamplingParams`.

Every refusal is an `APIError` (a 400) whose one-line message names the field, the
value and what is accepted.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from kvstrata.core.errors import ConfigError
from kvstrata.engine.params import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_SEED, SamplingParams
from kvstrata.server.errors import APIError, field_of, invalid

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default
MAX_N = 128  # choices per prompt at most (OpenAI's limit)
MAX_CHOICES = 256  # choices per request at most: prompts x n (each an engine request)

# SamplingParams field -> the request field that feeds it (for messages and `param`).
_SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_p",
    "min_tokens",
)
# Fields read by both endpoints (top_k, salt / cache_salt, stop_token_ids, ignore_eos,
# repetition_penalty, min_p, min_tokens, skip_special_tokens: extensions, named as
# vLLM names them).
_COMMON = frozenset(
    {
        *_SAMPLING_FIELDS,
        "model",
        "n",
        "stream",
        "stream_options",
        "user",
        "salt",
        "cache_salt",
        "logit_bias",
        "logprobs",
    }
)
SUPPORTED = {
    COMPLETIONS: _COMMON | {"prompt", "echo"},
    CHAT: _COMMON
    | {
        "messages",
        "max_completion_tokens",
        "top_logprobs",
        "add_generation_prompt",
        "chat_template_kwargs",
    },
}


def _is_null(value: Any) -> bool:
    return value is None


def _is_one(value: Any) -> bool:
    return value is None or (not isinstance(value, bool) and value == 1)


def _is_empty(value: Any) -> bool:
    return value is None or value in ("", [], {})


# OpenAI / vLLM fields kvstrata does not implement: accepted only at their neutral
# value, so a client that sends the defaults works and one that relies on the feature
# is told.
_NEUTRAL: dict[str, tuple[Callable[[Any], bool], str]] = {
    "skip_special_tokens": (
        lambda v: v is None or v is True,
        "true (special tokens are always left out of the text)",
    ),
}
NEUTRAL = {
    COMPLETIONS: {
        **_NEUTRAL,
        "best_of": (_is_one, "1 (best_of is not supported: use n)"),
        "suffix": (_is_empty, "null (suffix / insertion is not supported)"),
    },
    CHAT: {
        **_NEUTRAL,
        "prediction": (_is_null, "null (predicted outputs are not supported)"),
        "modalities": (
            lambda v: v is None or v == ["text"],
            "['text'] or null (only text is generated)",
        ),
        "audio": (_is_null, "null (only text is generated)"),
        "tools": (_is_empty, "null (tool calling is not supported)"),
        "tool_choice": (
            lambda v: v in (None, "none", "auto"),
            "null or 'none' (tool calling is not supported)",
        ),
        "response_format": (
            lambda v: v is None or v == {"type": "text"},
            "null or {'type': 'text'} (structured output is not supported)",
        ),
        "reasoning_effort": (_is_null, "null (not a reasoning model)"),
    },
}
# Fields that change nothing about generation here; accepted whatever their value
# (spaces_between_special_tokens: special tokens are never in the text).
IGNORED = frozenset(
    {"metadata", "store", "service_tier", "parallel_tool_calls", "spaces_between_special_tokens"}
)


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 saying what is wrong with it."""
    try:
        body = json.loads(raw)
    except UnicodeDecodeError as exc:
        raise APIError(
            400, f"the request body is not UTF-8 JSON ({exc.reason})", code="invalid_json"
        ) from None
    except json.JSONDecodeError as exc:
        raise APIError(
            400,
            f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column "
            f"{exc.colno}",
            code="invalid_json",
        ) from None
    if not isinstance(body, dict):
        raise APIError(
            400,
            f"the request body must be a JSON object ({{...}}), not {_json_kind(body)}",
            code="invalid_json",
        )
    return body


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return "a string" if isinstance(value, str) else "an array"


@dataclass(frozen=True)
class CommonFields:
    """What both endpoints read besides the prompt and the sampling fields."""

    model: str | None
    stream: bool
    include_usage: bool
    salt: str | None
    n: int = 1
    continuous_usage: bool = False  # a running `usage` on every chunk (vLLM's option)


def check_fields(body: Mapping[str, Any], endpoint: str) -> CommonFields:
    """Refuse unknown fields, unsupported features and bad shapes of the common fields.

    Args:
        body: The request object.
        endpoint: COMPLETIONS or CHAT.

    Returns:
        The model asked for, whether to stream, whether to send a usage chunk (and a
        running usage on every chunk), the salt, n.
    """
    _check_names(body, endpoint)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("model", model, "a model name (GET /v1/models lists them)")
    n = body.get("n")
    if n is None:
        n = 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise invalid("n", n, f"a whole number of choices from 1 to {MAX_N}")
    stream = body.get("stream")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise invalid("stream", stream, "true or false")
    include_usage, continuous = _stream_options(body.get("stream_options"), stream)
    for name in ("user", "salt", "cache_salt"):
        value = body.get(name)
        if value is not None and not isinstance(value, str):
            raise invalid(name, value, "a string")
    # the tenant salt: "salt", or "cache_salt" as vLLM names it (a client moving between
    # the two servers keeps its tenants apart)
    salt, cache_salt = body.get("salt"), body.get("cache_salt")
    if salt is not None and cache_salt is not None and salt != cache_salt:
        raise invalid("cache_salt", cache_salt, "the same tenant as salt, or give one of them")
    name, salt = ("salt", salt) if salt is not None else ("cache_salt", cache_salt)
    if salt == "":
        raise invalid(name, salt, "a non-empty tenant name, or leave it out")
    return CommonFields(model, stream, include_usage, salt, n, continuous)


def _check_names(body: Mapping[str, Any], endpoint: str) -> None:
    """Refuse a field the endpoint does not know, or an unsupported one (NEUTRAL) at
    another value than its neutral one; IGNORED ones pass."""
    supported, neutral = SUPPORTED[endpoint], NEUTRAL[endpoint]
    for name, value in body.items():
        if name in supported or name in IGNORED:
            continue
        if name in neutral:
            ok, accepted = neutral[name]
            if not ok(value):
                raise invalid(name, value, accepted, code="unsupported_value")
            continue
        known = sorted(supported | set(neutral))
        raise APIError(
            400,
            f"{ConfigError.unknown(str(name), value, known)} (endpoint {endpoint})",
            param=str(name),
            code="unknown_parameter",
        )


def _stream_options(options: Any, stream: bool) -> tuple[bool, bool]:
    """`stream_options` checked: whether to send a usage chunk, and a running usage on
    every chunk (both false when it is left out)."""
    if options is None:
        return False, False
    if not stream:
        raise invalid("stream_options", options, "only allowed when stream is true")
    if not isinstance(options, dict):
        raise invalid("stream_options", options, "an object such as {'include_usage': true}")
    for key, value in options.items():
        if key not in ("include_usage", "continuous_usage_stats"):
            raise invalid(
                f"stream_options.{key}", value, "known: include_usage, continuous_usage_stats"
            )
        if value is not None and not isinstance(value, bool):
            raise invalid(f"stream_options.{key}", value, "true or false")
    include_usage = bool(options.get("include_usage"))
    # vLLM's: with include_usage, every chunk carries its choice's usage so far
    continuous = include_usage and bool(options.get("continuous_usage_stats"))
    return include_usage, continuous


def completion_prompts(body: Mapping[str, Any], vocab_size: int) -> list[str | list[int]]:
    """The `prompt` of a completion request as a list of prompts: a string, a list of
    token ids, or a list of several of either (one choice per prompt and n, in order).
    """
    if "prompt" not in body or body["prompt"] is None:
        raise invalid("prompt", None, "a string or a list of token ids (required)")
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return [_one_prompt(p, f"prompt[{i}]", vocab_size) for i, p in enumerate(prompt)]
    return [_one_prompt(prompt, "prompt", vocab_size)]


def _one_prompt(prompt: Any, where: str, vocab_size: int) -> str | list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise invalid(where, prompt, "a non-empty string")
        return prompt
    if not isinstance(prompt, list) or not prompt:
        raise invalid(where, prompt, "a non-empty string or list of token ids, or a list of those")
    for i, token in enumerate(prompt):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise invalid(f"{where}[{i}]", token, f"a token id in [0, {vocab_size})")
    return list(prompt)


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


def logprobs_request(body: Mapping[str, Any], endpoint: str) -> Logprobs:
    """The request's logprobs / top_logprobs (chat) and echo (completions), checked."""
    accepted = f"a whole number from 0 to {MAX_LOGPROBS}"
    if endpoint == COMPLETIONS:
        echo = body.get("echo")
        if echo is not None and not isinstance(echo, bool):
            raise invalid("echo", echo, "true or false")
        top = body.get("logprobs")
        if top is False:
            top = None
        if top is not None and (
            isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_LOGPROBS
        ):
            raise invalid(
                "logprobs",
                top,
                f"{accepted}: the most likely tokens listed per token (or null); "
                "chat takes logprobs: true with top_logprobs",
            )
        return Logprobs(top, bool(echo))
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise invalid("logprobs", wanted, "true or false (top_logprobs: how many per token)")
    top = body.get("top_logprobs")
    if top is not None and (
        isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_LOGPROBS
    ):
        raise invalid("top_logprobs", top, f"{accepted} (or null)")
    if top and not wanted:
        raise invalid("top_logprobs", top, "only with logprobs: true (or leave it out)")
    return Logprobs((top or 0) if wanted else None)


def logit_bias(body: Mapping[str, Any], vocab_size: int) -> dict[int, float]:
    """`logit_bias` ({"token id": bias in [-100, 100]}, at most MAX_LOGIT_BIAS entries)
    with int keys; a 400 naming the bad key (or the count) otherwise."""
    value = body.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid("logit_bias", value, "an object {token id: bias in [-100, 100]}")
    if len(value) > MAX_LOGIT_BIAS:
        raise APIError(
            400,
            f"logit_bias has {len(value)} entries: at most {MAX_LOGIT_BIAS} are accepted "
            "(OpenAI's limit)",
            param="logit_bias",
            code="invalid_value",
        )
    out = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            token = -1
        if not 0 <= token < vocab_size:
            raise invalid(
                f"logit_bias[{key!r}]",
                bias,
                f"keys are token ids in [0, {vocab_size}) written as strings",
            )
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise invalid(f"logit_bias[{key!r}]", bias, "a bias from -100 to 100")
        out[token] = float(bias)
    return out


def sampling_params(
    body: Mapping[str, Any],
    endpoint: str,
    default_max_tokens: int,
    logprobs: Logprobs | None = None,
    bias: Mapping[int, float] | None = None,
) -> SamplingParams:
    """SamplingParams from the request (OpenAI defaults: temperature 1, top_p 1).

    Args:
        body: The request object (already through check_fields).
        endpoint: COMPLETIONS or CHAT (chat reads max_completion_tokens too).
        default_max_tokens: max_tokens when the request gives none.
        logprobs: from logprobs_request (None: none asked for).
        bias: from logit_bias.

    Returns:
        The checked SamplingParams; a 400 naming the request field otherwise.
    """
    logprobs = logprobs or Logprobs()
    source = _field_sources(body, endpoint)
    kwargs: dict[str, Any] = {"max_tokens": default_max_tokens, "temperature": DEFAULT_TEMPERATURE}
    for field, name in source.items():
        value = body.get(name)
        if value is not None:
            kwargs[field] = value
    if kwargs.get("top_k") == -1:
        kwargs["top_k"] = 0  # vLLM's "no top-k"
    max_tokens = kwargs["max_tokens"]
    # max_tokens 0 (echo only): the prompt alone, computed (its cached prefix reused)
    # and nothing generated; scored only when logprobs asks for its tokens' logprobs
    if max_tokens == 0 and not isinstance(max_tokens, bool) and not logprobs.echo:
        raise invalid(
            source["max_tokens"],
            max_tokens,
            "a whole number >= 1 (0 only with echo: true on /v1/completions, "
            "to return the prompt and generate nothing)",
        )
    kwargs["logprobs"] = logprobs.top
    if logprobs.echo and logprobs.top is not None:
        kwargs["prompt_logprobs"] = logprobs.top
    if bias:
        kwargs["logit_bias"] = dict(bias)
    try:
        return SamplingParams(**kwargs)
    except ConfigError as exc:
        message = str(exc)
        field = field_of(message)
        name = source.get(field or "", field)
        if field and name != field:
            message = name + message[len(field) :]
        raise APIError(400, message, param=name, code="invalid_value") from None


def _field_sources(body: Mapping[str, Any], endpoint: str) -> dict[str, str]:
    """SamplingParams field -> the request field that feeds it: chat's
    max_completion_tokens, when given, feeds max_tokens (a different max_tokens
    beside it is a 400)."""
    source = {name: name for name in _SAMPLING_FIELDS}
    if endpoint == CHAT and body.get("max_completion_tokens") is not None:
        given = body.get("max_tokens")
        if given is not None and given != body["max_completion_tokens"]:
            raise invalid(
                "max_tokens",
                given,
                f"the same as max_completion_tokens ({body['max_completion_tokens']!r}), "
                "or give only one of them",
            )
        source["max_tokens"] = "max_completion_tokens"
    return source


def choice_params(params: SamplingParams, i: int) -> SamplingParams:
    """The params of choice i of a prompt: with a seed, seed + i (vLLM's rule), so the
    choices differ and each is reproducible."""
    if i == 0 or params.seed is None:
        return params
    return replace(params, seed=(params.seed + i) % (MAX_SEED + 1))
