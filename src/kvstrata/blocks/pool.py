"""Block ids, ref counts and per-block metadata (no placement decisions here).

A block is `block_size` consecutive tokens of one sequence across the layers of one
layer group, K and V: one id, one placement (tier name, slot). Ids are recycled:
released ids go to the back of the free list, new ids come from the front
(ascending at start).

A block whose last reference is dropped either is released (its id recycled) or,
when it is a full block with a content hash, stays *cached*: unreferenced, still
placed, found again by its hash, and evicted first when a slot is needed (vLLM's
"free but cached" blocks).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass
class Block:
    """Metadata of one block. `tier`/`slot` say where its K/V live.

    `block_hash` / `token_ids` are set once the block is full and its tokens are
    known (prefix caching): the chained content hash and the tokens it holds;
    `parent_hash` is the hash it was chained to (None for a sequence's first block)."""

    block_id: int
    tier: str = ""
    slot: int = 0
    num_tokens: int = 0
    ref_count: int = 0
    is_sink: bool = False
    last_access: int = 0
    access_count: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None
    parent_hash: bytes | None = None


class BlockPool:
    """Owns block ids and their ref counts."""

    def __init__(self) -> None:
        self.blocks: dict[int, Block] = {}
        self._free_ids: deque[int] = deque()
        self._next_id = 0

    @property
    def num_live(self) -> int:
        return len(self.blocks)

    def new_block(self, tier: str, slot: int) -> Block:
        """A fresh block with ref count 1 placed at (tier, slot)."""
        if self._free_ids:
            block_id = self._free_ids.popleft()
        else:
            block_id = self._next_id
            self._next_id += 1
        block = Block(block_id=block_id, tier=tier, slot=slot, ref_count=1)
        self.blocks[block_id] = block
        return block

    def incref(self, block_id: int) -> None:
        self.blocks[block_id].ref_count += 1

    def decref(self, block_id: int, keep: bool = False) -> Block | None:
        """Drop one reference; returns the block when it is now unreferenced.

        Args:
            keep: leave an unreferenced block in the pool (cached) instead of
                releasing its id; the caller releases it later with `release`.
        """
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count > 0:
            return None
        if not keep:
            self.release(block_id)
        return block

    def release(self, block_id: int) -> None:
        """Forget an unreferenced block and recycle its id."""
        del self.blocks[block_id]
        self._free_ids.append(block_id)

    def free_ids(self) -> list[int]:
        """Recycled ids in reuse order."""
        return list(self._free_ids)
