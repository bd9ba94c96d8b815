"""The per-layer objects a `TieredCache` hands to transformers: `TieredKV`, what
`update()` returns (this step's new K/V; the history stays in the tiers), and
`_TieredLayer`, the layer view transformers' generic `Cache` code iterates over."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvstrata.core.errors import UnsupportedModelError


@dataclass
class TieredKV:
    """What `update()` returns for one layer: the cache, the layer, and this step's
    new K/V ([B, Hkv, T, D]) — the history stays in the tiers."""

    cache: Cache  # the TieredCache
    layer_idx: int
    new_k: torch.Tensor
    new_v: torch.Tensor

    @property
    def shape(self) -> torch.Size:  # some callers look at key_states.shape[-2]
        b, h, _, d = self.new_k.shape
        return torch.Size((b, h, self.cache.get_seq_length(), d))

    @property
    def dtype(self) -> torch.dtype:
        return self.new_k.dtype

    @property
    def device(self) -> torch.device:
        return self.new_k.device

    def __getattr__(self, name: str):
        # Only reached for what a TieredKV does not have: a model whose attention code
        # treats the cached keys as a tensor (key.repeat, key.transpose, ...) is told so
        # in one line instead of an AttributeError deep inside its forward. (Dunders and
        # the fields of a half-built instance, e.g. while copying: plain AttributeError.)
        if name.startswith("__") or name in _FIELDS:
            raise AttributeError(name)
        raise CachedKVUsedAsTensorError.of(self, f"key_states.{name}")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        leaves = torch.utils._pytree.tree_leaves((args, kwargs or {}))
        handle = next((a for a in leaves if isinstance(a, cls)), None)
        name = getattr(func, "__name__", str(func))
        raise CachedKVUsedAsTensorError.of(handle, f"torch.{name}(key_states, ...)")


_FIELDS = frozenset(("cache", "layer_idx", "new_k", "new_v"))


class CachedKVUsedAsTensorError(UnsupportedModelError, AttributeError):
    """A model's own code used the handle `TieredCache.update` returns as a tensor."""

    @classmethod
    def of(cls, handle: TieredKV | None, use: str) -> CachedKVUsedAsTensorError:
        config = getattr(getattr(handle, "cache", None), "model_config", None)
        model_type = getattr(config, "model_type", "?")
        return cls(
            f"model_type={model_type!r} uses the cached K/V as tensors ({use}) outside "
            "the attention function: TieredCache keeps the history in its tiers and serves "
            "only models whose attention reads K/V through transformers' AttentionInterface"
        )


class _TieredLayer(CacheLayerMixin):
    """Per-layer view transformers' generic Cache code iterates over."""

    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(self, cache: Cache, layer_idx: int, sliding: bool) -> None:
        super().__init__()
        self._cache = weakref.proxy(cache)  # no cycle: a dropped cache goes at once
        self.layer_idx = layer_idx
        self.is_sliding = sliding

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):  # pragma: no cover - via cache
        return self._cache.update(key_states, value_states, self.layer_idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._cache.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self._cache.get_seq_length()

    def get_max_length(self) -> int:
        return -1

    # The cache-level reset/crop act on all layers at once (blocks span layers).
    def reset(self) -> None:
        pass

    def crop(self, tokens_to_remove: int) -> None:
        pass

    @property
    def is_initialized(self) -> bool:  # type: ignore[override]
        return self._cache.is_initialized

    @is_initialized.setter
    def is_initialized(self, value: bool) -> None:
        pass
