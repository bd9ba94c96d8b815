"""`TieredCache(...)`'s own arguments, checked before anything is built: the adapter owns
them (the CacheConfig fields are checked by CacheConfig itself)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kvstrata.config import check_cache_config, check_field_names
from kvstrata.core.errors import ConfigError
from kvstrata.store.kvstore import KVStore

STORE_KEYWORDS = ("model_key", "prefix_caching")  # KVStore keywords TieredCache passes on


def check_tiered_cache_args(
    model_config: Any,
    cache_config: Any,
    fields: Mapping[str, Any],
    *,
    store: Any = None,
    prompt_ids: Any = None,
    salt: Any = "",
    dtype: Any = None,
) -> None:
    """Check `TieredCache(...)`'s arguments before anything is built (ConfigError, one
    line): the model config, a CacheConfig (not a str or dict), known field names
    (closest one suggested), dtype, store, salt, the KVStore keywords, and prompt ids
    (integers, [batch, tokens], within the vocabulary and the model's positions)."""
    if model_config is None or isinstance(model_config, str | bytes | int | float | dict | list):
        raise ConfigError.field("config", model_config, "the model's config (model.config)")
    check_cache_config(cache_config)
    check_field_names(fields, ("store", "prompt_ids", "salt", "dtype", *STORE_KEYWORDS))
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise ConfigError.field("dtype", dtype, "a torch.dtype such as torch.float16, or None")
    if store is not None and not isinstance(store, KVStore):
        raise ConfigError.field("store", store, "a kvstrata KVStore to share, or None")
    if not isinstance(salt, str):
        raise ConfigError.field("salt", salt, "a string naming the tenant ('' = shared)")
    if fields.get("model_key") is not None and not isinstance(fields["model_key"], str):
        raise ConfigError.field("model_key", fields["model_key"], "a string, or None")
    if not isinstance(fields.get("prefix_caching", True), bool):
        raise ConfigError.field("prefix_caching", fields["prefix_caching"], "True or False")
    if prompt_ids is not None:
        _check_prompt_ids(prompt_ids, model_config)


def _check_prompt_ids(prompt_ids: Any, model_config: Any) -> None:
    accepted = "token ids: a tensor or list of ints, [tokens] or [batch, tokens]"
    try:
        ids = torch.as_tensor(prompt_ids)
    except (TypeError, ValueError, RuntimeError):
        raise ConfigError.field("prompt_ids", prompt_ids, accepted) from None
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ConfigError.field("prompt_ids", prompt_ids, accepted)
    if ids.ndim not in (1, 2) or ids.numel() == 0:
        return  # the shape is refused where the ids are read (names the shape)
    vocab = getattr(model_config, "vocab_size", None)
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or (isinstance(vocab, int) and high >= vocab):
        bad = low if low < 0 else high
        accepted = "ids >= 0"
        if isinstance(vocab, int):
            accepted = f"ids from 0 to {vocab - 1} (vocab_size)"
        raise ConfigError.field("prompt_ids", f"... {bad} ...", accepted)
    limit = getattr(model_config, "max_position_embeddings", None)
    if isinstance(limit, int) and ids.shape[-1] > limit:
        raise ConfigError.field(
            "prompt_ids",
            f"{ids.shape[-1]} tokens",
            f"at most the model's max_position_embeddings ({limit})",
        )
