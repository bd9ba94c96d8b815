"""Greedy decoding through a cache, and how far it agrees with the exact cache.

Teacher-forced perplexity (:mod:`kvstrata.quality.evaluate`) scores each prediction on the true
history; free-running greedy decoding feeds the model its own tokens, so one changed token
changes everything after it. :func:`greedy_agreement` decodes the same prompts with the
exact cache (transformers' ``DynamicCache`` + ``sdpa``) and with each kvstrata
configuration and reports, per configuration, how many runs were identical and how many
tokens each kept before its first divergence::

    report = greedy_agreement(model, prompts, {"int8": dict(host_codec="int8", ...)}, 256)
    report.rows["int8"].identical_runs, report.rows["int8"].mean_prefix

Pure functions: no printing; progress goes through an optional callback.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstrata.core.errors import ConfigError
from kvstrata.quality.evaluate import (
    EXACT,
    REFERENCE_ATTENTION,
    Progress,
    _use_attention_for,
    exact_cache_factory,
    tiered_cache_factory,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.cache_utils import Cache


def greedy_tokens(
    model: PreTrainedModel,
    prompt_ids: Sequence[int] | Any,
    cache: Cache,
    max_new: int,
    *,
    stop_ids: Sequence[int] = (),
    stop: Callable[[list[int]], bool] | None = None,
) -> list[int]:
    """Greedy decoding with `cache`: one prefill forward, then one token per forward.

    Args:
        model: A causal LM (its attention is switched to what `cache` needs).
        prompt_ids: 1-D token ids (at least 1).
        cache: A fresh, empty cache.
        max_new: Tokens to generate at most (>= 1).
        stop_ids: Token ids that end the generation (kept in the output), e.g. <eos>.
        stop: Called with the tokens so far after each one; True ends the generation.

    Returns:
        The new tokens.
    """
    import torch

    ids = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(1, -1)
    if ids.shape[1] < 1 or max_new < 1:
        raise ConfigError.field("prompt", ids.shape[1], "at least one prompt and one new token")
    _use_attention_for(model, cache)
    device = next(model.parameters()).device
    out: list[int] = []
    stops = set(stop_ids)
    with torch.inference_mode():
        step = ids.to(device)
        while True:
            logits = model(input_ids=step, cache=cache, use_cache=True, logits_to_keep=1).logits
            token = int(logits[0, -1].argmax())
            out.append(token)
            if len(out) >= max_new or token in stops or (stop is not None and stop(out)):
                return out
            step = torch.tensor([[token]], device=device)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """Index of the first position where two token lists differ (the shorter length if
    one is a prefix of the other)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


@dataclass
class AgreementRow:
    """One configuration's greedy runs against the exact runs of the same prompts.

    Fields:
        name: the configuration.
        cache_kwargs: its CacheConfig fields.
        prefixes: per prompt, the tokens it generated before its first divergence from the
            exact run (its full length when identical).
        lengths: per prompt, the exact run's length.
        identical: per prompt, whether the whole run equals the exact one.
    """

    name: str
    cache_kwargs: dict[str, Any]
    prefixes: list[int]
    lengths: list[int]
    identical: list[bool]

    @property
    def identical_runs(self) -> int:
        return sum(self.identical)

    @property
    def mean_prefix(self) -> float:
        """Mean tokens before the first divergence."""
        return sum(self.prefixes) / len(self.prefixes) if self.prefixes else float("nan")

    @property
    def agreement(self) -> float:
        """Fraction of the exact runs' tokens reproduced before the first divergence."""
        total = sum(self.lengths)
        return sum(self.prefixes) / total if total else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "cache": {k: v for k, v in self.cache_kwargs.items() if k != "extra"},
            "identical_runs": self.identical_runs,
            "runs": len(self.identical),
            "prefixes": self.prefixes,
            "mean_prefix": self.mean_prefix,
            "agreement": self.agreement,
        }


@dataclass
class AgreementReport:
    """What :func:`greedy_agreement` returns."""

    prompt_tokens: list[int]
    max_new: int
    exact_lengths: list[int]
    rows: dict[str, AgreementRow]

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "max_new": self.max_new,
            "exact_lengths": self.exact_lengths,
            "configs": [r.to_dict() for r in self.rows.values()],
        }


def greedy_agreement(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    configs: dict[str, dict[str, Any]],
    max_new: int,
    *,
    stop_ids: Sequence[int] = (),
    progress: Progress | None = None,
) -> AgreementReport:
    """Decode every prompt greedily with the exact cache and with each configuration.

    Args:
        model: A causal LM (fp32 for a meaningful "exact").
        prompts: Token-id prompts.
        configs: name -> CacheConfig fields (max_tokens defaults to prompt + max_new).
        max_new: Tokens to generate per prompt.
        stop_ids: Token ids that end a run (e.g. <eos>).
        progress: Called with 1 after each run (prompts x (1 + configs) in all).

    Returns:
        An :class:`AgreementReport`.
    """
    if not prompts:
        raise ConfigError.field("prompts", 0, "at least one prompt")
    factories = {EXACT: exact_cache_factory(model)}
    for name, kwargs in configs.items():
        if name == EXACT:
            raise ConfigError.field("config", name, f"{EXACT!r} is the reference's name")
        factories[name] = tiered_cache_factory(model, **kwargs)
    runs: dict[str, list[list[int]]] = {name: [] for name in factories}
    # Prompt-major: every configuration sees prompt 1 before any sees prompt 2.
    for prompt in prompts:
        for name, factory in factories.items():
            cache = factory(len(prompt) + max_new)
            try:
                runs[name].append(greedy_tokens(model, prompt, cache, max_new, stop_ids=stop_ids))
            finally:
                if hasattr(cache, "close"):
                    cache.close()
            if progress is not None:
                progress(1)
    model.set_attn_implementation(REFERENCE_ATTENTION)
    exact = runs.pop(EXACT)
    rows = {}
    for name, outs in runs.items():
        rows[name] = AgreementRow(
            name,
            dict(configs[name]),
            [first_difference(e, o) for e, o in zip(exact, outs, strict=True)],
            [len(e) for e in exact],
            [e == o for e, o in zip(exact, outs, strict=True)],
        )
    return AgreementReport([len(p) for p in prompts], max_new, [len(e) for e in exact], rows)
