"""Runs and token writes: how a block table maps onto tier arenas.

A run is consecutive blocks of one table in consecutive slots of one tier — one
zero-copy arena view, one attention partial. Token writes say, per tier, which arena
row each of a step's new tokens goes to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstrata.blocks.pool import Block
from kvstrata.blocks.table import BlockTable


@dataclass(frozen=True)
class Run:
    """Consecutive blocks of one table in consecutive slots of one tier."""

    tier: str
    first_slot: int
    num_slots: int
    token_start: int  # logical position of the run's first token in the sequence
    num_tokens: int


@dataclass
class TokenWrites:
    """Where this step's new tokens go in one tier.

    rows: arena row (slot*bs + offset) per written token.
    src: index of that token in the step's flattened [len(tables) * new_tokens] order.
    """

    tier: str
    rows: torch.Tensor
    src: torch.Tensor
    contiguous: tuple[int, int] | None = None  # (first_row, count) when src is 0..m-1


def table_runs(table: BlockTable, blocks: dict[int, Block], block_size: int) -> list[Run]:
    """The table's stored tokens as runs, in order (step history first)."""
    bs = block_size
    runs: list[Run] = []
    entries = table.step_history + list(enumerate(table.block_ids, start=table.first_block))
    for i, block_id in entries:
        block = blocks[block_id]
        ntok = min(bs, table.num_tokens - i * bs)
        if runs:
            r = runs[-1]
            if (
                r.tier == block.tier
                and r.first_slot + r.num_slots == block.slot
                and r.num_tokens == r.num_slots * bs
                and r.token_start + r.num_tokens == i * bs
            ):
                runs[-1] = Run(
                    r.tier, r.first_slot, r.num_slots + 1, r.token_start, r.num_tokens + ntok
                )
                continue
        runs.append(Run(block.tier, block.slot, 1, i * bs, ntok))
    return runs


def token_writes(tier: str, rows: list[int], src: list[int]) -> TokenWrites:
    """TokenWrites of one tier; `contiguous` set when sources are 0..n-1 and rows one
    range (then a layer's write is one slice copy)."""
    contiguous = None
    if src == list(range(len(src))) and rows == list(range(rows[0], rows[0] + len(rows))):
        contiguous = (rows[0], len(rows))
    return TokenWrites(tier, torch.tensor(rows), torch.tensor(src), contiguous)


def pack_writes(
    rows_by_tier: dict[str, list[int]], src_by_tier: dict[str, list[int]]
) -> list[TokenWrites]:
    """TokenWrites per tier from the rows and sources a step collected."""
    return [token_writes(tier, rows, src_by_tier[tier]) for tier, rows in rows_by_tier.items()]
