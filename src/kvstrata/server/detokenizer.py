"""Tokens placed in a choice's text, for logprobs: decoded alone, with their bytes
(`TokenTexts`), and with the text each adds and where (`ChoiceTokens`).
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
    """Tokens decoded alone (cached per id; `token_id:<id>` without a tokenizer, vLLM's
    form), and their UTF-8 `bytes` for chat logprobs."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        """The token decoded alone (special tokens included)."""
        if token_id not in self._text:
            if self.tokenizer is None:
                self._text[token_id] = f"token_id:{token_id}"
            else:
                self._text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return self._text[token_id]

    def bytes(self, token_id: int, piece: str | None = None, own: bool = False) -> list[int]:
        """The token's UTF-8 bytes: when it is part of a character (it decodes alone to
        U+FFFD), the bytes its vocabulary entry spells (byte-level BPE, or a SentencePiece
        byte token); else its text in context when that is its own (`own`: no earlier
        token's waiting bytes in `piece`; SentencePiece keeps the word's leading space
        there), else its text decoded alone."""
        text = self.text(token_id)
        if "\ufffd" in text:
            spelled = self.tokenizer.convert_ids_to_tokens(token_id)
            spelled = spelled if isinstance(spelled, str) else ""
            byte = _BYTE_FALLBACK.fullmatch(spelled)
            if byte is not None:
                return [int(byte.group(1), 16)]
            if spelled and all(c in _CHAR_TO_BYTE for c in spelled):
                return [_CHAR_TO_BYTE[c] for c in spelled]
        if own and piece is not None and "\ufffd" not in piece:
            return list(piece.encode("utf-8"))
        return list(text.encode("utf-8"))


@dataclass
class TokenInfo:
    """One token of a choice's logprobs (`logprob` None: the first prompt token).
    `text`: what it adds to the choice's text (empty for a token whose character a later
    token completes, a special token the text leaves out, past a stop string); `offset`:
    where that starts (where the text has reached, when empty); `piece`: its text before
    a stop string cut it (chat `bytes`), `own` when no earlier token's waiting bytes are
    in it; `top`: the most likely tokens there as (id, text as the next token, logprob)."""

    token_id: int
    logprob: TokenLogprobs | None
    text: str
    offset: int
    piece: str = ""
    own: bool = True
    top: tuple[tuple[int, str, float], ...] = ()


class ChoiceTokens:
    """The TokenInfo of every token of one choice, as its outputs come: the echoed prompt's
    (a special token is its name where the echoed text holds it, else nothing: a BOS the
    tokenizer added), then the generated ones, decoded as the engine decodes the output
    text (a `Detokenizer` after the prompt's last tokens; a stop token is never text), so
    their pieces join to the generated text (up to a stop string: `clip`)."""

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
