"""Block ids, ref counts and per-block metadata (no placement decisions here).

A block is `block_size` consecutive tokens of one sequence across all layers, K and
V: one id, one placement (tier name, slot). Ids are recycled: freed ids go to the
back of the free list, new ids come from the front (ascending at start).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass
class Block:
    """Metadata of one block. `tier`/`slot` say where its K/V live."""

    block_id: int
    tier: str = ""
    slot: int = 0
    num_tokens: int = 0
    ref_count: int = 0
    is_sink: bool = False
    last_access: int = 0
    access_count: int = 0


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

    def decref(self, block_id: int) -> Block | None:
        """Drop one reference; returns the block when it is now unreferenced (freed)."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count > 0:
            return None
        del self.blocks[block_id]
        self._free_ids.append(block_id)
        return block

    def free_ids(self) -> list[int]:
        """Recycled ids in reuse order."""
        return list(self._free_ids)
