"""The OpenAI request bodies as pydantic models (OpenAI's fields, vLLM's extensions),
parsed by pydantic-core's JSON parser (bounded nesting and numbers, strict Unicode), a
`ValidationError` worded as one OpenAI error (`parsing.body_error`: a 400 naming the
field, the value and what is accepted, from the field's type and constraints).

An unknown field is accepted and ignored, as vLLM does (routers and SDKs add fields of
their own): the request names what it ignored (`Request.ignored_fields`), and with
`strict_fields` it is refused instead, naming the closest known one. A field kvstrata
knows but does not implement is accepted only at its neutral value (`neutral`); a known
field with an invalid value is always a 400. Checks against the served model (token
ids, a prompt's length) read the validation context (`Limits`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

from kvstrata.engine.params import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_SEED
from kvstrata.server.errors import invalid

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MAX_N = 128  # choices per prompt at most (OpenAI's limit)
MAX_STOP_STRINGS = 64  # stop strings per request (each is looked for after every token)
MAX_STOP_CHARS = 1024  # characters per stop string (the stream holds back this many)
MAX_STOP_TOKEN_IDS = 1024
MAX_SALT_CHARS = 256  # a tenant name, not a payload


@dataclass(frozen=True)
class Limits:
    """The validation context: `vocab_size` (0: unknown, token ids unchecked),
    `max_prompt_chars`, the longest prompt string that can fit the model (None: any),
    and `strict_fields` (an unknown field is a 400, not ignored)."""

    vocab_size: int = 0
    max_prompt_chars: int | None = None
    strict_fields: bool = False


def _refuse(
    accepted: str, param: str | None = None, kind: str = "invalid_value", **value: Any
) -> Exception:
    """A validator's refusal: `accepted` says what is; `param` names the value when it
    is deeper than the field (prompt[1][3], or [1].type after it), `value=` gives it."""
    return PydanticCustomError(kind, "{accepted}", {"accepted": accepted, "param": param, **value})


def _limits(info: ValidationInfo) -> Limits:
    return info.context if isinstance(info.context, Limits) else Limits()


def neutral(accepted: str, ok: Callable[[Any], bool] = lambda value: value is None) -> Any:
    """A field kvstrata lacks: accepted at its neutral value only (`ok`, default null)."""

    def check(value: Any) -> Any:
        if not ok(value):
            raise _refuse(accepted, kind="unsupported_value")
        return value

    return Annotated[Any, AfterValidator(check)]


def _empty(value: Any) -> bool:
    return value is None or value in ("", [], {})


Ignored = Any  # a field that changes nothing here, whatever its value
NoTools = neutral("not supported (tool calls and audio are not implemented)", _empty)
Penalty = Annotated[float | None, Field(ge=-2, le=2)]
Salt = Annotated[str | None, Field(min_length=1, max_length=MAX_SALT_CHARS)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


def _listed(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def _off(value: Any) -> bool:
    return value is None or value is False


Off = neutral("false or null (not implemented)", _off)  # routers send these at false


class StreamOptions(_Body):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class Request(_Body):
    """The fields both endpoints take (top_k, min_p, repetition_penalty, min_tokens,
    stop_token_ids, ignore_eos, skip_special_tokens, salt / cache_salt: vLLM's)."""

    model: str | None = None
    n: int | None = Field(None, ge=1, le=MAX_N)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    salt: Salt = None
    cache_salt: Salt = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # -1, 0: off
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: Annotated[
        Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None,
        BeforeValidator(_listed),
        Field(
            description=f"a string or a list of at most {MAX_STOP_STRINGS} strings of 1 to "
            f"{MAX_STOP_CHARS} characters"
        ),
    ] = None
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool | None = None
    frequency_penalty: Penalty = None
    presence_penalty: Penalty = None
    repetition_penalty: float | None = Field(None, gt=0, le=100)  # 1: off
    min_p: float | None = Field(None, ge=0, le=1)
    min_tokens: int | None = Field(None, ge=0)
    logit_bias: dict[str, Any] | None = None
    skip_special_tokens: neutral(  # type: ignore[valid-type]
        "true (special tokens are always left out of the text)", lambda v: v is None or v is True
    ) = None
    spaces_between_special_tokens: Ignored = None  # special tokens are never in the text
    metadata: Ignored = None
    store: Ignored = None
    service_tier: Ignored = None
    parallel_tool_calls: Ignored = None
    # what routers add to every request (vllm-router, sglang-router): no model served
    # here reasons, so there is no reasoning text to include, separate or stream
    include_reasoning: bool | None = None
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None
    no_stop_trim: Off = None  # type: ignore[valid-type]
    continue_final_message: Off = None  # type: ignore[valid-type]
    return_hidden_states: Off = None  # type: ignore[valid-type]
    # kvstrata's own: texts in the prompt whose KV is reused wherever they sit, and the
    # share of their tokens recomputed in context (docs/blend.md)
    documents: list[Annotated[str, Field(min_length=1)]] | None = Field(None, min_length=1)
    blend_recompute: float | None = Field(None, ge=0, le=1)
    document_separator: str | None = Field(None, min_length=1)  # marks documents instead
    _ignored: tuple[str, ...] = PrivateAttr(default=())

    @property
    def ignored_fields(self) -> tuple[str, ...]:
        """The unknown fields this request gave and kvstrata ignored, as the request
        spells them (messages[0].name)."""
        return self._ignored

    def check_together(self) -> None:
        """The checks between fields; salt takes vLLM's name for it, cache_salt (a client
        moving between the two servers keeps its tenants apart), n its default."""
        if self.stream_options is not None and not self.stream:
            value = self.stream_options.model_dump()
            raise invalid("stream_options", value, "only allowed when stream is true")
        if self.salt is None:
            self.salt = self.cache_salt
        elif self.cache_salt not in (None, self.salt):
            raise invalid(
                "cache_salt", self.cache_salt, "the same tenant as salt, or give one of them"
            )
        self.n = self.n or 1
        if self.document_separator is not None and self.documents is not None:
            raise invalid(
                "document_separator", self.document_separator, "omitted when documents are given"
            )
        if self.blend_recompute is not None and self.documents is self.document_separator is None:
            raise invalid(
                "blend_recompute", self.blend_recompute, "omitted unless documents are given"
            )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's continuous_usage_stats: with include_usage, each chunk's usage so far."""
        options = self.stream_options
        return bool(options and options.include_usage and options.continuous_usage_stats)

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int | None, info: ValidationInfo) -> int | None:
        vocab = _limits(info).vocab_size
        if value is not None and vocab and value > vocab:
            raise _refuse(f"a whole number from -1 to the vocabulary size {vocab} (-1, 0: off)")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, value: list[int] | None, info: ValidationInfo) -> list[int] | None:
        vocab = _limits(info).vocab_size
        for i, token in enumerate(value or ()):
            if token < 0 or (vocab and token >= vocab):
                raise _refuse(_token_ids(vocab), f"stop_token_ids[{i}]", value=token)
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, Any] | None, info: ValidationInfo) -> Any:
        if value is None:
            return None
        if len(value) > MAX_LOGIT_BIAS:
            raise _refuse(
                f"at most {MAX_LOGIT_BIAS} entries (OpenAI's limit), not {len(value)} entries"
            )
        vocab = _limits(info).vocab_size
        out = {}
        for key, bias in value.items():
            where = f"logit_bias[{key!r}]"
            token = int(key) if key.isascii() and key.isdigit() and len(key) < 12 else -1
            if token < 0 or (vocab and token >= vocab):
                raise _refuse(f"keys are {_token_ids(vocab)} written as strings", where, value=bias)
            number = not isinstance(bias, bool) and isinstance(bias, (int, float))
            if not number or not -100 <= bias <= 100:
                raise _refuse("a bias from -100 to 100", where, value=bias)
            out[token] = float(bias)
        return out


def _token_ids(vocab: int) -> str:
    return f"token ids in [0, {vocab})" if vocab else "token ids >= 0"


def _prompt(value: Any, info: ValidationInfo) -> list[str | list[int]]:
    """`prompt`: a string, a list of token ids, or a list of several of either, as a
    list of prompts; token ids in the vocabulary, strings no longer than can fit."""
    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        return [_one_prompt(p, f"prompt[{i}]", info) for i, p in enumerate(value)]
    return [_one_prompt(value, "prompt", info)]


def _one_prompt(prompt: Any, where: str, info: ValidationInfo) -> str | list[int]:
    limits = _limits(info)
    if prompt is None:
        raise _refuse("a string or a list of token ids (required)", where, value=None)
    if isinstance(prompt, str):
        if not prompt:
            raise _refuse("a non-empty string", where, value=prompt)
        bound = limits.max_prompt_chars
        if bound is not None and len(prompt) > bound:
            raise _refuse(too_long(len(prompt), bound), where, value=f"<{len(prompt)} chars>")
        return prompt
    if not isinstance(prompt, list) or not prompt:
        raise _refuse(
            "a non-empty string or list of token ids, or a list of those", where, value=prompt
        )
    vocab = limits.vocab_size
    for i, token in enumerate(prompt):
        if type(token) is not int or token < 0 or (vocab and token >= vocab):
            raise _refuse(f"a token id in [0, {vocab})", f"{where}[{i}]", value=token)
    return prompt


def too_long(chars: int, bound: int) -> str:
    return (
        f"{chars:,} characters: at most {bound:,} fit the model (its positions x its longest "
        "token in characters); shorten it"
    )


class CompletionRequest(Request):
    prompt: Annotated[Any, AfterValidator(_prompt)] = Field(None, validate_default=True)
    echo: bool | None = None
    logprobs: Annotated[int | None, BeforeValidator(lambda v: None if v is False else v)] = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description=f"a whole number from 0 to {MAX_LOGPROBS}: the most likely tokens listed "
        "per token (or null); chat takes logprobs: true with top_logprobs",
    )
    best_of: neutral(  # type: ignore[valid-type]
        "1 (best_of is not supported: use n)", lambda v: v is None or (type(v) is int and v == 1)
    ) = None
    suffix: neutral("null (suffix / insertion is not supported)", _empty) = None  # type: ignore[valid-type]


def _content(value: Any) -> str:
    """A message's content as text: text parts ({"type": "text", "text"}) joined with
    newlines."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _refuse("a string or a list of text parts")
    texts = []
    for j, part in enumerate(value):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else part
            raise _refuse(
                "'text' (only text content is supported)",
                f"[{j}].type",
                "unsupported_value",
                value=kind,
            )
        if not isinstance(part.get("text"), str):
            raise _refuse("a string", f"[{j}].text", value=part.get("text"))
        texts.append(part["text"])
    return "\n".join(texts)


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[Any, AfterValidator(_content)] = Field(None, validate_default=True)
    name: str | None = None
    tool_calls: NoTools = None
    tool_call_id: NoTools = None
    function_call: NoTools = None
    audio: NoTools = None
    refusal: NoTools = None


class ChatRequest(Request):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    prediction: neutral("null (predicted outputs are not supported)") = None  # type: ignore[valid-type]
    modalities: neutral(  # type: ignore[valid-type]
        "['text'] or null (only text is generated)", lambda v: v is None or v == ["text"]
    ) = None
    audio: neutral("null (only text is generated)") = None  # type: ignore[valid-type]
    tools: neutral("null (tool calling is not supported)", _empty) = None  # type: ignore[valid-type]
    tool_choice: neutral(  # type: ignore[valid-type]
        "null or 'none' (tool calling is not supported)", lambda v: v in (None, "none", "auto")
    ) = None
    response_format: neutral(  # type: ignore[valid-type]
        "null or {'type': 'text'} (structured output is not supported)",
        lambda v: v is None or v == {"type": "text"},
    ) = None
    reasoning_effort: neutral("null (not a reasoning model)") = None  # type: ignore[valid-type]


REQUESTS = {COMPLETIONS: CompletionRequest, CHAT: ChatRequest}
_INNER = {"messages": Message, "stream_options": StreamOptions}  # field -> its items' model
