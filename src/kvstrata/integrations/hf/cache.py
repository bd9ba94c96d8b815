"""transformers 5.x integration: `TieredCache`, a transformers `Cache` over a KVStore.

    kvstrata.enable(model)                              # registers the attention
    cache = kvstrata.TieredCache(model.config, resident_fraction=0.1, host_budget="4GiB")
    out = model.generate(ids, cache=cache, max_new_tokens=256)

`TieredCache` is a thin adapter over a `kvstrata.KVStore` (tiers, placement, prefix
index). `update()` stores the new K/V in blocks and returns a handle (`TieredKV`),
which transformers passes untouched to the attention function registered by `enable`
(integrations/hf/attention.py); that function attends over the handle's runs of
blocks, tier by tier (kvstrata.attention.runtime). `enable`'s forward hooks hand each
forward's input ids to the cache, so its full blocks are content-addressed and shared.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
from transformers.cache_utils import Cache

from kvstrata.attention.runtime import RowMask
from kvstrata.attention.writes import write_layer, write_plan
from kvstrata.blocks.manager import BlockManager
from kvstrata.config import CacheConfig
from kvstrata.core.errors import ConfigError, KvstrataError, UnsupportedModelError
from kvstrata.core.layout import BlockLayout
from kvstrata.core.units import parse_size
from kvstrata.integrations.hf.args import check_tiered_cache_args
from kvstrata.integrations.hf.layers import TieredKV, _TieredLayer
from kvstrata.model.dtypes import DTYPES, dtype_name
from kvstrata.model.geometry import KVGeometry
from kvstrata.model.support import check_cacheable
from kvstrata.store.kvstore import KVStore

# Chunked attention (Llama 4) has its own mask semantics, not implemented: refused.


class TieredCache(Cache):
    """A transformers `Cache` whose K/V live in kvstrata blocks across tiers.

    A thin adapter over a `KVStore`: batch row b is store sequence `seq_ids[b]`.
    By default the cache owns a store of its own (built from `cache_config`);
    give `store=` to share one store (budgets and prefix cache) between caches.

    Args:
        config: the model's `PretrainedConfig` (geometry, sliding layers).
        cache_config: a `CacheConfig`; or give its fields as keyword arguments.
        store: a shared KVStore (then no cache_config / fields).
        prompt_ids: the prompt ([B, n] or a list); the longest prefix found in the
            store is attached, `matched_tokens` says how long, and `generate`
            computes only the rest.
        salt: tenant salt for prefix sharing (different salts never share).
        dtype: the model's KV dtype, to open the store before the first forward when
            `prompt_ids` is given (default: the config's dtype, else float32).
    """

    is_compileable = False
    # Decode on the CPU through kvstrata/platform/csrc/attention.cpp when it is available
    # (set False on an instance before its first update to use the torch partials).
    native_attention = True

    def __init__(
        self,
        config: Any,
        cache_config: CacheConfig | None = None,
        *,
        store: KVStore | None = None,
        prompt_ids: Any = None,
        salt: str = "",
        dtype: torch.dtype | None = None,
        **kwargs: Any,
    ) -> None:
        # Arguments checked before anything is built (one-line ConfigErrors).
        check_tiered_cache_args(
            config, cache_config, kwargs, store=store, prompt_ids=prompt_ids, salt=salt, dtype=dtype
        )
        if not isinstance(config, KVGeometry):
            check_cacheable(config)
        if store is None:
            store = KVStore(config, cache_config, **kwargs)
            self._owns_store = True
        elif cache_config is not None or kwargs:
            raise ConfigError.field(
                "cache_config", cache_config or kwargs, "a shared store brings its own config"
            )
        else:
            self._owns_store = False
        self.store = store
        self.cache_config = store.config
        self.model_config = config
        self.num_layers = store.geometry.num_layers  # layers that cache K/V
        # the step ends after this layer's attention (later layers may reuse K/V)
        self.last_attention_layer = store.geometry.attention_layers - 1
        self.salt = salt
        sliding = [store.groups[g].is_sliding for g, _ in store.layer_map]
        super().__init__(layers=[_TieredLayer(self, i, s) for i, s in enumerate(sliding)])
        self.seq_ids: list[int] = []  # mutated in place: the finalizer below holds it
        if self._owns_store:  # a cache dropped without close() closes its store
            weakref.finalize(self, _close_dropped, store)
        else:  # ... or gives its sequences back to the shared store
            weakref.finalize(self, _free_sequences, store, self.seq_ids)
        self._writes: list[list[tuple]] = []
        self._mask_key: tuple | None = None
        self._row_masks: list[RowMask] | None = None
        self._next_ids: torch.Tensor | None = None
        self._in_forward = False  # between the forward hooks `enable` installs
        self._forward_start: dict[int, int] | None = None  # lengths when it started
        self.matched_tokens = 0
        self._built_for: tuple | None = None
        self._rest_of_prompt: torch.Tensor | None = None
        if prompt_ids is not None:
            self._start_from_prompt(prompt_ids, dtype)

    @classmethod
    def from_store(
        cls, store: KVStore, prompt_ids: Any = None, salt: str = "", dtype: Any = None
    ) -> TieredCache:
        """A cache over a shared `store`; with `prompt_ids`, starting from the prompt's
        cached prefix (see `matched_tokens`). `dtype`: the model's KV dtype when the
        store is not built yet (default: the config's)."""
        return cls(store.geometry, store=store, prompt_ids=prompt_ids, salt=salt, dtype=dtype)

    def _start_from_prompt(self, prompt_ids: Any, dtype: torch.dtype | None) -> None:
        rows = torch.as_tensor(prompt_ids)
        if rows.ndim == 1:
            rows = rows[None]
        if rows.ndim != 2 or rows.is_floating_point():
            raise ConfigError.field("prompt_ids", tuple(rows.shape), "token ids [batch, tokens]")
        store = self.store
        if not store.is_built:
            dtype = dtype or _config_dtype(self.model_config)
            store.build(dtype, num_sequences=rows.shape[0], native=self.native_attention)
        matched = []
        for row in rows.tolist():
            seq_id, n = store.add_sequence(row, salt=self.salt)
            self.seq_ids.append(seq_id)
            matched.append(n)
        keep = min(matched)
        for seq_id, n in zip(self.seq_ids, matched, strict=True):
            if n > keep:
                store.truncate(seq_id, keep)
        self.matched_tokens = keep
        self._rest_of_prompt = rows[:, keep:]  # what the first forward must feed

    @property
    def manager(self) -> BlockManager:
        if not self.store.is_built:
            raise RuntimeError("TieredCache is empty: run a forward pass first")
        return self.store.checked_manager()

    @property
    def layout(self) -> BlockLayout:
        return self.store.layout

    # -- transformers Cache API --------------------------------------------------------------
    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[TieredKV, TieredKV]:
        """Store this step's K/V of one layer; return handles for the attention. If
        anything fails, the step is undone (the cache is as before the forward)."""
        try:
            return self._update(key_states, value_states, layer_idx)
        except BaseException:
            self.abort_step()
            raise

    def _update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
    ) -> tuple[TieredKV, TieredKV]:
        store = self.store
        batch, heads, num_new, _ = key_states.shape
        if layer_idx == 0 and self._in_forward and self._forward_start is None:
            self._forward_start = {s: store.num_tokens(s) for s in self.seq_ids}
        if value_states.shape[:3] != key_states.shape[:3]:
            raise UnsupportedModelError(
                f"model_type={getattr(self.model_config, 'model_type', '?')!r}: layer "
                f"{layer_idx} gives keys of shape {tuple(key_states.shape)} and values of "
                f"shape {tuple(value_states.shape)}: TieredCache needs the same batch, "
                "heads and tokens in both"
            )
        if layer_idx == 0:
            shape = _kv_shape(key_states, value_states)
            if shape != self._built_for:  # builds the store, or checks its layout
                store.build(*shape, num_sequences=batch, native=self.native_attention)
                self._built_for = shape
            if not self.seq_ids:
                self.seq_ids[:] = [store.add_sequence(salt=self.salt)[0] for _ in range(batch)]
            if len(self.seq_ids) != batch:
                raise ConfigError.field(
                    "batch", batch, f"this cache holds {len(self.seq_ids)} sequences"
                )
            ids = self._next_ids
            self._next_ids = None
            known = ids is not None and tuple(ids.shape) == (batch, num_new)
            tokens = ids.tolist() if known else None
            rest, self._rest_of_prompt = self._rest_of_prompt, None
            if tokens is not None and rest is not None and rest[:, :num_new].tolist() != tokens:
                raise ConfigError.field(
                    "input_ids",
                    "not the prompt_ids the cache was created with",
                    "pass the same prompt to TieredCache(prompt_ids=) and to generate(); "
                    "the reused prefix belongs to that prompt",
                )
            store.adapt()  # budgets under memory pressure (host_pressure), between steps
            writes = store.extend(self.seq_ids, num_new, tokens)
            self._writes = [write_plan(store.runtime, w, batch) for w in writes]
            self._mask_key = None  # a new forward: its padding mask is analysed afresh
        elif _kv_shape(key_states, value_states) != self._built_for:
            raise UnsupportedModelError(
                f"model_type={getattr(self.model_config, 'model_type', '?')!r}: layer "
                f"{layer_idx} gives K/V of (dtype, kv heads, k dim, v dim) = "
                f"{_kv_shape(key_states, value_states)} where layer 0 gave "
                f"{self._built_for}: TieredCache stores one K/V shape for every layer"
            )
        group, local = store.layer_map[layer_idx]
        write_layer(self._writes[group], local, key_states, value_states)
        handle = TieredKV(self, layer_idx, key_states, value_states)
        return handle, handle

    def observe_input_ids(self, input_ids: torch.Tensor | None) -> None:
        """The token ids of the next forward (set by the hook `enable` installs):
        they name the cache's full blocks for prefix reuse."""
        self._next_ids = input_ids

    def forward_begins(self) -> None:
        """A forward over this cache starts (pre-hook). If the previous one never ended
        (an exception the forward hook does not see, e.g. KeyboardInterrupt), its
        tokens are undone first."""
        if self._in_forward:
            self.abort_step()
        self._in_forward, self._forward_start = True, None

    def forward_ends(self, failed: bool) -> None:
        """The forward returned (or raised: `failed`): a failed one is undone, also
        after its last layer (e.g. an error in the output head)."""
        if failed:
            self.abort_step()
        self._in_forward, self._forward_start = False, None

    def abort_step(self) -> None:
        """Undo this cache's step in progress (see `KVStore.abort_step`), or, when its
        forward failed after the last layer, cut the sequences back to the lengths
        they had when the forward started."""
        store = self.store
        start, self._forward_start = self._forward_start, None
        if not (store.is_built and not store.closed and self.seq_ids and store.is_user_thread):
            return
        store.abort_step([s for s in self.seq_ids if store.has_sequence(s)])
        if start:
            store.rewind({s: n for s, n in start.items() if store.has_sequence(s)})

    def step_done(self) -> None:
        """Called after the last layer's attention of a forward."""
        self.store.step_done(self.seq_ids)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if not self.seq_ids or not self.store.has_sequence(self.seq_ids[0]):
            return 0
        return self.store.num_tokens(self.seq_ids[0])

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def is_initialized(self) -> bool:  # type: ignore[override]
        return self.store.is_built and bool(self.seq_ids)

    @property
    def batch_size(self) -> int:  # type: ignore[override]
        return len(self.seq_ids)

    def reset(self) -> None:
        for seq_id in self.seq_ids:
            self.store.free(seq_id)
        self.seq_ids.clear()

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` tokens (transformers 5 passes a negative
        count; a positive value is the legacy "keep this many")."""
        for seq_id in self.seq_ids:
            n = self.store.num_tokens(seq_id)
            keep = n + tokens_to_remove if tokens_to_remove <= 0 else min(n, tokens_to_remove)
            self.store.truncate(seq_id, max(keep, 0))

    def _remap(self, sources: list[int]) -> None:
        if self.seq_ids:
            self.seq_ids[:] = self.store.remap(self.seq_ids, sources)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._remap([int(i) for i in beam_idx.tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._remap([b for b in range(len(self.seq_ids)) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._remap([int(i) for i in torch.as_tensor(indices).tolist()])

    # -- attention -----------------------------------------------------------------------------
    def _row_mask(self, attention_mask: torch.Tensor | None, batch: int) -> list[RowMask] | None:
        if attention_mask is None:
            return None
        # id() alone can be reused by the next step's mask once the old one is freed
        key = (id(attention_mask), tuple(attention_mask.shape))
        if key != self._mask_key:
            rows = []
            for b in range(batch):
                valid = attention_mask[b].bool()
                first = int(valid.int().argmax()) if bool(valid.any()) else valid.shape[0]
                prefix = bool(valid[first:].all())
                rows.append(RowMask(first, None if prefix else valid))
            self._mask_key, self._row_masks = key, rows
        return self._row_masks

    def set_budget(self, tier: str, budget: int | str) -> None:
        """Change a tier's budget at run time (the seed's dynamic offload ratio), in
        bytes ("256MiB") of that tier's stored blocks; at most the arena it was built
        with. Blocks over budget move down now."""
        mgr = self.manager
        tiers = mgr.state.tiers
        if tier not in tiers:
            raise ConfigError.field("tier", tier, f"one of {', '.join(mgr.state.tier_order)}")
        nbytes = parse_size(budget, f"{tier}_budget", allow_zero=True)
        mgr.set_budget(tier, min(nbytes // tiers[tier].block_bytes, tiers[tier].num_slots))

    # -- reporting -----------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Tier occupancy, bytes moved per link, peak device bytes, staging size,
        prefix-cache counters (of the store, shared by every cache over it)."""
        stats = self.store.stats()
        if stats.get("initialized"):
            stats["tokens"] = {b: self.store.num_tokens(s) for b, s in enumerate(self.seq_ids)}
            stats["matched_tokens"] = self.matched_tokens
        return stats

    def close(self) -> None:
        """Free this cache's sequences (their hashed blocks stay cached); an owned
        store is closed too (hashed blocks persisted to its disk tier). Idempotent."""
        if self.store.closed:
            return
        # close() may come from another thread once the cache's user is done with it:
        # then a shared store frees the sequences in its own thread, at its next step
        self.store.release(list(self.seq_ids))
        self.seq_ids.clear()
        if self._owns_store:
            self.store.close()

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_dropped(store: KVStore) -> None:
    """Close the private store of a cache that was collected without close()."""
    try:
        store.close()
    except (KvstrataError, OSError) as err:  # e.g. its disk_dir was removed meanwhile
        warnings.warn(
            f"kvstrata: closing a dropped cache's store: {err}", RuntimeWarning, stacklevel=2
        )


def _free_sequences(store: KVStore, seq_ids: list[int]) -> None:
    store.release(list(seq_ids), defer=True)


def _kv_shape(k: torch.Tensor, v: torch.Tensor) -> tuple:
    return (k.dtype, k.shape[1], k.shape[-1], v.shape[-1])


def _config_dtype(config: Any) -> torch.dtype:
    """The KV dtype a config names (transformers config or KVGeometry), else float32."""
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype_name(dtype)][0] if dtype else torch.float32
    except (ConfigError, KeyError):
        return torch.float32
