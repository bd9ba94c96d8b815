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

    `push(token_ids)` returns (new text safe to emit, stop string found). Text that
    might still become a stop string, or an incomplete UTF-8 sequence (decoded as
    U+FFFD), is held back until it is settled; `flush()` returns what is left."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # the decoded output so far (cut at a stop string)
        self.sent = 0  # characters of `text` already emitted

    def push(self, token_ids: list[int]) -> tuple[str, bool]:
        self.ids.extend(token_ids)
        if self.tokenizer is None:
            return "", False
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        start = max(0, len(self.text) - self.hold - 4)  # a few more: decoding may redo
        # the last characters (an incomplete UTF-8 sequence completed)
        self.text = text
        for s in self.stop:
            at = text.find(s, start)
            if at >= 0:
                self.text = text[:at]
                return self.flush(), True
        end = len(text) - self.hold
        while end > self.sent and text[end - 1] == "\ufffd":
            end -= 1
        if end <= self.sent:
            return "", False
        new, self.sent = text[self.sent : end], end
        return new, False

    def flush(self) -> str:
        new, self.sent = self.text[self.sent :], len(self.text)
        return new
