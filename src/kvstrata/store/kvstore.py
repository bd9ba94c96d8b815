"""KVStore: one set of tiers, budgets and a prefix index shared by many sequences.

Transformers-free. A store owns the tiers (device / host / disk arenas), the block
manager (tables, placement, eviction), the layer groups and the prefix index; a
`TieredCache` (transformers), the engine and other adapters are views over it.

    store = KVStore(model.config, CacheConfig(host_budget="4GiB", disk_dir=...))
    cache = TieredCache.from_store(store, prompt_ids)   # kvstrata.integrations.hf
    cache.matched_tokens                                # prompt tokens found in the store

Prefix reuse (DESIGN.md decision 6) is the `PrefixIndex` (prefix.py): full blocks are hashed,
shared by reference, verified on a hit (a corrupt disk block is a miss, recomputed), kept cached
after their last use, found again after a restart, written to the disk tier by `close()`, shared
through a remote tier (remote_url, store/remote.py) and reported as KV events (`record_events`,
store/events.py). The host tier yields to memory pressure (`adapt`, store/pressure.py). The
engine sees the store through `contract.EngineStore`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch

from kvstrata.attention.runtime import AttentionRuntime
from kvstrata.attention.writes import split_by_group
from kvstrata.blocks.eviction import EvictionPolicy
from kvstrata.blocks.manager import BlockManager, Run, TokenWrites
from kvstrata.codecs.registry import get_codec
from kvstrata.config import CacheConfig
from kvstrata.core.errors import ConfigError, KvstrataError
from kvstrata.core.fingerprint import weights_of
from kvstrata.core.layout import BlockLayout
from kvstrata.model import budgets
from kvstrata.model.geometry import KVGeometry
from kvstrata.model.groups import LayerGroup, layer_groups
from kvstrata.store.build import CODEC_FIELDS, build_remote, build_tiers, lossy_below, numa_stats
from kvstrata.store.contract import Capacity, Usage
from kvstrata.store.events import RecordsEvents
from kvstrata.store.prefix import PrefixIndex, PrefixStats
from kvstrata.store.pressure import AdaptsBudgets
from kvstrata.store.sequences import SequenceState, table_keys
from kvstrata.store.threads import OneThread
from kvstrata.tiers.memory import resolve_device


class KVStore(OneThread, RecordsEvents, AdaptsBudgets):
    """Tiers, placement and prefix index for many sequences of one model.

    Args:
        model_config: a transformers config (or a KVGeometry): layers, heads, windows.
        cache_config: a CacheConfig, or its fields as keyword arguments.
        model_key: names the weights in every block hash (default: the config's model type
            and `_name_or_path`, plus the weights' fingerprint `kvstrata.enable(model)` took).
        prefix_caching: hash full blocks and reuse them across sequences.
    """

    def __init__(
        self,
        model_config: Any,
        cache_config: CacheConfig | None = None,
        *,
        model_key: str | None = None,
        prefix_caching: bool = True,
        **kwargs: Any,
    ) -> None:
        if cache_config is None:
            cache_config = CacheConfig(**kwargs)
        elif kwargs:
            cache_config = cache_config.replace(**kwargs)
        self.config = cache_config
        if isinstance(model_config, KVGeometry):
            self.geometry = model_config
        else:
            self.geometry = KVGeometry.from_hf_config(model_config)
        g = self.geometry
        self.groups: list[LayerGroup] = layer_groups(
            g.num_layers, g.sliding_layers, g.sliding_window
        )
        self.layer_map: list[tuple[int, int]] = [(0, 0)] * g.num_layers
        for group in self.groups:
            for local, layer in enumerate(group.layers):
                self.layer_map[layer] = (group.index, local)
        name = getattr(model_config, "_name_or_path", "") or g.name
        self._model_key = model_key
        self._default_key = f"{g.model_type}:{name}"
        self._model_config = model_config
        self.prefix_caching = prefix_caching
        self.codecs = {f: get_codec(getattr(cache_config, f), f) for f in CODEC_FIELDS}
        if not self.codecs["device_codec"].lossless:
            raise ConfigError.field(
                "device_codec",
                cache_config.device_codec,
                "the device tier keeps full precision (it is the residual window); put "
                "lossy codecs on host_codec / disk_codec",
            )
        self.policy = EvictionPolicy(cache_config.policy)
        self.device = resolve_device(cache_config.device)
        self.manager: BlockManager | None = None
        self.disk_tier = None  # the DiskTier, once built with one
        self.layout: BlockLayout | None = None
        self.runtime = None
        self.prefix_index = PrefixIndex(self.groups, cache_config.block_size)
        self._seqs: dict[int, SequenceState] = {}
        self._ids = itertools.count()
        self._closed = False
        self._thread: int | None = None  # the thread that uses the store (bound at first use)
        self._orphans: list[int] = []  # sequences of dropped caches, freed at the next step

    @property
    def model_key(self) -> str:
        """What names the weights in every block hash: `model_key` if given, else the
        config's model type and path plus the fingerprint of the weights `enable`
        recorded for this config. Fixed at first use."""
        if self._model_key is None:
            weights = weights_of(self._model_config)
            self._model_key = self._default_key + (f":{weights}" if weights else "")
        return self._model_key

    @property
    def lossy_below(self) -> bool:
        """A lower tier stores a lossy codec (the residual window then stays on the device)."""
        return lossy_below(self.codecs)

    # -- construction -------------------------------------------------------------------------
    @property
    def is_built(self) -> bool:
        return self.manager is not None

    def build(
        self,
        dtype: torch.dtype,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        v_head_dim: int | None = None,
        num_sequences: int = 1,
        native: bool | None = None,
    ) -> None:
        """Create the tiers (dtype and shapes come with the first K/V, or the config).

        A built store checks that later K/V match its layout. `native`: use the
        native CPU decode attention (None: AttentionRuntime.native_attention)."""
        layout = budgets.group_layout(
            self.geometry, self.config.block_size, dtype, num_kv_heads, head_dim, v_head_dim
        )
        if self.layout is not None:
            if layout != self.layout:
                raise ConfigError.field(
                    "key/value states",
                    f"{layout.num_kv_heads} heads x {layout.head_dim} {layout.dtype}",
                    f"this store holds {self.layout.num_kv_heads} heads x "
                    f"{self.layout.head_dim} {self.layout.dtype}; use one store per model",
                )
            return
        cc = self.config
        for codec in self.codecs.values():
            codec.validate(layout)
        tiers = build_tiers(cc, self.codecs, layout, self.groups, num_sequences, self.device)
        self.layout = layout
        self.manager = BlockManager(layout, tiers, self.policy, sink_tokens=cc.sink_tokens)
        self.manager.state.on_move = self.prefix_index.key_on_disk
        self.manager.state.keep_skipped_blocks = self.prefix_caching
        self.disk_tier = tiers[-1] if cc.disk_dir else None
        self.prefix_index.bind(
            self.manager,
            self.disk_tier,
            caching=lambda: self.prefix_caching,
            model_key=lambda: self.model_key,
            dtype=str(layout.dtype).removeprefix("torch."),
            codecs="/".join(self.codecs[f].name for f in CODEC_FIELDS),
            remote=build_remote(cc, layout, self.groups),
        )
        self.prefix_index.adopt_from_disk()  # what an earlier process keyed there
        self.runtime = AttentionRuntime(
            self.manager, layout, cc, self.device, self.groups, self.layer_map, native=native
        )

    def checked_manager(self) -> BlockManager:
        """The block manager, after checking the store is open, built, and used from
        its own thread (KvstrataError / RuntimeError otherwise)."""
        if self._closed:
            raise KvstrataError("this KVStore is closed: create a new one")
        if self.manager is None:
            raise RuntimeError("KVStore is empty: build() it or run a forward pass first")
        self.check_thread()
        if self.runtime is not None:  # reads ahead done before any block may move
            self.runtime.settle()
        return self.manager

    def rewind(self, lengths: dict[int, int]) -> None:
        """Cut sequences back to these lengths (a forward that failed after its last
        layer); one that cannot be cut back is marked unusable."""
        for seq_id, num_tokens in lengths.items():
            seq = self._seqs.get(seq_id)
            if seq is None or seq.failed is not None or self.num_tokens(seq_id) <= num_tokens:
                continue
            try:
                self.truncate(seq_id, num_tokens)
            except KvstrataError as err:
                seq.failed = f"a failed forward could not be undone ({err})"

    def failure(self, seq_id: int) -> str | None:
        """Why a sequence is unusable (a step that could not be undone), else None."""
        seq = self._seqs.get(seq_id)
        return None if seq is None else seq.failed

    def _usable(self, seq_id: int) -> SequenceState:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise ConfigError.field("seq_id", seq_id, "a sequence of this store (add_sequence)")
        if seq.failed is not None:
            raise KvstrataError(
                f"sequence {seq_id} is unusable: {seq.failed}; free it and start again"
            )
        return seq

    @property
    def prefix(self) -> PrefixStats:
        """Prefix-cache counters (lookups, hit tokens per tier, corrupt blocks)."""
        return self.prefix_index.stats

    @property
    def tiers(self) -> dict:
        return self.checked_manager().state.tiers

    # -- sequences ----------------------------------------------------------------------------
    def tables(self, seq_id: int) -> list[tuple[int, int]]:
        """Block-table keys of a sequence, one per layer group."""
        return table_keys(seq_id, self.groups)

    def add_sequence(
        self, token_ids: Sequence[int] | None = None, salt: str = "", lookup: bool = True
    ) -> tuple[int, int]:
        """A new sequence, starting with its longest cached prefix of `token_ids`.

        Args:
            token_ids: the prompt (None: tokens unknown, the sequence is not hashed).
            salt: tenant salt; sequences with different salts never share a block.
            lookup: look the prompt up (False: start empty, still hash its blocks).

        Returns:
            (sequence id, tokens already in the store); at least one prompt token is
            always left to compute, so the model produces logits for the next one.
        """
        mgr = self.checked_manager()
        self._free_orphans()
        if not isinstance(salt, str):
            raise ConfigError.field("salt", salt, "a string naming the tenant")
        seq_id = next(self._ids)
        self._seqs[seq_id] = SequenceState(salt=salt, parents=[None] * len(self.groups))
        for key, group in zip(self.tables(seq_id), self.groups, strict=True):
            mgr.add_sequence(key, window=group.window)
        matched = 0
        if token_ids is not None and lookup and self.prefix_caching:
            try:
                ids = [int(t) for t in token_ids]
                matched = self.prefix_index.attach(seq_id, self._seqs[seq_id], ids)
            except BaseException:  # nothing half-attached stays behind
                self.free(seq_id)
                raise
        return seq_id, matched

    def extend(
        self,
        seq_ids: list[int],
        num_new: int | Sequence[int],
        token_ids: list[list[int]] | None = None,
    ) -> list[list[TokenWrites]]:
        """Make room for `num_new` tokens at the end of each sequence: one count for
        all, or one per sequence (a ragged step: decodes and prompt chunks together).

        Args:
            token_ids: the new tokens per sequence (None: unknown; hashing stops).

        Returns:
            Per layer group, where the tokens go (TokenWrites; `src` indexes the
            flattened order of the step: each sequence's new tokens in turn).
        """
        mgr = self.checked_manager()
        self._free_orphans()
        seqs = [self._usable(s) for s in seq_ids]
        counts = [num_new] * len(seq_ids) if isinstance(num_new, int) else list(num_new)
        if len(counts) != len(seq_ids) or any(
            isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in counts
        ):
            raise ConfigError.field("num_new", num_new, "one count >= 1 per sequence")
        keys = [k for g in self.groups for k in ((s, g.index) for s in seq_ids)]
        writes = mgr.append(keys, counts * len(self.groups))
        if self.runtime is not None:
            self.runtime.begin_step(dict(zip(seq_ids, counts, strict=True)))
        self.prefix_index.step_began(sum(counts))
        for i, seq in enumerate(seqs):
            if seq.in_step:  # the previous step never called step_done (K/V written
                seq.token_ids = None  # without a forward?): never index this sequence
            seq.in_step = True
            seq.step_start = mgr.num_tokens((seq_ids[i], 0)) - counts[i]
            if seq.token_ids is None:
                continue
            new = token_ids[i] if token_ids is not None else None
            if new is None or len(new) != counts[i]:
                seq.token_ids = None
            else:
                seq.token_ids.extend(int(t) for t in new)
        return split_by_group(writes, len(self.groups), sum(counts))

    def step_done(self, seq_ids: list[int]) -> None:
        """The forward that extended these sequences finished: their full blocks are
        complete in every layer and can be hashed (found by later lookups)."""
        mgr = self.checked_manager()
        for seq_id in seq_ids:
            seq = self._usable(seq_id)
            if not seq.in_step:
                continue
            seq.in_step = False
            if self.prefix_caching:  # before end_step: the step's skipped blocks get cached
                self.prefix_index.hash_full_blocks(seq_id, seq, self.num_tokens(seq_id))
        mgr.end_step([k for s in seq_ids for k in self.tables(s)])
        self.prefix_index.step_ended()

    def abort_step(self, seq_ids: list[int] | None = None) -> list[int]:
        """Undo the unfinished step of these sequences (default: all): back to the
        tokens they had before it, the step's blocks released, as if it never ran. A
        sequence whose step cannot be undone is marked unusable (any further use
        raises). Returns the sequences that were rolled back."""
        mgr = self.checked_manager()
        ids = self.sequence_ids if seq_ids is None else seq_ids
        undone = []
        for seq_id in ids:
            seq = self._seqs.get(seq_id)
            if seq is None or not seq.in_step:
                continue
            seq.in_step = False
            try:
                for key in self.tables(seq_id):
                    mgr.abort_step(key, seq.step_start)
            except KvstrataError as err:
                seq.failed = f"a failed step could not be undone ({err})"
                continue
            if seq.token_ids is not None:
                del seq.token_ids[seq.step_start :]
            undone.append(seq_id)
        if self.runtime is not None:
            self.runtime.begin_step({})
        return undone

    def num_tokens(self, seq_id: int) -> int:
        return self.checked_manager().num_tokens((seq_id, 0))

    def has_sequence(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    @property
    def sequence_ids(self) -> list[int]:
        return sorted(self._seqs)

    def fork(self, seq_id: int) -> int:
        """A new sequence sharing every block of `seq_id` (copy on write)."""
        mgr = self.checked_manager()
        src = self._usable(seq_id)
        new_id = next(self._ids)
        self._seqs[new_id] = SequenceState(
            salt=src.salt,
            token_ids=None if src.token_ids is None else list(src.token_ids),
            num_hashed=src.num_hashed,
            parents=list(src.parents),
            in_step=src.in_step,
            step_start=src.step_start,
        )
        for src_key, dst_key in zip(self.tables(seq_id), self.tables(new_id), strict=True):
            mgr.fork(src_key, dst_key)
        return new_id

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Keep the first `num_tokens` tokens of a sequence."""
        mgr = self.checked_manager()
        self._usable(seq_id)
        if num_tokens >= self.num_tokens(seq_id):
            return
        for key in self.tables(seq_id):
            mgr.truncate(key, num_tokens)
        seq = self._seqs[seq_id]
        if seq.token_ids is not None:
            del seq.token_ids[num_tokens:]
        full = num_tokens // self.config.block_size
        if seq.num_hashed > full:
            seq.num_hashed = 0  # re-derive the chain from the start when needed
            seq.parents = [None] * len(self.groups)

    def free(self, seq_id: int) -> None:
        """Release a sequence; its hashed blocks stay cached (an unfinished step's
        blocks are never indexed: they are released)."""
        mgr = self.checked_manager()
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise ConfigError.field("seq_id", seq_id, "a sequence of this store (add_sequence)")
        if seq.in_step:
            self.abort_step([seq_id])
        self._seqs.pop(seq_id)
        for key in self.tables(seq_id):
            mgr.free_sequence(key)

    def remap(self, seq_ids: list[int], sources: list[int]) -> list[int]:
        """New sequences where new i shares every block of `seq_ids[sources[i]]`
        (beam reorder / batch select); the old ones are freed. Returns the new ids."""
        new_ids = [self.fork(seq_ids[s]) for s in sources]
        for seq_id in seq_ids:
            self.free(seq_id)
        return new_ids

    def demote(self, seq_id: int) -> int:
        """Move a sequence's full blocks off the device to host / disk as far as their
        budgets allow (preemption without recompute); it keeps the open block, its
        sinks, shared blocks and, above a lossy tier, its residual window. Returns the
        blocks moved; the sequence stays usable (its blocks are read where they are)."""
        mgr = self.checked_manager()
        self._usable(seq_id)
        keep = self.config.residual_tokens if self.lossy_below else 0
        return sum(mgr.demote(key, keep) for key in self.tables(seq_id))

    # -- the engine's view (store.contract) -----------------------------------------------
    def capacity(self) -> Capacity:
        """Blocks the built store holds (see `Capacity`)."""
        state = self.checked_manager().state
        cc = self.config
        device, *lower = state.tier_order
        in_place = self.runtime.in_place if self.runtime is not None else ()
        per_group = budgets.device_floor_blocks(
            cc.block_size, cc.sink_tokens, cc.residual_tokens, lossy=self.lossy_below, crossing=True
        )
        return Capacity(
            block_size=cc.block_size,
            block_bytes=state.tiers[device].block_bytes,
            device_blocks=state.budget_slots[device],
            total_blocks=sum(state.budget_slots.values()),
            floor_blocks=len(self.groups) * per_group,
            in_place_blocks=sum(state.budget_slots[n] for n in lower if n in in_place),
        )

    def blocks_held(self, num_tokens: int) -> int:
        """Blocks (all layer groups) one sequence of `num_tokens` tokens holds."""
        return budgets.blocks_held(self.groups, num_tokens, self.config.block_size)

    def usage(self) -> Usage:
        """Occupancy per tier and the cached blocks evicted so far."""
        mgr = self.checked_manager()
        return Usage(mgr.occupancy(), mgr.state.num_evicted_cached)

    def runs(self, seq_id: int, group: int) -> list[Run]:
        return self.checked_manager().runs((seq_id, group))

    # -- stats, lifetime ------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Tier occupancy, bytes moved, prefix-cache counters, tokens per sequence."""
        if self.manager is None:
            return {"initialized": False}
        mgr, state, runtime = self.manager, self.manager.state, self.runtime
        staging = runtime.staging_bytes if runtime else 0
        dev = state.tiers[state.tier_order[0]]
        return {
            "initialized": True,
            "block_size": self.config.block_size,
            "groups": [{"layers": list(g.layers), "window": g.window} for g in self.groups],
            "tiers": mgr.occupancy(),
            "bytes_moved": dict(state.bytes_moved),
            "blocks_moved": state.num_moves,
            "device_budget_bytes": dev.num_slots * dev.block_bytes,
            "staging_bytes": staging,
            "peak_device_bytes": dev.stats.peak_used_slots * dev.block_bytes + staging,
            "kv_bytes": mgr.live_bytes(),
            "peak_kv_bytes": state.peak_live_bytes,
            "transfers": runtime.transfer_stats() if runtime else None,
            "selection": runtime.selection_stats() if runtime else None,
            "prefix": self.prefix.as_dict(),
            "remote": self.prefix_index.remote_stats(),
            "host_pressure": self.pressure_stats(),
            "numa": numa_stats(state.tiers),
            "tokens": {s: self.num_tokens(s) for s in sorted(self._seqs)},
        }

    def close(self) -> None:
        """Persist hashed blocks to the disk tier and release files. Idempotent."""
        was_closed, self._closed = self._closed, True
        if was_closed or self.manager is None:
            return
        try:
            self.prefix_index.persist()
        finally:
            self.prefix_index.close()
            if self.runtime is not None:
                self.runtime.close()
            for tier in self.manager.state.tiers.values():
                tier.close()

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
