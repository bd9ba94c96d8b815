"""The prefix index of a KVStore: content hashes of full blocks, lookups, persistence.

Every full block of a sequence whose tokens are known gets a chained content hash
(kvstrata.core.hashing) whose extra keys name the model, dtype, codecs, layout version,
layer group and an optional tenant salt, so two stores, processes or tenants share
a block only when its bytes are interchangeable. A lookup walks the prompt's chain
per group and takes the longest prefix every group can serve (a sliding group only
needs the blocks its window sees); a hit is checked against the stored token ids,
and a disk hit against its checksums: a corrupt block is a miss (dropped from the
index and recomputed by the caller), never served. Hashed blocks that reach the
disk tier are keyed in its durable index (found again after a restart); `persist`
writes those still in memory there when the store closes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvstrata.blocks.manager import BlockManager
from kvstrata.core.hashing import block_hash, block_namespace
from kvstrata.model.groups import LayerGroup
from kvstrata.store.events import KVEventRecorder, chain_order
from kvstrata.store.remote import RemoteBlocks
from kvstrata.store.sequences import SequenceState, longest_match, table_keys
from kvstrata.tiers.disk import DiskTier
from kvstrata.tiers.movement import unreadable_slots, write_keyed

LAYOUT_VERSION = 2  # part of every block hash: bump when stored bytes change meaning


@dataclass
class PrefixStats:
    """Prefix-cache counters."""

    lookups: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    hit_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    corrupt_blocks: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "lookups": self.lookups,
            "lookup_tokens": self.lookup_tokens,
            "hit_tokens": self.hit_tokens,
            "hit_tokens_by_tier": dict(self.hit_tokens_by_tier),
            "corrupt_blocks": self.corrupt_blocks,
        }


class PrefixIndex:
    """Hashing, lookup and persistence of a store's full blocks (see module doc).

    Built with the store's layer groups and block size; `bind` hands it the block
    manager, the disk tier and the names every hash carries once the tiers exist."""

    def __init__(self, groups: list[LayerGroup], block_size: int) -> None:
        self.groups = groups
        self.block_size = block_size
        self.stats = PrefixStats()
        self.manager: BlockManager | None = None
        self.disk: DiskTier | None = None
        self.remote: RemoteBlocks | None = None
        self._caching: Callable[[], bool] = bool
        self._model_key: Callable[[], str] = str
        self._names: dict[str, str] = {}
        self._extra: dict[tuple[int, str], dict[str, str | int]] = {}
        self.events: KVEventRecorder | None = None

    def bind(
        self,
        manager: BlockManager,
        disk: DiskTier | None,
        caching: Callable[[], bool],
        model_key: Callable[[], str],
        dtype: str,
        codecs: str,
        remote: RemoteBlocks | None = None,
    ) -> None:
        """The built store's manager and disk tier (None without one), whether the store
        caches prefixes (asked when it matters: the store's flag may change), and what
        names its blocks in every hash: the model key (asked at the first hash: it is
        fixed at first use), the KV dtype and the tiers' codecs; and its remote tier."""
        self.manager, self.disk, self._caching = manager, disk, caching
        self._model_key, self._names = model_key, {"dtype": dtype, "codecs": codecs}
        self._extra.clear()
        self.remote = remote
        if remote is not None:
            remote.bind(manager, self._extra_keys)

    # -- the remote tier's view of steps, its counters, its lifetime ----------------------
    def step_began(self, num_tokens: int) -> None:
        """A step of `num_tokens` new tokens starts (the remote cost rule times them)."""
        if self.remote is not None:
            self.remote.step_began(num_tokens)

    def step_ended(self) -> None:
        if self.remote is not None:
            self.remote.step_ended()

    def remote_stats(self) -> dict[str, Any] | None:
        return None if self.remote is None else self.remote.stats()

    def close(self) -> None:
        """Send the remote tier's queued writes and disconnect (idempotent)."""
        if self.remote is not None:
            self.remote.close()

    def _extra_keys(self, group: int, salt: str) -> dict[str, str | int]:
        extra = self._extra.get((group, salt))
        if extra is None:
            extra = block_namespace(
                self._model_key(),
                self._names,
                LAYOUT_VERSION,
                f"{group}:{self.groups[group].window or 0}:{len(self.groups)}",
                salt,
            )
            self._extra[(group, salt)] = extra
        return extra

    def _mgr(self) -> BlockManager:
        assert self.manager is not None, "PrefixIndex used before bind()"
        return self.manager

    def hash_full_blocks(self, seq_id: int, seq: SequenceState, num_tokens: int) -> None:
        """Hash the sequence's full blocks not hashed yet (`num_tokens`: its length in
        the store) and index them; those on disk are keyed in its durable index."""
        mgr = self._mgr()
        if seq.token_ids is None:
            return
        bs = self.block_size
        num_full = min(len(seq.token_ids), num_tokens) // bs
        indexed, fresh = [], []
        keys, blocks = table_keys(seq_id, self.groups), mgr.state.pool.blocks
        events = self.events
        for i in range(seq.num_hashed, num_full):
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            for g, key in enumerate(keys):
                parent = seq.parents[g]
                h = block_hash(parent, tokens, self._extra_keys(g, seq.salt))
                seq.parents[g] = h
                block_id = mgr.block_at(key, i)
                if block_id is None:
                    continue
                block = blocks[block_id]
                new = block.block_hash is None
                if mgr.set_hash(block_id, h, tuple(tokens), parent):
                    indexed.append(block)
                    fresh.append((block, g))
                    if new and events is not None:
                        events.stored(block, g)
        seq.num_hashed = max(seq.num_hashed, num_full)
        self.key_on_disk(indexed)
        if self.remote is not None:
            self.remote.offer(fresh, seq.salt)

    def record_events(self, recorder: KVEventRecorder | None) -> None:
        """Report every change to the indexed blocks to `recorder` (None: stop): it
        records AllBlocksCleared, then a BlockStored for each block indexed now."""
        state = self._mgr().state
        self.events = recorder
        if self.remote is not None:
            self.remote.events = recorder
        if recorder is None:
            state.on_move, state.on_unindex = self.key_on_disk, None
            return
        recorder.bind(state.tier_order, self.disk.name if self.disk else None, self.block_size)

        def moved(blocks: list) -> None:
            self.key_on_disk(blocks)
            recorder.moved(blocks)

        state.on_move, state.on_unindex = moved, recorder.removed
        recorder.cleared()
        blocks = state.pool.blocks
        # a block does not record its layer group (nor does the disk index): known only
        # when there is one
        group = 0 if len(self.groups) == 1 else None
        for block in chain_order([blocks[i] for i in state.hash_to_block.values()]):
            recorder.stored(block, group)

    def _lookup_blocks(self, group: int, salt: str, token_ids: list[int], limit: int) -> list:
        """Block ids of the cached prefix of one group (None where a block is absent),
        for up to `limit` full blocks."""
        state = self._mgr().state
        hash_to_block, blocks = state.hash_to_block, state.pool.blocks
        bs = self.block_size
        found: list[int | None] = []
        parent = None
        extra = self._extra_keys(group, salt)
        for i in range(limit):
            tokens = token_ids[i * bs : (i + 1) * bs]
            parent = block_hash(parent, tokens, extra)
            block_id = hash_to_block.get(parent)
            if block_id is not None and blocks[block_id].token_ids != tuple(tokens):
                block_id = None  # a hash collision: never serve it
            found.append(block_id)
        return found

    def attach(self, seq_id: int, seq: SequenceState, token_ids: list[int]) -> int:
        """Attach the longest cached prefix of `token_ids` that every group can serve to
        the new sequence `seq_id` (disk hits verified first); returns its tokens."""
        mgr = self._mgr()
        bs = self.block_size
        limit = max(0, len(token_ids) - 1) // bs
        self.stats.lookups += 1
        self.stats.lookup_tokens += len(token_ids)
        remote = self.remote.fill(seq.salt, token_ids, limit) if self.remote and limit else ()
        for _attempt in range(8):
            found = [self._lookup_blocks(g.index, seq.salt, token_ids, limit) for g in self.groups]
            k = self._longest_match(found)
            if k == 0:
                break
            chosen = []
            for group, ids in zip(self.groups, found, strict=True):
                first = group.first_live_block(k * bs, bs)
                chosen.append((first, ids[first:k]))
            bad = self._verify_disk([b for _, ids in chosen for b in ids])
            if bad:
                continue
            for key, (first, ids) in zip(table_keys(seq_id, self.groups), chosen, strict=True):
                mgr.attach(key, ids, first, k * bs)
            seq.token_ids = list(token_ids[: k * bs])
            seq.num_hashed = k
            seq.parents = [
                mgr.state.pool.blocks[ids[-1]].block_hash if ids else None for _, ids in chosen
            ]
            if any(p is None for p in seq.parents):  # a group keeps no block: re-derive
                seq.num_hashed, seq.parents = 0, [None] * len(self.groups)
                self._rechain(seq, k)
            self.stats.hit_tokens += k * bs
            blocks = mgr.state.pool.blocks
            for block_id in chosen[0][1]:
                tier = "remote" if block_id in remote else blocks[block_id].tier
                self.stats.hit_tokens_by_tier[tier] = (
                    self.stats.hit_tokens_by_tier.get(tier, 0) + bs
                )
            return k * bs
        return 0

    def _rechain(self, seq: SequenceState, num_blocks: int) -> None:
        bs = self.block_size
        assert seq.token_ids is not None
        for i in range(num_blocks):
            for g in range(len(self.groups)):
                tokens = seq.token_ids[i * bs : (i + 1) * bs]
                seq.parents[g] = block_hash(seq.parents[g], tokens, self._extra_keys(g, seq.salt))
        seq.num_hashed = num_blocks

    def _longest_match(self, found: list[list[int | None]]) -> int:
        return longest_match(self.groups, self.block_size, found)

    def _verify_disk(self, block_ids: list[int]) -> bool:
        """Read back the disk blocks of a hit (checksums); drop corrupt ones from the
        index. True when one was bad."""
        mgr = self._mgr()
        if self.disk is None:
            return False
        disk, blocks = self.disk.name, mgr.state.pool.blocks
        slots = [blocks[b].slot for b in block_ids if blocks[b].tier == disk]
        if not slots:
            return False
        bad_slots = unreadable_slots(self.disk, slots)
        for block_id in block_ids:
            block = blocks[block_id]
            if block.tier == disk and block.slot in bad_slots:
                self.stats.corrupt_blocks += 1
                if block.ref_count == 0:
                    mgr.evict_cached(block_id)
                else:
                    mgr.unhash(block)
        return bool(bad_slots)

    def adopt_from_disk(self) -> None:
        """Index the blocks the disk tier's durable index keys (written by an earlier
        process) as cached blocks, so lookups find them after a restart."""
        disk, mgr = self.disk, self._mgr()
        if disk is None or not self._caching():
            return
        for slot, key in sorted(disk.keyed_slots().items()):
            hit = disk.lookup(key)
            if hit is not None:
                mgr.adopt_cached(disk.name, slot, key, tuple(hit[1]), disk.parent_of(key))

    def key_on_disk(self, blocks: list) -> None:
        """Key the hashed ones of these blocks that live on the disk tier in its durable
        index (one transaction), so a restarted process finds them."""
        disk = self.disk
        if disk is None:
            return
        keyed = [b for b in blocks if b.tier == disk.name and b.block_hash is not None]
        if keyed:
            disk.put_keys(
                [(b.slot, b.block_hash, list(b.token_ids or ())) for b in keyed],
                [b.parent_hash for b in keyed],
            )

    def persist(self) -> int:
        """Write hashed blocks that live only in memory tiers to free disk slots and
        key them there (a restarted process finds them). Returns blocks written."""
        mgr, disk = self.manager, self.disk
        if mgr is None or disk is None or not self._caching():
            return 0
        state = mgr.state
        todo = [
            b
            for b in state.pool.blocks.values()
            if b.block_hash is not None and b.tier != disk.name
        ]
        todo.sort(key=lambda b: b.block_id)
        todo = todo[: disk.num_free]
        for tier_name in state.tier_order[:-1]:
            group = [b for b in todo if b.tier == tier_name]
            if not group:
                continue
            slots = disk.allocate(len(group))
            assert slots is not None
            try:
                write_keyed(
                    state.tiers[tier_name],
                    [b.slot for b in group],
                    disk,
                    slots,
                    [b.block_hash for b in group],
                    [b.token_ids or () for b in group],
                    [b.parent_hash for b in group],
                    copy=mgr.copy_blocks,
                )
            except BaseException:  # e.g. a full disk: the slots go back, nothing is keyed
                disk.free(slots)
                raise
        return len(todo)
