"""The OpenAI wire format, without HTTP: request bodies checked field by field into a
prompt and `SamplingParams`, and the response / stream-chunk objects built from the
engine's `RequestOutput`s.

Every refusal is an `APIError` carrying the HTTP status and the OpenAI error object
`{"error": {"message", "type", "param", "code"}}`; its message is one line naming the
field, the value and what is accepted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvstrata.engine.params import RequestOutput, SamplingParams
from kvstrata.errors import ConfigError

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default

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
)
# Fields read by both endpoints (top_k, salt, stop_token_ids, ignore_eos: extensions,
# named as vLLM names them).
_COMMON = frozenset({*_SAMPLING_FIELDS, "model", "n", "stream", "stream_options", "user", "salt"})
SUPPORTED = {
    COMPLETIONS: _COMMON | {"prompt"},
    CHAT: _COMMON | {"messages", "max_completion_tokens"},
}


def _is_null(value: Any) -> bool:
    return value is None


def _is_false(value: Any) -> bool:
    return value is None or value is False


def _is_zero(value: Any) -> bool:
    return value is None or (not isinstance(value, bool) and value in (0, 0.0))


def _is_one(value: Any) -> bool:
    return value is None or (not isinstance(value, bool) and value == 1)


def _is_empty(value: Any) -> bool:
    return value is None or value in ("", [], {})


# OpenAI fields kvstrata does not implement: accepted only at their neutral value, so a
# client that sends the defaults works and one that relies on the feature is told.
_NEUTRAL: dict[str, tuple[Callable[[Any], bool], str]] = {
    "frequency_penalty": (_is_zero, "0 (penalties are not implemented)"),
    "presence_penalty": (_is_zero, "0 (penalties are not implemented)"),
    "logit_bias": (_is_empty, "null (logit_bias is not implemented)"),
}
NEUTRAL = {
    COMPLETIONS: {
        **_NEUTRAL,
        "echo": (_is_false, "false (echo is not supported: prepend the prompt yourself)"),
        "best_of": (_is_one, "1 (best_of is not supported)"),
        "logprobs": (_is_null, "null (logprobs are not supported)"),
        "suffix": (_is_empty, "null (suffix / insertion is not supported)"),
    },
    CHAT: {
        **_NEUTRAL,
        "logprobs": (_is_false, "false (logprobs are not supported)"),
        "top_logprobs": (_is_zero, "null (logprobs are not supported)"),
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
# Fields that change nothing about generation here; accepted whatever their value.
IGNORED = frozenset({"metadata", "store", "service_tier", "parallel_tool_calls"})

_FIELD_OF_MESSAGE = re.compile(r"^([A-Za-z_][A-Za-z0-9_.\[\]]*)=")


class APIError(Exception):
    """A request the server answers with an OpenAI error object and `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        message = " ".join(str(message).split())  # one line, always
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The OpenAI error object."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def field_of(message: str) -> str | None:
    """The field a kvstrata one-line error names (`<field>=<value> is invalid: ...`)."""
    match = _FIELD_OF_MESSAGE.match(message)
    return match.group(1) if match else None


def invalid(field: str, value: Any, accepted: str, code: str = "invalid_value") -> APIError:
    """A 400 naming `field`, its value and what is accepted (ConfigError's wording)."""
    return APIError(400, str(ConfigError.field(field, value, accepted)), param=field, code=code)


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


def check_fields(body: Mapping[str, Any], endpoint: str) -> CommonFields:
    """Refuse unknown fields, unsupported features and bad shapes of the common fields.

    Args:
        body: The request object.
        endpoint: COMPLETIONS or CHAT.

    Returns:
        The model asked for, whether to stream, whether to send a usage chunk, the salt.
    """
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
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("model", model, "a model name (GET /v1/models lists them)")
    if not _is_one(body.get("n")):
        raise invalid(
            "n", body["n"], "1: one choice per request here; send several requests instead"
        )
    stream = body.get("stream")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise invalid("stream", stream, "true or false")
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise invalid("stream_options", options, "only allowed when stream is true")
        if not isinstance(options, dict):
            raise invalid("stream_options", options, "an object such as {'include_usage': true}")
        for key, value in options.items():
            if key not in ("include_usage", "continuous_usage_stats"):
                raise invalid(f"stream_options.{key}", value, "known: include_usage")
            if value is not None and not isinstance(value, bool):
                raise invalid(f"stream_options.{key}", value, "true or false")
        include_usage = bool(options.get("include_usage"))
    for name in ("user", "salt"):
        value = body.get(name)
        if value is not None and not isinstance(value, str):
            raise invalid(name, value, "a string")
    salt = body.get("salt")
    if salt == "":
        raise invalid("salt", salt, "a non-empty tenant name, or leave it out")
    return CommonFields(model, stream, include_usage, salt)


def completion_prompt(body: Mapping[str, Any], vocab_size: int) -> str | list[int]:
    """The `prompt` of a completion request: a string or a list of token ids (a list
    holding exactly one of those is accepted too)."""
    if "prompt" not in body or body["prompt"] is None:
        raise invalid("prompt", None, "a string or a list of token ids (required)")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("prompt", prompt, "a non-empty string")
        return prompt
    if not isinstance(prompt, list) or not prompt:
        raise invalid("prompt", body["prompt"], "a non-empty string or list of token ids")
    if all(isinstance(p, (str, list)) for p in prompt):
        raise invalid(
            "prompt",
            f"a list of {len(prompt)} prompts",
            "one prompt per request here; send one request per prompt",
        )
    for i, token in enumerate(prompt):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise invalid(f"prompt[{i}]", token, f"a token id in [0, {vocab_size})")
    return list(prompt)


def sampling_params(
    body: Mapping[str, Any], endpoint: str, default_max_tokens: int
) -> SamplingParams:
    """SamplingParams from the request (OpenAI defaults: temperature 1, top_p 1).

    Args:
        body: The request object (already through check_fields).
        endpoint: COMPLETIONS or CHAT (chat reads max_completion_tokens too).
        default_max_tokens: max_tokens when the request gives none.

    Returns:
        The checked SamplingParams; a 400 naming the request field otherwise.
    """
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
    kwargs: dict[str, Any] = {"max_tokens": default_max_tokens, "temperature": DEFAULT_TEMPERATURE}
    for field, name in source.items():
        value = body.get(name)
        if value is not None:
            kwargs[field] = value
    if kwargs.get("top_k") == -1:
        kwargs["top_k"] = 0  # vLLM's "no top-k"
    try:
        return SamplingParams(**kwargs)
    except ConfigError as exc:
        message = str(exc)
        field = field_of(message)
        name = source.get(field or "", field)
        if field and name != field:
            message = name + message[len(field) :]
        raise APIError(400, message, param=name, code="invalid_value") from None


# -- responses ------------------------------------------------------------------------


def usage(final: RequestOutput) -> dict[str, Any]:
    """OpenAI `usage` from a finished request (cached = prompt tokens the prefix cache
    held, so they were not computed)."""
    return {
        "prompt_tokens": final.prompt_tokens,
        "completion_tokens": final.completion_tokens,
        "total_tokens": final.prompt_tokens + final.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": final.cached_tokens},
    }


@dataclass(frozen=True)
class ResponseHead:
    """The fields every response and chunk of one request repeats."""

    id: str
    created: int
    model: str

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def completion(self, text: str, finish_reason: str, final: RequestOutput) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._base("text_completion"), "choices": [choice], "usage": usage(final)}

    def chat(self, text: str, finish_reason: str, final: RequestOutput) -> dict[str, Any]:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        return {**self._base("chat.completion"), "choices": [choice], "usage": usage(final)}

    def completion_chunk(
        self, text: str, finish_reason: str | None, with_usage: bool
    ) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        chunk = {**self._base("text_completion"), "choices": [choice]}
        if with_usage:
            chunk["usage"] = None  # OpenAI: null on every chunk but the usage one
        return chunk

    def chat_chunk(
        self, delta: dict[str, Any], finish_reason: str | None, with_usage: bool
    ) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        chunk = {**self._base("chat.completion.chunk"), "choices": [choice]}
        if with_usage:
            chunk["usage"] = None
        return chunk

    def usage_chunk(self, chat: bool, final: RequestOutput) -> dict[str, Any]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        return {**self._base(obj), "choices": [], "usage": usage(final)}


def sse(data: Mapping[str, Any] | str) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


SSE_DONE = sse("[DONE]")
