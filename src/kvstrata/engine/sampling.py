"""Next-token choice per request, and text output with stop strings.

Greedy rows take the argmax (the first of equal maxima, as transformers does). A
sampled row draws from its own `torch.Generator` (seeded per request), so its tokens
do not depend on which other requests share the step.
"""

from __future__ import annotations

from typing import Any

import torch

from kvstrata.engine.params import SamplingParams


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.greedy:
        return None
    gen = torch.Generator()
    if params.seed is None:
        gen.seed()
    else:
        gen.manual_seed(params.seed)
    return gen


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [V] / temperature, with tokens outside top-k / top-p set to -inf."""
    row = logits.float() / params.temperature
    if 0 < params.top_k < row.shape[-1]:
        kth = torch.topk(row, params.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the ones before it already reach top_p (keep at least one)
        drop = probs.cumsum(-1) - probs >= params.top_p
        drop[0] = False
        row = row.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return row


def sample(logits: torch.Tensor, params: list[SamplingParams], gens: list[Any]) -> list[int]:
    """One next token per row of logits [N, V]."""
    out = torch.argmax(logits, dim=-1).tolist()
    for i, (p, gen) in enumerate(zip(params, gens, strict=True)):
        if p.greedy:
            continue
        probs = torch.softmax(filtered_logits(logits[i], p), dim=-1)
        out[i] = int(torch.multinomial(probs, 1, generator=gen))
    return out


class TextOutput:
    """A request's output text, decoded incrementally, with its stop strings.

    Decoding follows vLLM's incremental detokenizer: each new piece is decoded with
    the tokens just before it as context (the prompt's last few, at first), so
    tokenizers that drop a leading space at the start of a decode (SentencePiece /
    Metaspace) keep it, and each token costs a short decode, not the whole output.
    Text ending in an incomplete UTF-8 sequence (U+FFFD) waits for the next token.

    `push(token_ids)` returns (new text safe to emit, stop string found): text that
    might still become a stop string is held back; `flush()` returns what is left."""

    CONTEXT = 5  # prompt tokens decoded in front of the first output tokens

    def __init__(self, tokenizer: Any, stop: tuple[str, ...], prompt_ids: Any = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = list(prompt_ids)[-self.CONTEXT :]
        self.prefix = 0  # ids[prefix:read] is the context of the next decode
        self.read = len(self.ids)  # ids before this are in `text`
        self.text = ""  # the decoded output so far (cut at a stop string)
        self.sent = 0  # characters of `text` already emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _advance(self, final: bool = False) -> None:
        context = self._decode(self.ids[self.prefix : self.read])
        full = self._decode(self.ids[self.prefix :])
        if len(full) > len(context) and (final or not full.endswith("\ufffd")):
            self.text += full[len(context) :]
            self.prefix, self.read = self.read, len(self.ids)

    def push(self, token_ids: list[int]) -> tuple[str, bool]:
        if self.tokenizer is None:
            return "", False
        self.ids.extend(token_ids)
        start = max(0, len(self.text) - self.hold)
        self._advance()
        for s in self.stop:
            at = self.text.find(s, start)
            if at >= 0:
                self.text = self.text[:at]
                self.read = len(self.ids)  # nothing after the stop string is text
                return self.flush(), True
        end = len(self.text) - self.hold
        if end <= self.sent:
            return "", False
        new, self.sent = self.text[self.sent : end], end
        return new, False

    def flush(self) -> str:
        """The rest of the text (at the end of the request)."""
        if self.tokenizer is not None and self.read < len(self.ids):
            self._advance(final=True)
        new, self.sent = self.text[self.sent :], len(self.text)
        return new
