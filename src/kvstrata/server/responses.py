"""The OpenAI response shapes: `usage`, logprobs (legacy completions, chat), choices,
responses and stream chunks (`ResponseHead`), server-sent events.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvstrata.engine.sampling import LOGPROB_FLOOR
from kvstrata.server.detokenizer import TokenInfo, TokenTexts


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI `usage` (cached: prompt tokens the prefix cache held, not computed)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _lp(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def completion_logprobs(tokens: list[TokenInfo]) -> dict[str, Any]:
    """The legacy completions `logprobs` object: top_logprobs maps the most likely tokens'
    texts to their logprob, most likely first (a text two tokens share keeps the
    likelier), and always holds the chosen token (OpenAI: up to logprobs + 1 entries)."""
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    out: dict[str, list[Any]] = {key: [] for key in keys}
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
    """The fields every response and chunk of one request repeats; `chat`: the chat
    endpoint's shapes, else the completions ones."""

    id: str
    created: int
    model: str
    chat: bool

    def _base(self, chunk: bool) -> dict[str, Any]:
        obj = "chat.completion.chunk" if chunk else "chat.completion"
        obj = obj if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(self, choices: list[dict[str, Any]], use: dict[str, Any]) -> dict[str, Any]:
        return {**self._base(False), "choices": choices, "usage": use}

    def chunk(self, choices: list[dict[str, Any]], usage: bool | dict[str, Any]) -> dict[str, Any]:
        """`usage`: True puts `usage: null` on the chunk (OpenAI: null on every chunk but
        the usage one), a usage object puts that (continuous usage, the usage chunk)."""
        chunk = {**self._base(True), "choices": choices}
        if usage is not False:
            chunk["usage"] = None if usage is True else usage
        return chunk

    def choice(
        self, index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None
    ) -> dict[str, Any]:
        """A completions choice (whole or streamed), or a whole chat choice."""
        body = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        return {"index": index, **body, "logprobs": logprobs, "finish_reason": finish_reason}


def delta(
    index: int, change: dict[str, Any], finish_reason: str | None = None, logprobs: Any = None
) -> dict[str, Any]:
    """A streamed chat choice."""
    return {"index": index, "delta": change, "logprobs": logprobs, "finish_reason": finish_reason}


def sse(data: Mapping[str, Any] | str) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


SSE_DONE = sse("[DONE]")
