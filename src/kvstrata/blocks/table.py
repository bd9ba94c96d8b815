"""Per-sequence block table: logical block i holds tokens [i*bs, (i+1)*bs)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BlockTable:
    """The blocks of one sequence in order, and how many tokens it holds."""

    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0

    def copy(self) -> BlockTable:
        return BlockTable(list(self.block_ids), self.num_tokens)
