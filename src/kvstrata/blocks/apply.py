"""Applying a planned placement: drops, moves between tiers, new blocks and copies on
write — steps that cannot fail, because the plan reserved every slot they take.

A mixin of `BlockManager` (it uses the manager's pool, tiers, tables and eviction
order); `blocks/placement.py` decides, this module carries it out.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

import torch

from kvstrata.blocks.placement import PendingBlock, Placement
from kvstrata.blocks.pool import Block
from kvstrata.tiers.base import Tier

# The most raw block bytes one step of a tier-to-tier copy stages (on the GPU, when
# blocks leave it through another codec).
COPY_CHUNK_BYTES = 32 * 2**20

if TYPE_CHECKING:
    from kvstrata.blocks.order import BlockOrder
    from kvstrata.blocks.pool import BlockPool
    from kvstrata.blocks.table import BlockTable
    from kvstrata.core.layout import BlockLayout


class ApplyPlacement:
    """`_apply(plan, pending)` and the tier moves and copies it is made of; `demote`."""

    pool: BlockPool
    tiers: dict[str, Tier]
    tables: dict[Hashable, BlockTable]
    on_tier: dict[str, set[int]]
    cached: dict[int, None]
    num_cached_on: dict[str, int]
    order: BlockOrder
    layout: BlockLayout
    num_moves: int
    num_evicted_cached: int
    bytes_moved: dict[str, int]
    on_move: Any
    _runs: dict
    tier_order: list[str]
    budget_slots: dict[str, int]

    def _apply(self, plan: Placement, pending: list[PendingBlock]) -> None:
        self._apply_moves(plan)
        self._install(plan, pending)

    def _apply_moves(self, plan: Placement) -> None:
        """Evict the plan's cached blocks and move blocks between tiers. The only part
        of a step that does I/O (a move to disk): a storage error raises with every
        table as it was (blocks already moved are whole where they now are)."""
        for block in plan.drops:
            self.num_evicted_cached += 1
            self._release(block)
        for blocks, dst in plan.moves:
            self._move(blocks, dst)

    def _install(self, plan: Placement, pending: list[PendingBlock]) -> None:
        """Give the step's pending blocks their planned tier and slot (no I/O but the
        copies on write, which stay within memory tiers: an open block is on the device)."""
        # slots and ids in rank order (as planned), then entered per table in index order
        groups: dict[tuple[Hashable, str], list[PendingBlock]] = {}
        for i in plan.install_order:
            groups.setdefault((pending[i].table, plan.new_tiers[i]), []).append(pending[i])
        made: dict[Hashable, dict[int, Block]] = {}
        for (seq_id, tier_name), group in groups.items():
            new = made.setdefault(seq_id, {})
            new.update(self._allocate(seq_id, tier_name, group, new))
        for seq_id, new in made.items():
            self._enter(seq_id, new)

    def _allocate(
        self, seq_id: Hashable, tier_name: str, group: list[PendingBlock], made: dict[int, Block]
    ) -> dict[int, Block]:
        """New blocks for pending blocks of one table on one tier, in slots consecutive
        after the table's previous block where possible (copies on write filled)."""
        tier = self.tiers[tier_name]
        table = self.tables[seq_id]
        group.sort(key=lambda p: p.index)
        prev = made.get(group[0].index - 1)
        prev_pos = group[0].index - 1 - table.first_block
        if prev is None and 0 <= prev_pos < len(table.block_ids):
            prev = self.pool.blocks[table.block_ids[prev_pos]]
        after = prev.slot if prev is not None and prev.tier == tier_name else None
        slots = tier.allocate(len(group), after=after)
        if slots is None:
            raise AssertionError(f"{tier_name}: placement promised {len(group)} free slots")
        out = {}
        for p, slot in zip(group, slots, strict=True):
            block = self.pool.new_block(tier_name, slot)
            block.is_sink = p.is_sink
            self.on_tier[tier_name].add(block.block_id)
            if p.copy_of is not None:
                old = self.pool.blocks[p.copy_of]
                self.copy_blocks(self.tiers[old.tier], [old.slot], tier, [slot])
                block.num_tokens = p.num_tokens
            out[p.index] = block
        return out

    def _enter(self, seq_id: Hashable, new: dict[int, Block]) -> None:
        """Put a step's new blocks in the table: a copy on write replaces the open
        block, the others are appended."""
        table = self.tables[seq_id]
        for index in sorted(new):
            block = new[index]
            pos = index - table.first_block
            if pos < len(table.block_ids):
                old_id = table.block_ids[pos]
                self._unhold(seq_id, [old_id])
                table.block_ids[pos] = block.block_id
                self._decref(old_id)
            else:
                assert pos == len(table.block_ids), "a step's blocks follow the table's"
                table.block_ids.append(block.block_id)
            self.order.hold(seq_id, index, block.block_id, block.tier)
        self._runs.pop(seq_id, None)

    def demote(self, seq_id: Hashable, keep_tokens: int = 0) -> int:
        """Move a table's full blocks off the device to the tiers below, as far as their
        budgets have free slots (a preempted sequence: nothing is dropped or recomputed).
        Stay: the open last block, sinks, blocks other tables share, and — where the
        tier below is lossy — blocks holding any of the newest `keep_tokens` tokens.
        Returns the number of blocks moved."""
        device = self.tier_order[0]
        table = self.tables[seq_id]
        bs = self.layout.block_size
        newest = table.num_tokens - keep_tokens
        todo = [
            (index, block)
            for index, block in (
                (i, self.pool.blocks[b]) for i, b in enumerate(table.block_ids, table.first_block)
            )
            if block.tier == device
            and block.num_tokens == bs
            and block.ref_count == 1
            and not block.is_sink
        ]
        moved = 0
        for name in self.tier_order[1:]:
            tier = self.tiers[name]
            lossy = not tier.codec.lossless
            room = min(self.budget_slots[name] - tier.num_used, tier.num_free)
            fits = [
                b for i, b in todo if b.tier == device and not (lossy and (i + 1) * bs > newest)
            ]
            take = fits[: max(room, 0)]
            if take:
                self._move(take, name)
                moved += len(take)
        return moved

    def _move(self, blocks: list[Block], dst_name: str) -> None:
        """Move full blocks of one tier to another, freeing their old slots."""
        src_name = blocks[0].tier
        src, dst = self.tiers[src_name], self.tiers[dst_name]
        slots = dst.allocate(len(blocks))
        if slots is None:
            raise AssertionError(f"{dst_name}: no free slots for a planned move")
        src_slots = [b.slot for b in blocks]
        try:
            self.copy_blocks(src, src_slots, dst, slots)
        except BaseException:  # e.g. a full disk: the blocks stay where they were
            dst.free(slots)
            raise
        src.free(src_slots)
        link = f"{src_name}->{dst_name}"
        self.bytes_moved[link] = self.bytes_moved.get(link, 0) + len(blocks) * dst.block_bytes
        self.num_moves += len(blocks)
        for block, slot in zip(blocks, slots, strict=True):
            self.on_tier[src_name].discard(block.block_id)
            block.tier, block.slot = dst_name, slot
            self.on_tier[dst_name].add(block.block_id)
            cached = block.block_id in self.cached
            if cached:
                self.num_cached_on[src_name] -= 1
                self.num_cached_on[dst_name] += 1
            cached_key = (block.last_access, -block.block_id) if cached else None
            self.order.move(block.block_id, src_name, dst_name, cached_key)
        self._runs.clear()
        if self.on_move is not None:
            self.on_move(blocks)

    def copy_blocks(self, src: Tier, src_slots: list[int], dst: Tier, dst_slots: list[int]) -> None:
        """Copy blocks between tiers, at most COPY_CHUNK_BYTES of raw blocks at a time:
        demoting a long sequence off a GPU must not need a raw copy of all of it there."""
        per = max(1, COPY_CHUNK_BYTES // max(1, self.layout.raw_block_bytes))
        for i in range(0, len(src_slots), per):
            self._copy_chunk(src, src_slots[i : i + per], dst, dst_slots[i : i + per])

    def _copy_chunk(self, src: Tier, src_slots: list[int], dst: Tier, dst_slots: list[int]) -> None:
        if src.codec.name == dst.codec.name:  # encoded as is: quantized once, never twice
            dst.write_encoded(dst_slots, src.read_encoded(src_slots))
            return
        n = len(src_slots)
        # Blocks leaving a GPU are decoded and re-encoded there: only encoded bytes cross
        # (a memory tier's write encodes where the data is; others get the fields here).
        gpu = getattr(src, "device", None)
        gpu = gpu if gpu is not None and gpu.type == "cuda" else None
        k = torch.empty(self.layout.raw_shape("k", n), dtype=self.layout.dtype, device=gpu)
        v = torch.empty(self.layout.raw_shape("v", n), dtype=self.layout.dtype, device=gpu)
        src.read_blocks(src_slots, k, v)
        if gpu is None or getattr(dst, "device", None) is not None:
            dst.write_blocks(dst_slots, k, v)
            return
        encoded = {}
        for kind, raw in (("k", k), ("v", v)):
            specs = dst.codec.fields(kind, self.layout)
            lead = raw.shape[:-2]
            fields = {
                f: torch.empty((*lead, n * s.rows, s.cols), dtype=s.dtype, device=gpu)
                for f, s in specs.items()
            }
            dst.codec.encode(kind, raw, fields)
            encoded.update({f"{kind}.{f}": t.cpu() for f, t in fields.items()})
        dst.write_encoded(dst_slots, encoded)
