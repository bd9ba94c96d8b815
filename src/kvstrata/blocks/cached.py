"""Cached blocks: full blocks indexed by content hash, kept after their last reference.

A part of the block manager that takes the `BlockState` (its pool, tiers, hash index
and cached-block set): a block whose last reference goes stays *cached* when it is
the indexed copy of its hash — placed, unreferenced, found again by `hash_to_block`,
ranked below every live block and evicted oldest first (vLLM's "free but cached";
the hash index ranks them by (last access, -id), `blocks/hash_index.py`); any other
block is released.
"""

from __future__ import annotations

from kvstrata.blocks.pool import Block
from kvstrata.blocks.state import BlockState


class CachedBlocks:
    """Ref-count release, the hash index and the cached-block set of a block state."""

    def __init__(self, state: BlockState) -> None:
        self.state = state

    def decref(self, block_id: int) -> None:
        """Drop one reference; an unreferenced block is cached or released."""
        state = self.state
        block = state.pool.decref(block_id, keep=True)
        if block is None:
            return
        if block.block_hash is not None and state.hash_to_block.get(block.block_hash) == block_id:
            block.last_access = state.clock
            state.hash_to_block.rank(block.tier, block_id, (block.last_access, -block_id))
            return
        self.release(block)

    def release(self, block: Block) -> None:
        """Forget an unreferenced block: its id, its slot, its hash."""
        state = self.state
        state.pool.release(block.block_id)
        state.tiers[block.tier].free([block.slot])
        state.on_tier[block.tier].discard(block.block_id)
        self.unhash(block)

    def unhash(self, block: Block) -> None:
        """The block's contents no longer match its hash (or it is gone): unindex it."""
        if block.block_hash is not None:
            hash_to_block = self.state.hash_to_block
            if hash_to_block.get(block.block_hash) == block.block_id:
                if self.state.on_unindex is not None:
                    self.state.on_unindex(block)
                del hash_to_block[block.block_hash]
            block.block_hash = block.token_ids = block.parent_hash = None
        self.uncache(block)

    def uncache(self, block: Block) -> None:
        """A cached block is referenced again (or gone): it leaves the cached set."""
        self.state.hash_to_block.unrank(block.tier, block.block_id)

    # -- content hashes -----------------------------------------------------------------------
    def set_hash(
        self,
        block_id: int,
        block_hash: bytes,
        token_ids: tuple[int, ...],
        parent: bytes | None = None,
    ) -> bool:
        """Index a full block under its content hash (chained to `parent`). False when
        another block already holds that hash (the first one stays the cached copy)."""
        hash_to_block = self.state.hash_to_block
        if block_hash in hash_to_block:
            return hash_to_block[block_hash] == block_id
        block = self.state.pool.blocks[block_id]
        block.block_hash, block.token_ids, block.parent_hash = block_hash, token_ids, parent
        hash_to_block[block_hash] = block_id
        return True

    def evict_cached(self, block_id: int) -> None:
        """Drop an unreferenced cached block now (e.g. it failed verification)."""
        block = self.state.pool.blocks[block_id]
        assert block.ref_count == 0
        self.release(block)

    def adopt_cached(
        self,
        tier: str,
        slot: int,
        block_hash: bytes,
        token_ids: tuple,
        parent: bytes | None = None,
    ) -> int:
        """Register a block a durable tier already holds (found again after a restart)
        as an unreferenced cached block; returns its id."""
        state = self.state
        block = state.pool.new_block(tier, slot)
        block.ref_count, block.num_tokens = 0, state.layout.block_size
        block.block_hash, block.token_ids, block.parent_hash = block_hash, token_ids, parent
        state.hash_to_block[block_hash] = block.block_id
        state.hash_to_block.rank(tier, block.block_id, (block.last_access, -block.block_id))
        state.on_tier[tier].add(block.block_id)
        return block.block_id
