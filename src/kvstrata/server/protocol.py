"""The OpenAI wire format, without HTTP: request bodies checked field by field into
prompts and `SamplingParams`, and the response / stream-chunk objects built from the
engine's `RequestOutput`s (choices, logprobs in OpenAI's two shapes, usage).

Every refusal is an `APIError` carrying the HTTP status and the OpenAI error object
`{"error": {"message", "type", "param", "code"}}`; its message is one line naming the
field, the value and what is accepted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from kvstrata.core.errors import ConfigError
from kvstrata.engine.params import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_SEED,
    RequestOutput,
    SamplingParams,
    TokenLogprobs,
)
from kvstrata.engine.sampling import LOGPROB_FLOOR, Detokenizer

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
# Fields read by both endpoints (top_k, salt, stop_token_ids, ignore_eos,
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
    include_usage = continuous = False
    options = body.get("stream_options")
    if options is not None:
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
    for name in ("user", "salt"):
        value = body.get(name)
        if value is not None and not isinstance(value, str):
            raise invalid(name, value, "a string")
    salt = body.get("salt")
    if salt == "":
        raise invalid("salt", salt, "a non-empty tenant name, or leave it out")
    return CommonFields(model, stream, include_usage, salt, n, continuous)


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


def choice_params(params: SamplingParams, i: int) -> SamplingParams:
    """The params of choice i of a prompt: with a seed, seed + i (vLLM's rule), so the
    choices differ and each is reproducible."""
    if i == 0 or params.seed is None:
        return params
    return replace(params, seed=(params.seed + i) % (MAX_SEED + 1))


# -- responses ------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI `usage` (cached = prompt tokens the prefix cache held, so they were not
    computed). With several choices per prompt, a prompt counts once and the
    completion tokens of every choice add up (as OpenAI counts)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


# bytes -> the printable characters byte-level BPE tokenizers (GPT-2's) spell them with
_BYTE_CHARS = [*range(33, 127), *range(161, 173), *range(174, 256)]
_CHAR_TO_BYTE = {
    chr(c): b
    for b, c in zip(
        [*_BYTE_CHARS, *(b for b in range(256) if b not in _BYTE_CHARS)],
        [*_BYTE_CHARS, *range(256, 256 + 256 - len(_BYTE_CHARS))],
        strict=True,
    )
}


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens


class TokenTexts:
    """Tokens decoded alone (cached per id): `token_id:<id>` without a tokenizer
    (vLLM's form), and each token's UTF-8 `bytes` for chat logprobs."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}
        self._raw: dict[int, list[int] | None] = {}

    def text(self, token_id: int) -> str:
        """The token decoded alone (special tokens included)."""
        text = self._text.get(token_id)
        if text is None:
            if self.tokenizer is None:
                text = f"token_id:{token_id}"
            else:
                text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._text[token_id] = text
        return text

    def raw(self, token_id: int) -> list[int] | None:
        """The bytes of a token that is part of a character (it decodes alone to
        U+FFFD): a byte-level BPE token's bytes, or a SentencePiece byte token's; None
        for any other token."""
        if token_id not in self._raw:
            raw = None
            if self.tokenizer is not None and "\ufffd" in self.text(token_id):
                piece = self.tokenizer.convert_ids_to_tokens(token_id)
                if isinstance(piece, str) and piece:
                    byte = _BYTE_FALLBACK.fullmatch(piece)
                    if byte is not None:
                        raw = [int(byte.group(1), 16)]
                    elif all(c in _CHAR_TO_BYTE for c in piece):
                        raw = [_CHAR_TO_BYTE[c] for c in piece]
            self._raw[token_id] = raw
        return self._raw[token_id]

    def bytes(self, token_id: int, piece: str | None = None, own: bool = False) -> list[int]:
        """The token's UTF-8 bytes: its raw bytes when it is part of a character, else
        its text in context when that is its own (`own`: no earlier token's waiting
        bytes in `piece`; SentencePiece keeps the word's leading space there), else its
        text decoded alone."""
        raw = self.raw(token_id)
        if raw is not None:
            return list(raw)
        if own and piece is not None and "\ufffd" not in piece:
            return list(piece.encode("utf-8"))
        return list(self.text(token_id).encode("utf-8"))


@dataclass
class TokenInfo:
    """One token of a choice's logprobs.

    token_id / logprob: the token and its logprobs (None: the first prompt token).
    text: what the token adds to the choice's text — the incremental detokenizer's
        piece (`Detokenizer`): empty for a token whose character a later token
        completes, for a special token the text leaves out, and past a stop string.
    offset: where `text` starts in the choice's text (echoed prompt + generated), so
        text[offset:offset + len(text)] == text; a token with no text gets the offset
        the text has reached there.
    piece: its text before a stop string cut it (chat `bytes`).
    own: `piece` is this token's alone (no earlier token's waiting bytes in it).
    top: the most likely tokens there, (id, text as the next token, logprob), most
        likely first.
    """

    token_id: int
    logprob: TokenLogprobs | None
    text: str
    offset: int
    piece: str = ""
    own: bool = True
    top: tuple[tuple[int, str, float], ...] = ()


class ChoiceTokens:
    """The TokenInfo of every token of one choice, as its outputs come (prompt first
    when echoed, then the generated tokens in order).

    The generated tokens are decoded as the engine decodes the output text (a
    `Detokenizer` with the prompt's last tokens as context; a stop token is never
    text), so their pieces join to the generated text (until a stop string: `clip`).
    The prompt's tokens are decoded alike and placed in the echoed text: a special
    token's text is its own name where the echoed text holds it, else (a BOS the
    tokenizer added) nothing, at the offset the text has reached."""

    def __init__(
        self, tokenizer: Any, texts: TokenTexts, prompt_ids: list[int], stop_ids: set[int]
    ) -> None:
        self.tokenizer = tokenizer
        self.texts = texts
        self.stop_ids = stop_ids
        self.out = Detokenizer(tokenizer, prompt_ids) if tokenizer is not None else None
        self.base = 0  # characters of echoed prompt in front of the generated text
        self.length = 0  # characters of the generated pieces so far

    def _top(self, detok: Detokenizer | None, lp: TokenLogprobs | None) -> tuple:
        if lp is None or not lp.top:
            return ()
        ids = [t for t, _ in lp.top]
        texts = [self.texts.text(t) for t in ids] if detok is None else detok.candidates(ids)
        return tuple((t, text, v) for (t, v), text in zip(lp.top, texts, strict=True))

    def prompt(
        self, prompt_ids: list[int], lps: list[TokenLogprobs | None], echo_text: str
    ) -> list[TokenInfo]:
        """The prompt's tokens, placed in `echo_text` (the text the choice starts with)."""
        self.base = len(echo_text)
        infos = []
        if self.tokenizer is None:  # no text to place them in: the ids' names, in a row
            self.base = 0
            for token, lp in zip(prompt_ids, lps, strict=True):
                text = self.texts.text(token)
                infos.append(TokenInfo(token, lp, text, self.base, text, True, self._top(None, lp)))
                self.base += len(text)
            return infos
        detok = Detokenizer(self.tokenizer)
        special = _special_ids(self.tokenizer)
        pos = 0
        for i, (token, lp) in enumerate(zip(prompt_ids, lps, strict=True)):
            top = self._top(detok, lp)
            own = not detok.pending
            piece = _prompt_piece(detok, self.texts, special, token, i == len(prompt_ids) - 1)
            text, offset = piece, min(pos, len(echo_text))
            if echo_text.startswith(piece, pos):
                pos += len(piece)
            elif token in special:  # added by the tokenizer, not in the text (a BOS)
                text = ""
            else:  # a text the tokenizer does not decode back to itself: best effort
                text = echo_text[offset : offset + len(piece)]
                pos += len(piece)
            infos.append(TokenInfo(token, lp, text, offset, piece, own, top))
        return infos

    def generated(self, out: RequestOutput) -> list[TokenInfo]:
        """The tokens of one output (their logprobs: out.logprobs)."""
        ids = out.token_ids
        lps: list[Any] = list(out.logprobs) if out.logprobs else [None] * len(ids)
        infos = []
        for i, (token, lp) in enumerate(zip(ids, lps, strict=True)):
            if self.out is None:
                piece, own, top = self.texts.text(token), True, self._top(None, lp)
            else:
                top = self._top(self.out, lp)
                own = not self.out.pending
                last = out.finished and i == len(ids) - 1
                if last and out.finish_reason == "stop" and token in self.stop_ids:
                    piece = ""  # a stop token ends the output: it is never text
                else:
                    piece = self.out.push([token])
                if last:
                    piece += self.out.flush()
            offset = self.base + self.length
            infos.append(TokenInfo(token, lp, piece, offset, piece, own, top))
            self.length += len(piece)
        return infos

    def clip(self, infos: list[TokenInfo], generated_chars: int) -> None:
        """Cut the tokens' text at the end of the returned text: `generated_chars`
        characters after the echoed prompt (a stop string cut the rest)."""
        if self.out is None:
            return
        end = self.base + generated_chars
        for info in infos:
            if info.offset + len(info.text) > end:
                info.text = info.text[: max(0, end - info.offset)]
                info.offset = min(info.offset, end)


def _special_ids(tokenizer: Any) -> set[int]:
    return set(getattr(tokenizer, "all_special_ids", None) or ())


def _prompt_piece(
    detok: Detokenizer, texts: TokenTexts, special: set[int], token: int, last: bool
) -> str:
    """A prompt token's text: a special token's name (the decode skips it, as the
    output's does), else what the token adds to the decode; the last one flushes."""
    piece = texts.text(token) if token in special else detok.push([token])
    return piece + detok.flush() if last else piece


def prompt_text(tokenizer: Any, prompt_ids: list[int]) -> str:
    """The text of a token-id prompt (echo): its tokens' texts joined, special tokens
    by name, as `ChoiceTokens.prompt` places them."""
    detok, texts, special = Detokenizer(tokenizer), TokenTexts(tokenizer), _special_ids(tokenizer)
    last = len(prompt_ids) - 1
    return "".join(
        _prompt_piece(detok, texts, special, t, i == last) for i, t in enumerate(prompt_ids)
    )


def _lp(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def completion_logprobs(tokens: list[TokenInfo]) -> dict[str, Any]:
    """The legacy completions `logprobs` object of some tokens. top_logprobs maps the
    text of the most likely tokens to their logprob, most likely first (a text two
    tokens share keeps the likelier), and always holds the chosen token (OpenAI: up to
    logprobs + 1 entries)."""
    out: dict[str, list[Any]] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for info in tokens:
        out["tokens"].append(info.text)
        out["text_offset"].append(info.offset)
        if info.logprob is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        chosen = _lp(info.logprob.logprob)
        out["token_logprobs"].append(chosen)
        top: dict[str, float] = {}
        for tid, text, value in info.top:
            top.setdefault(info.text if tid == info.token_id else text, _lp(value))
        top[info.text] = chosen
        out["top_logprobs"].append(top)
    return out


def chat_logprobs(tokens: list[TokenInfo], texts: TokenTexts) -> dict[str, Any]:
    """The chat `logprobs` object ({"content": [...]}) of some generated tokens: each
    token's text and logprob, its UTF-8 bytes, and exactly top_logprobs alternatives."""

    def entry(token_id: int, text: str, piece: str, own: bool, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": _lp(logprob), "bytes": texts.bytes(token_id, piece, own)}

    content = []
    for info in tokens:
        if info.logprob is None:
            continue
        top = [
            entry(t, info.text, info.piece, info.own, v)
            if t == info.token_id
            else entry(t, text, text, info.own, v)
            for t, text, v in info.top
        ]
        chosen = entry(info.token_id, info.text, info.piece, info.own, info.logprob.logprob)
        content.append({**chosen, "top_logprobs": top})
    return {"content": content, "refusal": None}


@dataclass(frozen=True)
class ResponseHead:
    """The fields every response and chunk of one request repeats."""

    id: str
    created: int
    model: str

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def completion(self, choices: list[dict[str, Any]], use: dict[str, Any]) -> dict[str, Any]:
        return {**self._base("text_completion"), "choices": choices, "usage": use}

    def chat(self, choices: list[dict[str, Any]], use: dict[str, Any]) -> dict[str, Any]:
        return {**self._base("chat.completion"), "choices": choices, "usage": use}

    def completion_chunk(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        with_usage: bool | dict[str, Any],
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """`with_usage`: True puts `usage: null` on the chunk (OpenAI: null on every
        chunk but the usage one), a usage object puts that (continuous usage)."""
        choice = completion_choice(index, text, finish_reason, logprobs)
        chunk = {**self._base("text_completion"), "choices": [choice]}
        if with_usage is not False:
            chunk["usage"] = None if with_usage is True else with_usage
        return chunk

    def chat_chunk(
        self,
        index: int,
        delta: dict[str, Any],
        finish_reason: str | None,
        with_usage: bool | dict[str, Any],
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """`with_usage` as in completion_chunk."""
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        chunk = {**self._base("chat.completion.chunk"), "choices": [choice]}
        if with_usage is not False:
            chunk["usage"] = None if with_usage is True else with_usage
        return chunk

    def usage_chunk(self, chat: bool, use: dict[str, Any]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        return {**self._base(obj), "choices": [], "usage": use}


def completion_choice(
    index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(
    index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None
) -> dict[str, Any]:
    return {
        "index": index,
        "message": {"role": "assistant", "content": text},
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }


def sse(data: Mapping[str, Any] | str) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


SSE_DONE = sse("[DONE]")
