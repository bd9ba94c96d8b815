"""Tokens placed in a choice's text, for logprobs: each token decoded alone (`TokenTexts`,
with its UTF-8 bytes for chat), and each token of a choice — the echoed prompt's, then
the generated ones — with the text it adds and where that starts (`ChoiceTokens`,
incremental: the engine's `Detokenizer`, so the pieces join to the choice's text).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from transformers.convert_slow_tokenizer import bytes_to_unicode

from kvstrata.engine.params import RequestOutput, TokenLogprobs
from kvstrata.engine.sampling import Detokenizer

# the printable characters byte-level BPE tokenizers (GPT-2's) spell bytes with -> the byte
_CHAR_TO_BYTE = {char: byte for byte, char in bytes_to_unicode().items()}
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
