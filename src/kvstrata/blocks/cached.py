"""Cached blocks: full blocks indexed by content hash, kept after their last reference.

A mixin of `BlockManager` (it uses the manager's pool, tiers and counters): a block
whose last reference goes stays *cached* when it is the indexed copy of its hash —
placed, unreferenced, found again by `hash_to_block`, ranked below every live block
and evicted oldest first (vLLM's "free but cached"; the manager's `BlockOrder` keeps
them in that order); any other block is released.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstrata.blocks.pool import Block

if TYPE_CHECKING:
    from kvstrata.blocks.order import BlockOrder
    from kvstrata.blocks.pool import BlockPool
    from kvstrata.tiers.base import Tier


class CachedBlocks:
    """Ref-count release, the hash index and the cached-block set of a manager."""

    pool: BlockPool
    tiers: dict[str, Tier]
    on_tier: dict[str, set[int]]
    cached: dict[int, None]
    order: BlockOrder
    num_cached_on: dict[str, int]
    hash_to_block: dict[bytes, int]
    clock: int
    layout: object

    def _decref(self, block_id: int) -> None:
        block = self.pool.decref(block_id, keep=True)
        if block is None:
            return
        if block.block_hash is not None and self.hash_to_block.get(block.block_hash) == block_id:
            block.last_access = self.clock
            self.cached[block_id] = None
            self.num_cached_on[block.tier] += 1
            self.order.cache(block.tier, block.last_access, block_id)
            return
        self._release(block)

    def _release(self, block: Block) -> None:
        self.pool.release(block.block_id)
        self.tiers[block.tier].free([block.slot])
        self.on_tier[block.tier].discard(block.block_id)
        self.unhash(block)

    def unhash(self, block: Block) -> None:
        if block.block_hash is not None:
            if self.hash_to_block.get(block.block_hash) == block.block_id:
                del self.hash_to_block[block.block_hash]
            block.block_hash = block.token_ids = None
        self._uncache(block)

    def _uncache(self, block: Block) -> None:
        if block.block_id in self.cached:
            del self.cached[block.block_id]
            self.num_cached_on[block.tier] -= 1
            self.order.uncache(block.tier, block.last_access, block.block_id)

    # -- content hashes -----------------------------------------------------------------------
    def set_hash(self, block_id: int, block_hash: bytes, token_ids: tuple[int, ...]) -> bool:
        """Index a full block under its content hash. False when another block already
        holds that hash (the first one stays the cached copy)."""
        if block_hash in self.hash_to_block:
            return self.hash_to_block[block_hash] == block_id
        block = self.pool.blocks[block_id]
        block.block_hash, block.token_ids = block_hash, token_ids
        self.hash_to_block[block_hash] = block_id
        return True

    def evict_cached(self, block_id: int) -> None:
        """Drop an unreferenced cached block now (e.g. it failed verification)."""
        block = self.pool.blocks[block_id]
        assert block.ref_count == 0
        self._release(block)

    def adopt_cached(self, tier: str, slot: int, block_hash: bytes, token_ids: tuple) -> int:
        """Register a block a durable tier already holds (found again after a restart)
        as an unreferenced cached block; returns its id."""
        block = self.pool.new_block(tier, slot)
        block.ref_count, block.num_tokens = 0, self.layout.block_size
        block.block_hash, block.token_ids = block_hash, token_ids
        self.hash_to_block[block_hash] = block.block_id
        self.cached[block.block_id] = None
        self.num_cached_on[tier] += 1
        self.order.cache(tier, block.last_access, block.block_id)
        self.on_tier[tier].add(block.block_id)
        return block.block_id
