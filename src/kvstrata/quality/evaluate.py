"""The quality harness: perplexity of a model *through* a KV cache, vs the exact cache.

A lossy codec or an offloaded tier only matters once the model attends to the history it
stored, so :func:`perplexity` is teacher-forced one token per forward: after a short
prefill every next-token prediction attends to the cached (demoted, encoded, decoded)
history, exactly as in decoding. :func:`compare` runs the exact reference — transformers'
``DynamicCache`` with ``sdpa`` — and each kvstrata cache configuration over the same
windows and reports the perplexity change and the top-1 next-token agreement::

    windows = heldout_windows("default", context=2048, num_windows=2)
    report = compare(model, windows, {"int8": dict(host_codec="int8", ...)}, context=2048)
    report.configs["int8"].delta_ppl_pct, report.configs["int8"].top1_agreement

Pure functions: no printing; progress goes through an optional callback.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstrata.config import CacheConfig
from kvstrata.core.errors import ConfigError
from kvstrata.integrations.hf import ATTENTION_NAME, TieredCache, enable
from kvstrata.model.budgets import group_layout as block_layout  # noqa: F401 - re-exported
from kvstrata.model.budgets import placement  # noqa: F401 - re-exported
from kvstrata.workload.zoo import EOS_ID, bytes_to_ids, heldout_files

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel
    from transformers.cache_utils import Cache

LN2 = math.log(2.0)
EXACT = "exact"
REFERENCE_ATTENTION = "sdpa"
# A lossless cache differs from the exact one only by float rounding: its attention merges
# per-tier partials with log-sum-exp where sdpa makes one pass (measured well below this
# tolerance: docs/MEASUREMENTS.md). A lost or corrupted block moves perplexity by orders
# of magnitude more.
LOSSLESS_TOLERANCE_PCT = 1e-4

CacheFactory = Callable[[int], "Cache"]
"""Builds a fresh cache for one window; receives the window length in tokens."""
Progress = Callable[[int], None]
"""Called with the number of forward steps just done (for a progress bar)."""


@dataclass
class PplResult:
    """Teacher-forced perplexity of one cache over one or more windows.

    Fields:
        nll: summed negative log-likelihood of the predicted tokens, in nats.
        num_tokens: predicted tokens (each window of n tokens predicts n - 1).
        num_bytes: bytes of text those tokens stand for (bits per byte divides by it).
        argmax_ids: per predicted position, the model's top-1 next token, windows
            concatenated in order (top-1 agreement compares these between caches).
    """

    nll: float
    num_tokens: int
    num_bytes: int
    argmax_ids: list[int] = field(default_factory=list)

    @property
    def ppl(self) -> float:
        """Perplexity: exp(mean NLL per token)."""
        return math.exp(self.nll / self.num_tokens) if self.num_tokens else float("nan")

    @property
    def bits_per_byte(self) -> float:
        """NLL in bits per byte of text (nll / ln 2 / bytes)."""
        return self.nll / LN2 / self.num_bytes if self.num_bytes else float("nan")

    def merged(self, other: PplResult) -> PplResult:
        """The result of both runs together (sums; argmax ids concatenated)."""
        return PplResult(
            self.nll + other.nll,
            self.num_tokens + other.num_tokens,
            self.num_bytes + other.num_bytes,
            self.argmax_ids + other.argmax_ids,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON form (without the per-step argmax ids)."""
        return {
            "nll": self.nll,
            "tokens": self.num_tokens,
            "bytes": self.num_bytes,
            "ppl": self.ppl,
            "bits_per_byte": self.bits_per_byte,
        }


@dataclass
class ConfigResult:
    """One cache configuration measured against the exact cache on the same windows."""

    name: str
    cache_kwargs: dict[str, Any]
    result: PplResult
    delta_ppl_pct: float
    top1_agreement: float

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "name": self.name,
            "cache": {k: v for k, v in self.cache_kwargs.items() if k != "extra"},
            **self.result.to_dict(),
            "delta_ppl_pct": self.delta_ppl_pct,
            "top1_agreement": self.top1_agreement,
        }


@dataclass
class Comparison:
    """What :func:`compare` returns: the exact reference and every configuration."""

    context: int
    num_windows: int
    exact: PplResult
    configs: dict[str, ConfigResult]

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "context": self.context,
            "windows": self.num_windows,
            "exact": self.exact.to_dict(),
            "configs": [c.to_dict() for c in self.configs.values()],
        }


def _as_ids(token_ids: Any) -> torch.Tensor:
    import torch

    ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
    return ids


def _use_attention_for(model: PreTrainedModel, cache: Cache) -> None:
    """Switch the model to the attention its cache needs (kvstrata's for a TieredCache,
    sdpa for transformers' own caches), so one model object serves both."""
    current = getattr(model.config, "_attn_implementation", None)
    if isinstance(cache, TieredCache):
        if current != ATTENTION_NAME:
            enable(model)
    elif current == ATTENTION_NAME:
        model.set_attn_implementation(REFERENCE_ATTENTION)


def window_perplexity(
    model: PreTrainedModel,
    window: Any,
    cache: Cache,
    *,
    prefill: int = 1,
    num_bytes: int | None = None,
    progress: Progress | None = None,
    score_prefill: bool = True,
) -> PplResult:
    """Teacher-forced NLL of one window, one token per forward after a short prefill.

    Args:
        model: A causal LM (its attention is switched to what `cache` needs).
        window: 1-D token ids, at least 2.
        cache: A fresh, empty cache for this window.
        prefill: Tokens fed in the first forward (>= 1); their predictions are scored
            from the prefill logits, the rest one step at a time through the cache.
        num_bytes: Bytes of text the predicted tokens stand for; None = count the
            predicted ids below 256 (the byte tokenizer: id == byte).
        progress: Called with the number of forwards after each one.
        score_prefill: False scores only the tokens predicted one step at a time
            (what decode-only settings such as `attention_budget` change).

    Returns:
        The window's :class:`PplResult`.
    """
    import torch

    ids = _as_ids(window)
    n = ids.numel()
    if n < 2:
        raise ConfigError.field("context", n, "a window needs at least 2 tokens")
    prefill = max(1, min(prefill, n - 1))
    _use_attention_for(model, cache)
    targets = ids[1:]
    nll = 0.0
    argmax: list[int] = []
    device = next(model.parameters()).device
    with torch.inference_mode():
        pos = 0
        while pos < n - 1:
            step = prefill if pos == 0 else 1
            chunk = ids[pos : pos + step].to(device)[None]
            logits = model(input_ids=chunk, cache=cache, use_cache=True).logits[0].float()
            tgt = targets[pos : pos + step].to(device)
            if pos or score_prefill:
                nll += float(torch.nn.functional.cross_entropy(logits, tgt, reduction="sum"))
                argmax.extend(logits.argmax(dim=-1).tolist())
            pos += step
            if progress is not None:
                progress(1)
    scored = targets if score_prefill else targets[prefill:]
    if num_bytes is None:
        num_bytes = int((scored < 256).sum())
    return PplResult(nll, scored.numel(), num_bytes, argmax)


def perplexity(
    model: PreTrainedModel,
    token_ids: Any,
    cache_factory: CacheFactory,
    context: int,
    *,
    prefill: int = 1,
    bytes_of: Callable[[list[int]], int] | None = None,
    progress: Progress | None = None,
    score_prefill: bool = True,
) -> PplResult:
    """Teacher-forced perplexity of a token stream through a cache, window by window.

    The stream is cut into consecutive windows of `context` tokens (a shorter tail is
    dropped unless it is the only window); each window gets a fresh cache from
    `cache_factory(len(window))` and is scored by :func:`window_perplexity`.

    Args:
        model: A causal LM.
        token_ids: 1-D token ids.
        cache_factory: Builds an empty cache for a window of the given length.
        context: Window length in tokens (>= 2).
        prefill: Tokens of each window fed in one first forward.
        bytes_of: Bytes of text of a list of predicted ids; None = ids below 256.
        progress: Called with 1 after each forward.
        score_prefill: see :func:`window_perplexity`.

    Returns:
        The summed :class:`PplResult` of all windows.
    """
    ids = _as_ids(token_ids)
    if isinstance(context, bool) or not isinstance(context, int) or context < 2:
        raise ConfigError.field("context", context, "a window length of at least 2 tokens")
    starts = list(range(0, ids.numel() - context + 1, context)) or [0]
    total = PplResult(0.0, 0, 0, [])
    for start in starts:
        window = ids[start : start + context]
        first = 1 if score_prefill else 1 + max(1, min(prefill, window.numel() - 1))
        num_bytes = bytes_of(window[first:].tolist()) if bytes_of is not None else None
        cache = cache_factory(window.numel())
        try:
            result = window_perplexity(
                model,
                window,
                cache,
                prefill=prefill,
                num_bytes=num_bytes,
                progress=progress,
                score_prefill=score_prefill,
            )
        finally:
            if hasattr(cache, "close"):  # a TieredCache releases its tiers (disk files)
                cache.close()
        total = total.merged(result)
    return total


def exact_cache_factory(model: PreTrainedModel) -> CacheFactory:
    """The reference cache: transformers' DynamicCache (attended with sdpa).

    Args:
        model: The model whose config sizes the cache.

    Returns:
        A factory of empty DynamicCaches.
    """
    from transformers import DynamicCache

    return lambda _tokens: DynamicCache(config=model.config)


def tiered_cache_factory(model: PreTrainedModel, **cache_kwargs: Any) -> CacheFactory:
    """A factory of TieredCaches with these CacheConfig fields; `max_tokens` defaults to
    the window length. A `disk_dir` is a parent: each cache gets a fresh subdirectory, so
    windows neither share nor reopen each other's durable disk blocks.

    Args:
        model: The model whose config gives the geometry.
        **cache_kwargs: CacheConfig fields (placement, codecs, residual window ...).

    Returns:
        A factory of empty TieredCaches.
    """
    CacheConfig(**{"max_tokens": 2, **cache_kwargs})  # validate now, not mid-run
    counter = itertools.count()

    def make(tokens: int) -> Cache:
        kwargs = {"max_tokens": tokens, **cache_kwargs}
        if kwargs.get("disk_dir") is not None:
            kwargs["disk_dir"] = str(Path(kwargs["disk_dir"]) / f"cache-{next(counter)}")
        return TieredCache(model.config, **kwargs)

    return make


def top1_agreement(reference: Sequence[int], other: Sequence[int]) -> float:
    """Fraction of positions where two runs predict the same top-1 token.

    Args:
        reference: Argmax ids of the reference run.
        other: Argmax ids of the compared run (same positions).

    Returns:
        A fraction in [0, 1].
    """
    if len(reference) != len(other):
        raise ValueError(f"argmax lists differ in length: {len(reference)} vs {len(other)}")
    if not reference:
        return float("nan")
    same = sum(1 for a, b in zip(reference, other, strict=True) if a == b)
    return same / len(reference)


def compare(
    model: PreTrainedModel,
    windows: Sequence[Any],
    configs: dict[str, dict[str, Any]],
    context: int,
    *,
    prefill: int = 1,
    bytes_of: Callable[[list[int]], int] | None = None,
    progress: Progress | None = None,
    score_prefill: bool = True,
) -> Comparison:
    """Run the exact cache and every TieredCache configuration over the same windows.

    Args:
        model: A causal LM (fp32 for a meaningful "exact").
        windows: Token-id windows (each scored on its own, with a fresh cache).
        configs: name -> CacheConfig keyword fields.
        context: The window length the windows were cut at (reported; caches are sized
            to each window's length).
        prefill: Tokens of each window fed in one first forward.
        bytes_of: Bytes of text of a list of predicted ids; None = ids below 256.
        progress: Called with 1 after each forward, (1 + len(configs)) * sum(len - 1) in all.
        score_prefill: False scores only the tokens predicted one step at a time.

    Returns:
        A :class:`Comparison`: ΔPPL % = 100 * (ppl / exact ppl - 1), top-1 agreement
        with the exact run's argmax at every predicted position.
    """
    if not windows:
        raise ConfigError.field("windows", 0, "at least one window of held-out text")
    factories: dict[str, CacheFactory] = {EXACT: exact_cache_factory(model)}
    for name, kwargs in configs.items():
        if name == EXACT:
            raise ConfigError.field("config", name, f"{EXACT!r} is the reference's name")
        factories[name] = tiered_cache_factory(model, **kwargs)
    results = {name: PplResult(0.0, 0, 0, []) for name in factories}
    # Window-major order: every configuration sees window 1 before any sees window 2, so
    # an interrupted run still compares like with like.
    for window in windows:
        for name, factory in factories.items():
            results[name] = results[name].merged(
                perplexity(
                    model,
                    window,
                    factory,
                    _as_ids(window).numel(),
                    prefill=prefill,
                    bytes_of=bytes_of,
                    progress=progress,
                    score_prefill=score_prefill,
                )
            )
    exact = results.pop(EXACT)
    out = {}
    for name, res in results.items():
        out[name] = ConfigResult(
            name,
            dict(configs[name]),
            res,
            100.0 * (res.ppl / exact.ppl - 1.0),
            top1_agreement(exact.argmax_ids, res.argmax_ids),
        )
    # Leave the model as it came from the reference: plain sdpa.
    model.set_attn_implementation(REFERENCE_ATTENTION)
    return Comparison(context, len(windows), exact, out)


def heldout_stream(model: str | Path = "default", tokenizer: Any = None) -> list[int]:
    """The held-out text of a model as one token stream: its held-out files in order,
    each followed by <eos>, as the embedded model's trainer lays out its data.

    Args:
        model: ``"default"`` or a model directory with heldout_files.txt.
        tokenizer: Tokenizer to encode with; None = the byte tokenizer (id == byte).

    Returns:
        Token ids.
    """
    files = heldout_files(model)
    if not files:
        raise ConfigError.field(
            "model", str(model), "none of its held-out files exist on this machine"
        )
    eos = EOS_ID if tokenizer is None else tokenizer.eos_token_id
    stream: list[int] = []
    for path in files:
        data = path.read_bytes()
        if tokenizer is None:
            stream.extend(bytes_to_ids(data))
        else:
            text = data.decode("utf-8", "replace")
            # whole files may exceed the model's positions: they are cut into windows
            stream.extend(tokenizer.encode(text, add_special_tokens=False, verbose=False))
        if eos is not None:
            stream.append(eos)
    return stream


def heldout_windows(
    model: str | Path = "default", context: int = 2048, num_windows: int = 2, tokenizer: Any = None
) -> list[list[int]]:
    """The first `num_windows` non-overlapping windows of `context` tokens of held-out text.

    Deterministic: same files, same order, same cuts on every run.

    Args:
        model: ``"default"`` or a model directory with heldout_files.txt.
        context: Tokens per window (>= 2).
        num_windows: Windows wanted (>= 1).
        tokenizer: See :func:`heldout_stream`.

    Returns:
        The windows.
    """
    if isinstance(context, bool) or not isinstance(context, int) or context < 2:
        raise ConfigError.field("context", context, "a window length of at least 2 tokens")
    if isinstance(num_windows, bool) or not isinstance(num_windows, int) or num_windows < 1:
        raise ConfigError.field("windows", num_windows, "a number of windows >= 1")
    stream = heldout_stream(model, tokenizer)
    available = len(stream) // context
    if available < num_windows:
        raise ConfigError.field(
            "windows",
            num_windows,
            f"the held-out text has {len(stream)} tokens: at most {available} windows "
            f"of {context} tokens",
        )
    return [stream[i * context : (i + 1) * context] for i in range(num_windows)]


# Below this many parameters a one-token forward is a few hundred small ops: dispatch,
# not arithmetic, dominates, and a second thread only adds synchronisation (measured on
# kvstrata-code-tiny, 2 cores: several times slower with 2 threads on a busy machine;
# docs/MEASUREMENTS.md).
SMALL_MODEL_PARAMS = 100_000_000


def auto_threads(model: PreTrainedModel) -> int | None:
    """The torch thread count for token-by-token work on this model.

    Args:
        model: A model.

    Returns:
        1 for small models (see SMALL_MODEL_PARAMS), None (= keep torch's) otherwise.
    """
    num = sum(p.numel() for p in model.parameters())
    return 1 if num < SMALL_MODEL_PARAMS else None
