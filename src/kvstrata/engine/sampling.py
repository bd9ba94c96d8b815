"""Next-token choice per request, logprobs, and text output with stop strings.

Greedy rows take the argmax (the first of equal maxima, as transformers does). A
sampled row draws from its own `torch.Generator` (seeded per request), so its tokens
do not depend on which other requests share the step. A request with penalties,
logit_bias or min_tokens has its row adjusted first (`LogitsAdjuster`, vLLM's order:
logit_bias, min_tokens, then the repetition, frequency and presence penalties); every
other row takes the plain path, untouched.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from kvstrata.engine.params import SamplingParams, TokenLogprobs

LOGPROB_FLOOR = -9999.0  # what -inf is reported as (JSON has no infinity; vLLM's value)


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.greedy:
        return None
    gen = torch.Generator()
    if params.seed is None:
        gen.seed()
    else:
        gen.manual_seed(params.seed)
    return gen


class LogitsAdjuster:
    """One request's logits processing before its next token is chosen (module doc).

    Args:
        params: the request's SamplingParams (params.adjusts_logits).
        prompt_ids: its prompt (repetition_penalty counts it).
        stop_ids: the ids min_tokens blocks (stop_token_ids, and end-of-sequence
            unless ignore_eos).
    """

    def __init__(
        self, params: SamplingParams, prompt_ids: Sequence[int], stop_ids: Iterable[int]
    ) -> None:
        self.params = params
        self.prompt_ids = prompt_ids
        self.stop_ids = sorted(set(stop_ids))
        self.counts: torch.Tensor | None = None  # output tokens so far, per id
        self.seen_prompt: torch.Tensor | None = None
        self.counted = 0  # output tokens already in `counts`

    def _prepare(self, vocab: int, out_ids: Sequence[int]) -> torch.Tensor:
        if self.counts is None:
            self.counts = torch.zeros(vocab, dtype=torch.float32)
            if self.params.repetition_penalty != 1.0:
                self.seen_prompt = torch.zeros(vocab, dtype=torch.bool)
                ids = [t for t in self.prompt_ids if t < vocab]
                self.seen_prompt[torch.tensor(ids, dtype=torch.long)] = True
        for token in out_ids[self.counted :]:
            if token < vocab:
                self.counts[token] += 1
        self.counted = len(out_ids)
        return self.counts

    def apply(self, logits: torch.Tensor, out_ids: Sequence[int]) -> torch.Tensor:
        """A new fp32 row: `logits` [V] adjusted for a request with `out_ids` so far."""
        p = self.params
        row = logits.float().clone()
        vocab = row.shape[-1]
        for token, bias in p.logit_bias:
            if token < vocab:
                row[token] += bias
        if len(out_ids) < p.min_tokens:
            blocked = [t for t in self.stop_ids if t < vocab]
            row[blocked] = float("-inf")
        if not (p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty):
            return row
        counts = self._prepare(vocab, out_ids)
        if p.repetition_penalty != 1.0:
            assert self.seen_prompt is not None
            seen = self.seen_prompt | (counts > 0)
            penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row = torch.where(seen, penalized, row)
        if p.frequency_penalty:
            row -= p.frequency_penalty * counts
        if p.presence_penalty:
            row -= p.presence_penalty * (counts > 0).float()
        return row


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [V] / temperature, with tokens below min-p or outside top-k / top-p set to
    -inf."""
    row = logits.float() / params.temperature
    if params.min_p > 0.0:
        probs = torch.softmax(row, dim=-1)
        row = row.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
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


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    gens: list[Any],
    adjust: list[tuple[LogitsAdjuster, Sequence[int]] | None] | None = None,
) -> list[int]:
    """One next token per row of logits [N, V] (not modified). `adjust`: per row, its
    LogitsAdjuster and output so far, or None (None for all: no row is adjusted)."""
    out = torch.argmax(logits, dim=-1).tolist()
    for i, (p, gen) in enumerate(zip(params, gens, strict=True)):
        step = adjust[i] if adjust is not None else None
        if step is None and p.greedy:
            continue
        row = logits[i] if step is None else step[0].apply(logits[i], step[1])
        if p.greedy:
            out[i] = int(torch.argmax(row))
            continue
        probs = torch.softmax(filtered_logits(row, p), dim=-1)
        out[i] = int(torch.multinomial(probs, 1, generator=gen))
    return out


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], top: int) -> list[TokenLogprobs]:
    """Raw logprobs (log_softmax of the fp32 logits) of `token_ids`, one per row of
    logits [N, V], each with the `top` most likely (id, logprob), most likely first."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, ids[:, None])[:, 0].clamp_min(LOGPROB_FLOOR).tolist()
    if top > 0:
        best = torch.topk(lp, min(top, lp.shape[-1]), dim=-1)
        values = best.values.clamp_min(LOGPROB_FLOOR).tolist()
        indices = best.indices.tolist()
        tops = [tuple(zip(i, v, strict=True)) for i, v in zip(indices, values, strict=True)]
    else:
        tops = [()] * len(chosen)
    return [
        TokenLogprobs(int(t), float(c), top)
        for t, c, top in zip(token_ids, chosen, tops, strict=True)
    ]


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

    def push(self, token_ids: list[int], check_stop: bool = True) -> tuple[str, bool]:
        """`check_stop` False: the stop strings are not looked for in the new text
        (min_tokens: a stop string that ends before then never stops the output)."""
        if self.tokenizer is None:
            return "", False
        self.ids.extend(token_ids)
        start = max(0, len(self.text) - self.hold)
        self._advance()
        for s in self.stop if check_stop else ():
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
