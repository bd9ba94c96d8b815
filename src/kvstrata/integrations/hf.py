"""transformers 5.x integration: `TieredCache` + the "kvstrata" attention.

    kvstrata.enable(model)                              # registers the attention
    cache = kvstrata.TieredCache(model.config, resident_fraction=0.1, host_budget="4GiB")
    out = model.generate(ids, cache=cache, max_new_tokens=256)

`update()` stores the new K/V in blocks and returns a handle (`TieredKV`), which
transformers passes untouched to the attention function registered under
ATTENTION_NAME; that function attends over the handle's runs of blocks, tier by tier,
and merges the partials with log-sum-exp (kvstrata.attention). On the CPU a decode
step attends every run that can be read in place — raw arenas and int8/fp8/int4 host
blocks — in one native call (`native_attention`); only disk blocks (and lossy blocks
of codecs the kernel cannot read) go through the staging buffers. The mask function
registered under the same name hands over the 2-D padding mask instead of building
a dense 4-D mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface

from kvstrata import _native
from kvstrata.attention import (
    NATIVE_MAX_DIM,
    NATIVE_MAX_ROWS,
    encoded_field,
    masked_attention,
    merge_all,
    merge_sink,
    native_attention,
    pack_gqa,
    partial_attention,
    raw_field,
    unpack_gqa,
)
from kvstrata.blocks.manager import BlockManager, Run, TokenWrites
from kvstrata.codecs.registry import get_codec
from kvstrata.config import CacheConfig
from kvstrata.errors import ConfigError, UnsupportedModelError
from kvstrata.layout import BlockLayout
from kvstrata.policies.eviction import EvictionPolicy
from kvstrata.staging import Stager
from kvstrata.tiers.memory import DeviceTier, HostTier, MemoryTier, resolve_device
from kvstrata.units import format_bytes, parse_size

ATTENTION_NAME = "kvstrata"
SMALL_PART_TOKENS = 2048
# Chunked attention (Llama 4) has its own mask semantics, not implemented: refused.
_ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention"}


@dataclass
class TieredKV:
    """What `update()` returns for one layer: the cache, the layer, and this step's
    new K/V ([B, Hkv, T, D]) — the history stays in the tiers."""

    cache: TieredCache
    layer_idx: int
    new_k: torch.Tensor
    new_v: torch.Tensor

    @property
    def shape(self) -> torch.Size:  # some callers look at key_states.shape[-2]
        b, h, _, d = self.new_k.shape
        return torch.Size((b, h, self.cache.get_seq_length(), d))


@dataclass
class _RowMask:
    """Padding of one batch row: keys before `first_valid` are padding; `dense` is
    the full boolean key mask when padding is not a prefix."""

    first_valid: int
    dense: torch.Tensor | None


class _TieredLayer(CacheLayerMixin):
    """Per-layer view transformers' generic Cache code iterates over."""

    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(self, cache: TieredCache, layer_idx: int, sliding: bool) -> None:
        super().__init__()
        self._cache = cache
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
        return self._cache._manager is not None

    @is_initialized.setter
    def is_initialized(self, value: bool) -> None:
        pass


def _check_supported(config: Any) -> None:
    model_type = getattr(config, "model_type", "?")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"model_type={model_type!r}: encoder-decoder models (cross-attention caches) "
            "are not supported by TieredCache; use a decoder-only model"
        )
    layer_types = getattr(config, "layer_types", None) or []
    other = sorted({t for t in layer_types if t not in _ATTENTION_LAYER_TYPES})
    if other:
        raise UnsupportedModelError(
            f"model_type={model_type!r} has layers of type {other}: TieredCache serves "
            "softmax-attention layers only (no linear-attention / SSM state caches)"
        )
    for name in ("num_hidden_layers", "num_attention_heads"):
        if getattr(config, name, None) is None:
            raise UnsupportedModelError(
                f"model_type={model_type!r}: config has no {name}; cannot size the KV cache"
            )


class TieredCache(Cache):
    """A transformers `Cache` whose K/V live in kvstrata blocks across tiers.

    Args:
        config: the model's `PretrainedConfig` (geometry, sliding layers).
        cache_config: a `CacheConfig`; or give its fields as keyword arguments.
    """

    is_compileable = False
    # Decode on the CPU through kvstrata/native/attention.cpp when it is available
    # (set False on an instance before its first update to use the torch partials).
    native_attention = True

    def __init__(self, config: Any, cache_config: CacheConfig | None = None, **kwargs: Any) -> None:
        _check_supported(config)
        if cache_config is None:
            cache_config = CacheConfig(**kwargs)
        elif kwargs:
            cache_config = cache_config.replace(**kwargs)
        self.cache_config = cache_config
        self.model_config = config
        self.num_layers = int(config.num_hidden_layers)
        self.num_q_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_q_heads)
        self.head_dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // self.num_q_heads
        )
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * self.num_layers
        self.sliding_layers = [t == "sliding_attention" for t in layer_types]
        codecs = {}
        for field in ("device_codec", "host_codec", "disk_codec"):
            codecs[field] = get_codec(getattr(cache_config, field), field)
        if not codecs["device_codec"].lossless:
            raise ConfigError.field(
                "device_codec",
                cache_config.device_codec,
                "the device tier keeps full precision (it is the residual window); put "
                "lossy codecs on host_codec / disk_codec",
            )
        self._codecs = codecs
        self.policy = EvictionPolicy(cache_config.policy)
        self.device = resolve_device(cache_config.device)
        super().__init__(
            layers=[_TieredLayer(self, i, s) for i, s in enumerate(self.sliding_layers)]
        )
        self._manager: BlockManager | None = None
        self._writes: list = []
        self._mask_key: tuple | None = None
        self._row_masks: list[_RowMask] | None = None
        self._stager: Stager | None = None
        self._step_tokens = 0

    # -- construction of the tiers (lazy: dtype and device come with the first K/V) ----------
    def _build(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        cc = self.cache_config
        layout = BlockLayout(
            num_layers=self.num_layers,
            num_kv_heads=key_states.shape[1],
            head_dim=key_states.shape[-1],
            block_size=cc.block_size,
            dtype=key_states.dtype,
            v_head_dim=value_states.shape[-1],
        )
        self.layout = layout
        for codec in self._codecs.values():
            codec.validate(layout)
        dev_codec = self._codecs["device_codec"]
        dev_block = dev_codec.block_nbytes(layout)
        total_blocks = -(-cc.max_tokens // cc.block_size)
        if cc.device_budget is not None:
            dev_slots = cc.device_budget // dev_block
        elif cc.resident_fraction is not None:
            dev_slots = math.ceil(cc.resident_fraction * total_blocks)
        else:
            dev_slots = total_blocks + key_states.shape[0]
        # The residual window: the newest `residual_tokens` must fit on the device.
        min_slots = key_states.shape[0] * (
            1 + -(-cc.residual_tokens // cc.block_size) + -(-cc.sink_tokens // cc.block_size)
        )
        lossy_below = not (
            self._codecs["host_codec"].lossless and self._codecs["disk_codec"].lossless
        )
        if lossy_below and dev_slots < min_slots:
            raise ConfigError.field(
                "device_budget",
                format_bytes(dev_slots * dev_block),
                f"lossy lower tiers need the residual window ({cc.residual_tokens} tokens) "
                f"+ sinks + an open block per sequence on the device: at least "
                f"{format_bytes(min_slots * dev_block)}",
            )
        tiers: list = [DeviceTier(layout, dev_slots, dev_codec, device=str(self.device))]
        if cc.host_budget:
            host_codec = self._codecs["host_codec"]
            tiers.append(
                HostTier(layout, cc.host_budget // host_codec.block_nbytes(layout), host_codec)
            )
        if cc.disk_dir:
            from kvstrata.tiers.disk import DiskTier

            disk_codec = self._codecs["disk_codec"]
            tiers.append(
                DiskTier(
                    layout,
                    cc.disk_budget // disk_codec.block_nbytes(layout),
                    cc.disk_dir,
                    disk_codec,
                    compress=cc.disk_compress,
                    o_direct=cc.disk_o_direct,
                )
            )
        self._manager = BlockManager(layout, tiers, self.policy, sink_tokens=cc.sink_tokens)
        self._tiers = self._manager.tiers
        self._device_name = tiers[0].name
        # tiers whose raw arenas take token writes and zero-copy views directly
        self._arena_tiers = {t.name for t in tiers if isinstance(t, MemoryTier) and t.zero_copy}
        self._local = {
            t.name
            for t in tiers
            if isinstance(t, MemoryTier)
            and t.zero_copy
            and (
                t.device == self.device
                or cc.cold_attention == "local"
                or (cc.cold_attention == "auto" and self.device.type == "cpu")
            )
        }
        if cc.cold_attention == "stage":
            self._local = {self._device_name}
        # Decode steps on the CPU: one native call over every run readable in place,
        # quantized host blocks included (they are then never staged in decode).
        self._native: set[str] = set()
        if (
            self.native_attention
            and self.device.type == "cpu"
            and max(layout.head_dim, layout.dim_v) <= NATIVE_MAX_DIM
            and _native.available()
        ):
            self._native = {
                t.name for t in tiers if t.name in self._local and t.device.type == "cpu"
            }
            if cc.cold_attention != "stage":
                self._native |= {
                    t.name
                    for t in tiers
                    if isinstance(t, MemoryTier)
                    and t.device.type == "cpu"
                    and not t.zero_copy
                    and t.codec.attend_format("k", layout) is not None
                    and t.codec.attend_format("v", layout) is not None
                }
        staged = any(t.name not in self._local for t in tiers)
        self._stager = (
            # two buffers of at most the whole cache each: more could never be filled
            Stager(
                self._tiers,
                layout,
                self.device,
                min(cc.staging_tokens, 2 * -(-cc.max_tokens // cc.block_size) * cc.block_size),
                self._device_name,
            )
            if staged
            else None
        )

    @property
    def manager(self) -> BlockManager:
        if self._manager is None:
            raise RuntimeError("TieredCache is empty: run a forward pass first")
        return self._manager

    # -- transformers Cache API --------------------------------------------------------------
    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[TieredKV, TieredKV]:
        """Store this step's K/V of one layer; return handles for the attention."""
        if self._manager is None:
            self._build(key_states, value_states)
        batch, _, num_new, _ = key_states.shape
        mgr = self.manager
        if layer_idx == 0:
            for seq_id in range(batch):
                if not mgr.has_sequence(seq_id):
                    mgr.add_sequence(seq_id)
            self._writes = self._plan_writes(mgr.append(list(range(batch)), num_new), batch)
            self._mask_key = None  # a new forward: its padding mask is analysed afresh
            self._step_tokens = num_new
        self._write_layer(layer_idx, key_states, value_states)
        handle = TieredKV(self, layer_idx, key_states, value_states)
        return handle, handle

    def _plan_writes(self, writes: list[TokenWrites], batch: int) -> list[tuple]:
        """Turn the manager's token writes into what every layer of this step does,
        once per step: ("slice", tier, first, count) for a contiguous single-sequence
        write, ("rows", tier, rows, src) for scattered rows of an arena tier,
        ("blocks", tier, slots, src) for whole new blocks of an encoded tier."""
        plan: list[tuple] = []
        bs = self.layout.block_size
        for tw in writes:
            tier = self._tiers[tw.tier]
            src = tw.src.to(self.device)
            if tw.tier not in self._arena_tiers:
                plan.append(("blocks", tier, (tw.rows[::bs] // bs).tolist(), src))
            elif tw.contiguous is not None and batch == 1:
                plan.append(("slice", tier, *tw.contiguous))
            else:
                plan.append(("rows", tier, tw.rows.to(tier.device), src))
        return plan

    def _write_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        batch, heads, num_new, _ = k.shape
        flat_k = flat_v = None
        for kind, tier, a, b in self._writes:
            if kind == "slice":
                tier.k_arena[layer, :, a : a + b].copy_(k[0, :, :b])
                tier.v_arena[layer, :, a : a + b].copy_(v[0, :, :b])
                continue
            if flat_k is None:
                flat_k = k.transpose(0, 1).reshape(heads, batch * num_new, -1)
                flat_v = v.transpose(0, 1).reshape(heads, batch * num_new, -1)
            new_k, new_v = flat_k.index_select(1, b), flat_v.index_select(1, b)
            if kind == "rows":
                tier.k_arena[layer].index_copy_(1, a, new_k.to(tier.device))
                tier.v_arena[layer].index_copy_(1, a, new_v.to(tier.device))
            else:
                tier.write_layer(layer, a, new_k, new_v)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if self._manager is None or not self._manager.has_sequence(0):
            return 0
        return self._manager.num_tokens(0)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def is_initialized(self) -> bool:  # type: ignore[override]
        return self._manager is not None

    @property
    def batch_size(self) -> int:  # type: ignore[override]
        return len(self._manager.tables) if self._manager else 0

    def reset(self) -> None:
        if self._manager is not None:
            for seq_id in list(self._manager.tables):
                self._manager.free_sequence(seq_id)

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` tokens (transformers 5 passes a negative
        count; a positive value is the legacy "keep this many")."""
        if self._manager is None:
            return
        for seq_id in list(self._manager.tables):
            n = self._manager.num_tokens(seq_id)
            keep = n + tokens_to_remove if tokens_to_remove <= 0 else min(n, tokens_to_remove)
            self._manager.truncate(seq_id, max(keep, 0))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self._manager is not None:
            self._manager.remap([int(i) for i in beam_idx.tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self._manager is not None:
            n = len(self._manager.tables)
            self._manager.remap([b for b in range(n) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self._manager is not None:
            self._manager.remap([int(i) for i in torch.as_tensor(indices).tolist()])

    # -- attention -----------------------------------------------------------------------------
    def _row_mask(self, attention_mask: torch.Tensor | None, batch: int) -> list[_RowMask] | None:
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
                rows.append(_RowMask(first, None if prefix else valid))
            self._mask_key, self._row_masks = key, rows
        return self._row_masks

    def _parts(self, layer: int, seq_id: int, start: int, end: int, native: list | None = None):
        """(k, v) parts covering keys [start, end) of a sequence, in order.

        With a `native` list, runs the native kernel can read in place are appended
        to it as (tokens, K descriptor, V descriptor) instead of being yielded.

        Where the data may be attended in place, parts are zero-copy views of the
        arenas, and consecutive small ones (< SMALL_PART_TOKENS together, e.g. the
        sink block and the two halves of the device ring) are joined into one copy:
        a partial costs a kernel launch, thread synchronisation and a merge, more
        than copying a few blocks. Cold runs come through the stager's buffers; such
        a view is valid only until the generator resumes (the buffer is reused)."""
        pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        pending_tokens = 0

        def flush():
            if len(pending) == 1:
                return pending[0]
            return (
                torch.cat([k for k, _ in pending], dim=1),
                torch.cat([v for _, v in pending], dim=1),
            )

        runs = self.manager.runs(seq_id)
        then = self._next_layer_chunk(layer, seq_id, runs)
        for run in runs:
            lo = max(start, run.token_start)
            hi = min(end, run.token_start + run.num_tokens)
            if lo >= hi:
                continue
            if native is not None and run.tier in self._native:
                native.append(self._native_part(layer, run, lo, hi))
                continue
            if run.tier not in self._local:
                if pending:
                    yield flush()
                    pending, pending_tokens = [], 0
                last = then is not None and then[1:3] == (run.tier, run.first_slot)
                yield from self._stager.parts(layer, run, lo, hi, then if last else None)
                continue
            k, v = self._tiers[run.tier].layer_view(layer, run.first_slot, run.num_slots)
            off = run.token_start
            k, v = k[:, lo - off : hi - off], v[:, lo - off : hi - off]
            n = hi - lo
            if pending and (
                pending_tokens + n > SMALL_PART_TOKENS or k.device != pending[0][0].device
            ):
                yield flush()
                pending, pending_tokens = [], 0
            if n >= SMALL_PART_TOKENS:
                yield k, v
            else:
                pending.append((k, v))
                pending_tokens += n
        if pending:
            yield flush()

    def _native_part(self, layer: int, run: Run, lo: int, hi: int) -> tuple:
        """(tokens, K descriptor, V descriptor) of tokens [lo, hi) of a run, in place."""
        tier = self._tiers[run.tier]
        off = run.token_start
        if tier.zero_copy:
            k, v = tier.layer_view(layer, run.first_slot, run.num_slots)
            a, b = lo - off, hi - off
            return hi - lo, raw_field(k[:, a:b]), raw_field(v[:, a:b])
        row0 = run.first_slot * self.layout.block_size + lo - off
        a = tier.arenas
        fields = [
            encoded_field(
                tier.codec.attend_format(kind, self.layout),
                a[f"{kind}.data"][layer],
                a[f"{kind}.scale"][layer],
                a[f"{kind}.zero"][layer] if f"{kind}.zero" in a else None,
                row0,
            )
            for kind in ("k", "v")
        ]
        return hi - lo, *fields

    def _cold_history(self, seq_id: int, runs: list[Run]) -> list[tuple[Run, int]]:
        """Cold runs holding history (tokens before this step) as (run, end token);
        this step's blocks may not be written for later layers yet. Runs the native
        decode attention reads in place are not cold."""
        past = self.manager.num_tokens(seq_id) - self._step_tokens
        return [
            (r, min(past, r.token_start + r.num_tokens))
            for r in runs
            if r.tier not in self._local and r.tier not in self._native and r.token_start < past
        ]

    def _first_chunk(self, layer: int, run: Run, end: int) -> tuple:
        first, count, _ = self._stager.chunks(run, run.token_start, end)[0]
        return (layer, run.tier, first, count)

    def _next_layer_chunk(self, layer: int, seq_id: int, runs: list[Run]) -> tuple | None:
        """The first cold chunk layer + 1 will read for a lone sequence with one cold
        run: loading it can start as soon as this layer's last cold chunk is in (its
        buffer is free then), overlapping this layer's attention."""
        if self._stager is None or layer + 1 >= self.num_layers or len(self.manager.tables) != 1:
            return None
        cold = self._cold_history(seq_id, runs)
        return self._first_chunk(layer + 1, *cold[0]) if len(cold) == 1 else None

    def prefetch_next_layer(self, layer: int) -> None:
        """After layer `layer`'s attention: start loading the first cold chunk that
        layer + 1 will need (a no-op when `_next_layer_chunk` already started it)."""
        if self._stager is None or layer + 1 >= self.num_layers:
            return
        for seq_id in sorted(self.manager.tables):
            cold = self._cold_history(seq_id, self.manager.runs(seq_id))
            if cold:
                self._stager.prefetch(self._first_chunk(layer + 1, *cold[0]))
                return

    def _history_partials(
        self,
        layer: int,
        seq_id: int,
        qp: torch.Tensor,
        start: int,
        end: int,
        scale: float,
        softcap: float | None,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Partials (out, lse) of packed queries qp over keys [start, end), which every
        query sees: one native call for the runs readable in place (CPU, few query
        rows), one torch partial per other part (staged chunks, device arenas)."""
        native: list | None = [] if self._native and qp.shape[1] <= NATIVE_MAX_ROWS else None
        parts = [
            _partial_where_kv_lives(qp, k, v, scale, softcap)
            for k, v in self._parts(layer, seq_id, start, end, native)
        ]
        if native:
            parts.append(native_attention(qp, native, self.layout.dim_v, scale, softcap))
        return parts

    def attend(
        self,
        layer: int,
        seq_id: int,
        q: torch.Tensor,
        new_k: torch.Tensor,
        new_v: torch.Tensor,
        scale: float,
        row_mask: _RowMask | None,
        sliding_window: int | None,
        softcap: float | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """Attention of one sequence's queries q [Hq, Q, D] over its cached keys.

        Returns [Hq, Q, Dv]."""
        num_q, total = q.shape[1], self.manager.num_tokens(seq_id)
        past = total - num_q
        hkv, hq = self.layout.num_kv_heads, q.shape[0]
        first_valid = row_mask.first_valid if row_mask else 0
        window = sliding_window if sliding_window and sliding_window < total else None
        dense = row_mask.dense if row_mask else None
        acc = None
        if num_q == 1 and dense is None:
            start = first_valid if window is None else max(first_valid, total - window)
            parts = self._history_partials(
                layer, seq_id, pack_gqa(q, hkv), start, total, scale, softcap
            )
            acc = merge_all(parts) if parts else None
        elif dense is None and window is None and first_valid <= past:
            qp = pack_gqa(q, hkv)
            parts = self._history_partials(layer, seq_id, qp, first_valid, past, scale, softcap)
            parts.append(_causal_new(q, new_k, new_v, scale, softcap, hkv))
            acc = merge_all(parts)
        else:
            start = 0 if dense is not None else first_valid
            if window is not None:
                start = max(start, past - window + 1)
            start = min(start, past)
            # clone: staged views are only valid until the generator moves on
            parts = [(k.clone(), v.clone()) for k, v in self._parts(layer, seq_id, start, past)]
            keys = torch.cat([k for k, _ in parts] + [new_k], dim=1)
            values = torch.cat([v for _, v in parts] + [new_v], dim=1)
            kpos = torch.arange(start, total, device=q.device)
            qpos = torch.arange(past, total, device=q.device)
            allowed = kpos[None, :] <= qpos[:, None]
            if window is not None:
                allowed &= kpos[None, :] > qpos[:, None] - sliding_window
            if dense is not None:
                allowed &= dense[start:total].to(q.device)[None, :]
            allowed &= kpos[None, :] >= first_valid
            out, lse = masked_attention(q, keys, values, scale, allowed, softcap)
            acc = (out.reshape(hkv, -1, out.shape[-1]), lse.reshape(hkv, -1))
        if acc is None:  # no visible key at all (a padding query)
            return q.new_zeros((hq, num_q, self.layout.dim_v))
        if sinks is not None:
            return merge_sink((unpack_gqa(acc[0], hq), acc[1].reshape(hq, num_q)), sinks)
        return unpack_gqa(acc[0], hq)

    def set_budget(self, tier: str, budget: int | str) -> None:
        """Change a tier's budget at run time (the seed's dynamic offload ratio), in
        bytes ("256MiB") of that tier's stored blocks; at most the arena it was built
        with. Blocks over budget move down now."""
        mgr = self.manager
        if tier not in mgr.tiers:
            raise ConfigError.field("tier", tier, f"one of {', '.join(mgr.tier_order)}")
        nbytes = parse_size(budget, f"{tier}_budget", allow_zero=True)
        mgr.set_budget(tier, min(nbytes // mgr.tiers[tier].block_bytes, mgr.tiers[tier].num_slots))

    # -- reporting -----------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Tier occupancy, bytes moved per link, peak device bytes, staging size."""
        if self._manager is None:
            return {"initialized": False}
        staging = self._stager.nbytes if self._stager else 0
        dev = self._tiers[self._device_name]
        return {
            "initialized": True,
            "block_size": self.layout.block_size,
            "tiers": self.manager.occupancy(),
            "bytes_moved": dict(self.manager.bytes_moved),
            "blocks_moved": self.manager.num_moves,
            "device_budget_bytes": dev.num_slots * dev.block_bytes,
            "staging_bytes": staging,
            "peak_device_bytes": dev.stats.peak_used_slots * dev.block_bytes + staging,
            "transfers": self._stager.engine.stats.as_dict() if self._stager else None,
            "tokens": {s: self.manager.num_tokens(s) for s in self.manager.tables},
        }


def _partial_where_kv_lives(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial attention computed on the device that holds k/v: host blocks attended
    in place on the CPU (FlexGen's "CPU attention"), only q and the partial result
    ([Hkv, R*Q, D] + LSE, tiny in decode) cross the link."""
    if k.device == q.device:
        return partial_attention(q, k, v, scale, softcap)
    out, lse = partial_attention(q.to(k.device), k, v, scale, softcap)
    return out.to(q.device, non_blocking=True), lse.to(q.device, non_blocking=True)


def _causal_new(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    softcap: float | None,
    num_kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of this step's queries over this step's keys (square),
    returned packed ([Hkv, R*Q, Dv], [Hkv, R*Q])."""
    hq, nq, _ = q.shape
    r = hq // num_kv_heads
    if softcap is None and q.device.type == "cpu" and k.shape[-1] == v.shape[-1]:
        kx = k.repeat_interleave(r, dim=0) if r > 1 else k
        vx = v.repeat_interleave(r, dim=0) if r > 1 else v
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[None], kx[None], vx[None], 0.0, True, scale=scale
        )
        out, lse = out[0], lse[0]
    else:
        allowed = torch.ones(nq, nq, dtype=torch.bool, device=q.device).tril()
        out, lse = masked_attention(q, k, v, scale, allowed, softcap)
    return out.reshape(num_kv_heads, r * nq, -1), lse.reshape(num_kv_heads, r * nq)


def kvstrata_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: Any,
    value: Any,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention function registered as "kvstrata" (transformers AttentionInterface)."""
    if not isinstance(key, TieredKV):
        raise UnsupportedModelError(
            "attn_implementation='kvstrata' needs a kvstrata.TieredCache: pass "
            "cache=TieredCache(model.config, ...) to generate()/forward()"
        )
    cache = key.cache
    batch, hq, num_q, dim = query.shape
    scale = scaling if scaling is not None else 1.0 / math.sqrt(dim)
    rows = cache._row_mask(attention_mask, batch)
    out = query.new_empty((batch, num_q, hq, key.new_v.shape[-1]))
    for b in range(batch):
        o = cache.attend(
            key.layer_idx,
            b,
            query[b],
            key.new_k[b],
            key.new_v[b],
            scale,
            rows[b] if rows else None,
            sliding_window,
            softcap,
            s_aux,
        )
        out[b].copy_(o.transpose(0, 1))
    cache.prefetch_next_layer(key.layer_idx)
    return out, None


def kvstrata_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """Mask function registered as "kvstrata": pass the 2-D padding mask through
    (None when nothing is padded); causality and windows are applied by the attention."""
    if attention_mask is None or attention_mask.ndim != 2:
        return None
    if bool(attention_mask.all()):
        return None
    return attention_mask.bool()


def register() -> None:
    """Register the "kvstrata" attention and mask functions with transformers."""
    AttentionInterface.register(ATTENTION_NAME, kvstrata_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, kvstrata_mask)


def enable(model: PreTrainedModel) -> PreTrainedModel:
    """Register the attention and switch `model` to it. Returns the model.

    Raises:
        UnsupportedModelError: the model's attention does not go through
            transformers' AttentionInterface, or it has non-attention layers.
    """
    _check_supported(model.config)
    if not getattr(model, "_supports_attention_backend", False):
        raise UnsupportedModelError(
            f"model_type={model.config.model_type!r}: its attention does not go through "
            "transformers' AttentionInterface (_supports_attention_backend is False)"
        )
    register()
    model.set_attn_implementation(ATTENTION_NAME)
    return model
