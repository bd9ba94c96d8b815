"""Next-token choice per request, logprobs, and text output (vLLM's incremental
detokenizer) with stop strings.

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
LOGPROB_ROWS = 256  # rows of the vocabulary one log_softmax takes at most


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
        # logit_bias ids and values, and the ids min_tokens blocks: built once (first step)
        self.fixed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def _fixed(self, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.fixed is None:
            bias = [(t, b) for t, b in self.params.logit_bias if t < vocab]
            self.fixed = (
                torch.tensor([t for t, _ in bias], dtype=torch.long),
                torch.tensor([b for _, b in bias], dtype=torch.float32),
                torch.tensor([t for t in self.stop_ids if t < vocab], dtype=torch.long),
            )
        return self.fixed

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
        bias_ids, bias_values, blocked = self._fixed(vocab)
        if len(bias_ids):
            row.index_add_(0, bias_ids, bias_values)  # one op, however many entries
        if len(out_ids) < p.min_tokens and len(blocked):
            row.index_fill_(0, blocked, float("-inf"))
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
    logits [N, V], each with the `top` most likely (id, logprob), most likely first.
    Computed LOGPROB_ROWS rows at a time, so a long prompt chunk never holds more than
    that many fp32 rows of the vocabulary at once besides its logits."""
    token_ids = list(token_ids)
    out: list[TokenLogprobs] = []
    for start in range(0, len(token_ids), LOGPROB_ROWS):
        ids = token_ids[start : start + LOGPROB_ROWS]
        lp = torch.log_softmax(logits[start : start + len(ids)].float(), dim=-1)
        index = torch.tensor(ids, dtype=torch.long, device=lp.device)
        chosen = lp.gather(1, index[:, None])[:, 0].clamp_min(LOGPROB_FLOOR).tolist()
        if top > 0:
            best = torch.topk(lp, min(top, lp.shape[-1]), dim=-1)
            values = best.values.clamp_min(LOGPROB_FLOOR).tolist()
            indices = best.indices.tolist()
            tops = [tuple(zip(i, v, strict=True)) for i, v in zip(indices, values, strict=True)]
        else:
            tops = [()] * len(chosen)
        del lp
        out.extend(
            TokenLogprobs(int(t), float(c), top)
            for t, c, top in zip(ids, chosen, tops, strict=True)
        )
    return out


class Detokenizer:
    """vLLM's incremental detokenizer: the text each new token adds.

    Each token is decoded with the tokens just before it as context (at first the
    `context_ids` given: a prompt's last few), and what the decode adds past the
    context's own decode is its text. So tokenizers that drop a leading space at the
    start of a decode (SentencePiece / Metaspace) keep it, and each token costs a short
    decode, not the whole output. Text ending in an incomplete UTF-8 sequence (U+FFFD)
    waits for the next token: that token's text then holds the whole character, and the
    earlier one's is empty. The pieces join to what one decode of all the tokens gives
    (for the usual tokenizers)."""

    CONTEXT = 5  # context tokens decoded in front of the first new ones

    def __init__(
        self, tokenizer: Any, context_ids: Any = (), skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(context_ids)[-self.CONTEXT :]
        self.prefix = 0  # ids[prefix:read] is the context of the next decode
        self.read = len(self.ids)  # ids before this are in the text
        self.stream, self.backend = _decode_stream(tokenizer, self.ids, skip_special_tokens)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    @property
    def pending(self) -> bool:
        """Whether tokens wait (their text is not out yet: an incomplete character)."""
        return self.read < len(self.ids)

    def push(self, token_ids: list[int]) -> str:
        """The text `token_ids` add ("" while an incomplete character waits)."""
        self.ids.extend(token_ids)
        if self.stream is None:
            return self.advance()
        text = self.stream.step(self.backend, list(token_ids))
        if text:  # (None: an incomplete character waits, as in advance)
            self.prefix, self.read = self.read, len(self.ids)
        return text or ""

    def advance(self, final: bool = False) -> str:
        context = self.decode(self.ids[self.prefix : self.read])
        full = self.decode(self.ids[self.prefix :])
        if len(full) > len(context) and (final or not full.endswith("\ufffd")):
            self.prefix, self.read = self.read, len(self.ids)
            return full[len(context) :]
        return ""

    def flush(self) -> str:
        """The text of the tokens still waiting (at the end)."""
        return self.advance(final=True) if self.pending else ""

    def candidates(self, token_ids: Sequence[int]) -> list[str]:
        """The text each of `token_ids` would add as the next token (with the text of
        the tokens still waiting, if any; an incomplete character is U+FFFD)."""
        context = self.decode(self.ids[self.prefix : self.read])
        head = self.ids[self.prefix :]
        return [self.decode([*head, t])[len(context) :] for t in token_ids]


def _decode_stream(tokenizer: Any, context: list[int], skip: bool) -> tuple[Any, Any]:
    """`tokenizers`' DecodeStream (the same algorithm, in Rust: one decode a token instead
    of two) primed with the context, and the backend it steps with; (None, None) where
    it would give another text than `tokenizer.decode`, so `Detokenizer` decodes itself:
    a slow tokenizer (no backend), one that cleans up spaces after decoding
    (clean_up_tokenization_spaces: the stream does not), a context ending inside a
    character (the stream would emit those bytes again). Detokenizer's own code stays
    for `flush` (the stream never emits an incomplete character; the text ends with
    U+FFFD, as a whole decode's) and `candidates` (no look-ahead in the stream)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None, None
    try:
        from tokenizers.decoders import DecodeStream
    except ImportError:  # tokenizers < 0.21
        return None, None
    if context and tokenizer.decode(context, skip_special_tokens=skip).endswith("\ufffd"):
        return None, None
    stream = DecodeStream(skip_special_tokens=skip)
    if context:
        stream.step(backend, list(context))  # its text is the context's, not ours
    return stream, backend


class TextOutput:
    """A request's output text, decoded incrementally (`Detokenizer`, with the prompt's
    last tokens as the first context), with its stop strings.

    `push(token_ids)` returns (new text safe to emit, stop string found): text that
    might still become a stop string is held back; `flush()` returns what is left."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...], prompt_ids: Any = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.detok = Detokenizer(tokenizer, prompt_ids) if tokenizer is not None else None
        self.text = ""  # the decoded output so far (cut at a stop string)
        self.sent = 0  # characters of `text` already emitted

    def push(self, token_ids: list[int], check_stop: bool = True) -> tuple[str, bool]:
        """`check_stop` False: the stop strings are not looked for in the new text
        (min_tokens: a stop string that ends before then never stops the output)."""
        if self.detok is None:
            return "", False
        start = max(0, len(self.text) - self.hold)
        self.text += self.detok.push(token_ids)
        for s in self.stop if check_stop else ():
            at = self.text.find(s, start)
            if at >= 0:
                self.text = self.text[:at]
                self.detok.read = len(self.detok.ids)  # nothing after the stop is text
                return self.flush(), True
        end = len(self.text) - self.hold
        if end <= self.sent:
            return "", False
        new, self.sent = self.text[self.sent : end], end
        return new, False

    def flush(self) -> str:
        """The rest of the text (at the end of the request)."""
        if self.detok is not None:
            self.text += self.detok.flush()
        new, self.sent = self.text[self.sent :], len(self.text)
        return new
