"""The accepted values of query-aware key selection's CacheConfig fields (`attention_*`),
checked in `CacheConfig.__post_init__`: one line per bad value, naming the field."""

from __future__ import annotations

from typing import Any

from kvstrata.core.errors import ConfigError
from kvstrata.core.units import parse_fraction, parse_tokens

ATTENTION_SUMMARIES = ("minmax", "mean")
# how a KV head scores a page from its query heads' scores: the best one's, or their sum
ATTENTION_SCORES = ("max", "sum")
ATTENTION_PAGE_MAX = 256
# what predicts the next decode step's units in staged tiers (attention/selection/prefetch)
ATTENTION_PREFETCH = ("off", "last", "learned")
ATTENTION_BUDGET_HELP = (
    "None (exact attention), a token count such as 1024 or '1k', or a fraction of each "
    "sequence's context in (0, 1) such as 0.125 or '12.5%'"
)
DENSE_LAYERS_HELP = "first layers attended in full: an int >= 0 such as 2 (0: all select)"
PAGE_HELP = f"keys per scored page: an int from 1 to {ATTENTION_PAGE_MAX} such as 4 or 8"
COARSE_HELP = (
    f"pages per group summary: 0 (score every page) or an int from 2 to {ATTENTION_PAGE_MAX} "
    "such as 16"
)
REFINE_HELP = "groups refined per page chosen: a number >= 1 such as 2"
CHANNELS_MAX = 1024
CHANNELS_HELP = (
    f"query channels each row scores pages over: 0 (all) or an int from 1 to {CHANNELS_MAX} "
    "such as 16 (more than the head dim: all)"
)


def check_choice(field: str, value: Any, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ConfigError.field(field, value, f"one of {', '.join(choices)}")


def check_budget(value: Any) -> int | float | None:
    """attention_budget as tokens (int >= 1) or a fraction (float in (0, 1)), or None."""
    if value is None:
        return None
    text = value.strip() if isinstance(value, str) else ""
    try:
        if isinstance(value, float) or text.endswith("%") or "." in text:
            frac = parse_fraction(value, "attention_budget")
            if frac < 1:
                return frac
        else:
            return parse_tokens(value, "attention_budget")
    except ConfigError:
        pass
    raise ConfigError.field("attention_budget", value, ATTENTION_BUDGET_HELP)


def check_selection(summary: Any, score: Any, page: Any, dense: Any) -> None:
    """ConfigError for a bad attention_summary, attention_score, attention_page or
    attention_dense_layers."""
    check_choice("attention_summary", summary, ATTENTION_SUMMARIES)
    check_choice("attention_score", score, ATTENTION_SCORES)
    if type(page) is not int or not 1 <= page <= ATTENTION_PAGE_MAX:
        raise ConfigError.field("attention_page", page, PAGE_HELP)
    if type(dense) is not int or dense < 0:
        raise ConfigError.field("attention_dense_layers", dense, DENSE_LAYERS_HELP)


def check_two_level(coarse: Any, refine: Any) -> float:
    """attention_refine as a float; ConfigError for a bad attention_coarse or
    attention_refine."""
    if type(coarse) is not int or coarse == 1 or not 0 <= coarse <= ATTENTION_PAGE_MAX:
        raise ConfigError.field("attention_coarse", coarse, COARSE_HELP)
    ok = isinstance(refine, int | float) and not isinstance(refine, bool)
    if not ok or not 1 <= refine < float("inf"):  # NaN fails the comparison too
        raise ConfigError.field("attention_refine", refine, REFINE_HELP)
    return float(refine)


def check_channels(channels: Any) -> None:
    """ConfigError for a bad attention_channels."""
    if type(channels) is not int or not 0 <= channels <= CHANNELS_MAX:
        raise ConfigError.field("attention_channels", channels, CHANNELS_HELP)
