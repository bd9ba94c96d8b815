"""What a request asks for (`SamplingParams`), how the engine schedules
(`EngineConfig`), what it hands back (`RequestOutput`), and how it refuses
(`RequestRejected`). Every field is checked at construction with a one-line error
naming the field, the value and what is accepted."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvstrata.core.blending import BLEND_RECOMPUTE, check_recompute
from kvstrata.core.errors import ConfigError, KvstrataError

MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20  # top logprobs per token at most (OpenAI's and vLLM's default limit)
MAX_LOGIT_BIAS = 300  # logit_bias entries at most (OpenAI's limit)
PREEMPTION_MODES = ("demote", "off")


class EngineStopped(KvstrataError):
    """The engine was shut down (or stopped on an error): it takes no more requests."""


class RequestRejected(KvstrataError, ValueError):
    """A request the engine can never run (longer than the model's positions, larger
    than every tier together, ...): one line with the numbers and the fix. The server
    answers it with HTTP 400."""


def _int(name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError.field(name, value, "a whole number")
    if value < minimum or (maximum is not None and value > maximum):
        upper = f" and <= {maximum}" if maximum is not None else ""
        raise ConfigError.field(name, value, f"a whole number >= {minimum}{upper}")
    return value


def _float(name: str, value: Any, lo: float, hi: float, lo_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError.field(name, value, "a number")
    v = float(value)
    if not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo):
        lower = f"> {lo}" if lo_open else f">= {lo}"
        raise ConfigError.field(name, value, f"a number {lower} and <= {hi}")
    return v


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded.

    Args:
        max_tokens: new tokens at most (a prompt + max_tokens past the model's
            positions is refused up front, as OpenAI and vLLM do). 0: the prompt is
            computed (its prefix-cache blocks reused, unless prompt_logprobs scores it)
            and nothing is generated; the request ends with "length".
        temperature: 0 = greedy (argmax); > 0 samples from softmax(logits / T).
        top_k: keep the k most likely tokens (0 = all).
        top_p: keep the smallest set of tokens whose probability reaches top_p.
        seed: seed of this request's own generator (None: drawn at random), so a
            sampled request gives the same tokens alone or in any batch.
        stop: strings that end the output (not included in it).
        stop_token_ids: token ids that end the output (not included in it).
        ignore_eos: keep going past the tokenizer's end-of-sequence token.
        logprobs: return the log-probability of each generated token and of the
            `logprobs` most likely tokens at its position (None: none, at no cost).
            Raw logprobs, as vLLM's default: log_softmax of the model's fp32 logits,
            before penalties, logit_bias, temperature, top-k / top-p / min-p.
        prompt_logprobs: the same for every prompt token given its prefix (the first
            has none). Its whole prompt is computed (no prefix-cache reuse).
        frequency_penalty: OpenAI's, in [-2, 2]: a logit minus
            count * frequency_penalty + (count > 0) * presence_penalty, counting the
            token in the output so far.
        presence_penalty: OpenAI's, in [-2, 2] (see frequency_penalty).
        repetition_penalty: vLLM's / transformers' (> 0; 1 = off): the logit of a
            token in the prompt or output is divided by it (multiplied when negative).
        logit_bias: {token id: bias in [-100, 100]} added to the logits (kept as a
            tuple of (id, bias) pairs), at most MAX_LOGIT_BIAS entries.
        min_p: drop tokens less likely than min_p * the most likely one's probability
            (after temperature; 0 = off).
        min_tokens: end-of-sequence and stop_token_ids are blocked until this many
            tokens are out, and stop strings are looked for once they are (vLLM's
            rule: a stop string may end with token number min_tokens).

    Penalties and logit_bias apply to greedy requests too (as OpenAI's do at
    temperature 0); a greedy request without them takes the plain argmax.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Any = ()
    min_p: float = 0.0
    min_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _int(name, value, 0, MAX_LOGPROBS)
        _int("max_tokens", self.max_tokens, 0)  # 0: compute (and score) the prompt alone
        _float("temperature", self.temperature, 0.0, 100.0)
        _int("top_k", self.top_k, 0)
        _float("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        if self.seed is not None:
            _int("seed", self.seed, 0, MAX_SEED)
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (tuple, list)) or not all(isinstance(s, str) and s for s in stop):
            raise ConfigError.field("stop", self.stop, "a string or a list of non-empty strings")
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, (tuple, list)):
            raise ConfigError.field("stop_token_ids", ids, "a list of token ids")
        for t in ids:
            _int("stop_token_ids", t, 0)
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        if not isinstance(self.ignore_eos, bool):
            raise ConfigError.field("ignore_eos", self.ignore_eos, "true or false")
        _float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _float("repetition_penalty", self.repetition_penalty, 0.0, 100.0, lo_open=True)
        _float("min_p", self.min_p, 0.0, 1.0)
        _int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise ConfigError.field(
                "min_tokens", self.min_tokens, f"at most max_tokens ({self.max_tokens})"
            )
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits are changed before the choice (penalties, logit_bias,
        min_tokens); False takes the plain path (argmax, or temperature / top-k / top-p)."""
        return bool(
            self.frequency_penalty
            or self.presence_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, bias) pairs, from a mapping or pairs."""
    accepted = "{token id: bias} with ids >= 0 and biases in [-100, 100]"
    if value is None:
        return ()
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, (tuple, list)):
        items = value
    else:
        raise ConfigError.field("logit_bias", value, accepted)
    if len(items) > MAX_LOGIT_BIAS:
        raise ConfigError(
            f"logit_bias=<{len(items)} entries> is invalid: at most {MAX_LOGIT_BIAS} "
            "entries (OpenAI's limit)"
        )
    out: dict[int, float] = {}
    for item in items:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ConfigError.field("logit_bias", value, accepted)
        token, bias = item
        _int(f"logit_bias[{token!r}]", token, 0)
        out[token] = _float(f"logit_bias[{token}]", bias, -100.0, 100.0)
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class EngineConfig:
    """How the engine batches and schedules.

    Args:
        max_num_seqs: requests running at once (the rest wait in arrival order).
        max_batched_tokens: tokens one step feeds the model at most: every running
            decode (one token each) plus chunks of prompts being prefilled.
        preemption: "demote" (default): the running requests' KV is kept within the
            device budget; when it would not fit, the newest running request is
            preempted — its blocks are demoted to host / disk (nothing recomputed,
            nothing dropped) and it resumes when there is room. "off": every admitted
            request runs every step and placement spreads their blocks over the tiers.
        salt: tenant salt of the prefix cache (requests with different salts never
            share blocks; a request may bring its own).
        threads: torch (OpenMP) threads of the engine thread, which runs every
            forward and kernel (None: as many as the thread that built the engine
            has). OpenMP thread counts are per thread, so the engine sets its own.
        native_linear: decode-sized projections (at most 8 rows: the decodes of a
            step, the LM head's kept rows) of an fp32 CPU model run through kvstrata's
            native kernel, which streams each weight once (faster than torch's sgemm
            there), and larger ones (prefill chunks) through oneDNN's fp32 linear
            (faster than torch's MKL sgemm here; the figures: docs/MEASUREMENTS.md);
            weights under 1 MiB keep torch's. Both differ from MKL in the last bits;
            False keeps torch's `F.linear` for every projection.
        lean_forward: Llama / Mistral / Qwen2 / Qwen3 models run the engine's steps
            through kvstrata's lean forward (integrations.hf.lean: the model's own
            modules, without transformers' per-call machinery; the same logits bit for
            bit); False, or another family, runs transformers' forward.
        blend_recompute: for a prompt given with documents (`kvstrata.Chunks`), the
            share of the documents' reused tokens recomputed in context (CacheBlend;
            docs/blend.md); 1 recomputes all of them (a full prefill). A request may
            bring its own.
    """

    max_num_seqs: int = 8
    max_batched_tokens: int = 512
    preemption: str = "demote"
    salt: str = ""
    threads: int | None = None
    native_linear: bool = True
    lean_forward: bool = True
    blend_recompute: float = BLEND_RECOMPUTE

    def __post_init__(self) -> None:
        check_recompute(self.blend_recompute)
        _int("max_num_seqs", self.max_num_seqs, 1, 4096)
        _int("max_batched_tokens", self.max_batched_tokens, 1)
        if self.preemption not in PREEMPTION_MODES:
            raise ConfigError.field(
                "preemption", self.preemption, f"one of {', '.join(PREEMPTION_MODES)}"
            )
        if self.threads is not None:
            _int("threads", self.threads, 1, 1024)
        if not isinstance(self.salt, str):
            raise ConfigError.field("salt", self.salt, "a string naming the tenant")
        if not isinstance(self.native_linear, bool):
            raise ConfigError.field("native_linear", self.native_linear, "True or False")
        if not isinstance(self.lean_forward, bool):
            raise ConfigError.field("lean_forward", self.lean_forward, "True or False")


@dataclass(frozen=True)
class TokenLogprobs:
    """The log-probability of one token at its position (`logprob`) and the `top`
    most likely tokens there: (token id, logprob) pairs, most likely first, as many
    as the request asked for."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    """A request's progress: what is new since the last output (streaming), or the
    whole result when it finished (`Engine.generate`).

    token_ids / text: the new tokens and text of this output (all of them in the
    final output of `generate`). finish_reason: None while running, else "stop"
    (end-of-sequence, a stop string or a stop token), "length" (max_tokens or the
    model's positions) or "abort" (cancelled). cached_tokens: prompt tokens found in
    the prefix cache (not computed). error: set when the engine gave up on the request
    (a failed step, shutdown). logprobs: one `TokenLogprobs` per entry of token_ids
    when the request asked for them (SamplingParams.logprobs). prompt_logprobs: one
    per prompt token (None for the first, which has no prefix), in the first output
    after the whole prompt was computed (SamplingParams.prompt_logprobs)."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None  # why an aborted request stopped, when not cancelled
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
