"""Applying a planned placement: drops, moves between tiers, new blocks and copies on
write — steps that cannot fail, because the plan reserved every slot they take.

`PlacementApplier` is a part of the block manager: it takes the `BlockState` (pool,
tiers, tables, eviction order, counters), the `CachedBlocks` that release blocks and
the function that copies blocks between tiers. `blocks/placement.py` decides, this
module carries it out; `tiers.movement.copy_blocks` is the tier-to-tier copy it uses.
"""

from __future__ import annotations

from collections.abc import Hashable

from kvstrata.blocks.cached import CachedBlocks
from kvstrata.blocks.placement import PendingBlock, Placement
from kvstrata.blocks.pool import Block
from kvstrata.blocks.state import BlockState
from kvstrata.tiers.movement import CopyBlocks, copy_blocks, copy_chunk

__all__ = ["CopyBlocks", "PlacementApplier", "copy_blocks", "copy_chunk"]


class PlacementApplier:
    """`apply(plan, pending)` and the tier moves and copies it is made of; `demote`."""

    def __init__(self, state: BlockState, cached: CachedBlocks, copy: CopyBlocks) -> None:
        self.state = state
        self.cached = cached
        self.copy = copy

    def apply(self, plan: Placement, pending: list[PendingBlock]) -> None:
        self.apply_moves(plan)
        self.install(plan, pending)

    def apply_moves(self, plan: Placement) -> None:
        """Evict the plan's cached blocks and move blocks between tiers. The only part
        of a step that does I/O (a move to disk): a storage error raises with every
        table as it was (blocks already moved are whole where they now are)."""
        for block in plan.drops:
            self.state.num_evicted_cached += 1
            self.cached.release(block)
        for blocks, dst in plan.moves:
            self.move(blocks, dst)

    def install(self, plan: Placement, pending: list[PendingBlock]) -> None:
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
        state = self.state
        tier = state.tiers[tier_name]
        table = state.tables[seq_id]
        blocks = state.pool.blocks
        group.sort(key=lambda p: p.index)
        prev = made.get(group[0].index - 1)
        prev_pos = group[0].index - 1 - table.first_block
        if prev is None and 0 <= prev_pos < len(table.block_ids):
            prev = blocks[table.block_ids[prev_pos]]
        after = prev.slot if prev is not None and prev.tier == tier_name else None
        slots = tier.allocate(len(group), after=after)
        if slots is None:
            raise AssertionError(f"{tier_name}: placement promised {len(group)} free slots")
        out = {}
        for p, slot in zip(group, slots, strict=True):
            block = state.pool.new_block(tier_name, slot)
            block.is_sink = p.is_sink
            state.on_tier[tier_name].add(block.block_id)
            if p.copy_of is not None:
                old = blocks[p.copy_of]
                self.copy(state.tiers[old.tier], [old.slot], tier, [slot])
                block.num_tokens = p.num_tokens
            out[p.index] = block
        return out

    def _enter(self, seq_id: Hashable, new: dict[int, Block]) -> None:
        """Put a step's new blocks in the table: a copy on write replaces the open
        block, the others are appended."""
        state = self.state
        table = state.tables[seq_id]
        for index in sorted(new):
            block = new[index]
            pos = index - table.first_block
            if pos < len(table.block_ids):
                old_id = table.block_ids[pos]
                state.unhold(seq_id, [old_id])
                table.block_ids[pos] = block.block_id
                self.cached.decref(old_id)
            else:
                assert pos == len(table.block_ids), "a step's blocks follow the table's"
                table.block_ids.append(block.block_id)
            state.order.hold(seq_id, index, block.block_id, block.tier)
        state.runs_by_table.pop(seq_id, None)

    def demote(self, seq_id: Hashable, keep_tokens: int = 0) -> int:
        """Move a table's full blocks off the device to the tiers below, as far as their
        budgets have free slots (a preempted sequence: nothing is dropped or recomputed).
        Stay: the open last block, sinks, blocks other tables share, and — where the
        tier below is lossy — blocks holding any of the newest `keep_tokens` tokens.
        Returns the number of blocks moved."""
        state = self.state
        device = state.tier_order[0]
        table = state.tables[seq_id]
        bs = state.layout.block_size
        newest = table.num_tokens - keep_tokens
        blocks = state.pool.blocks
        todo = [
            (index, block)
            for index, block in (
                (i, blocks[b]) for i, b in enumerate(table.block_ids, table.first_block)
            )
            if block.tier == device
            and block.num_tokens == bs
            and block.ref_count == 1
            and not block.is_sink
        ]
        moved = 0
        for name in state.tier_order[1:]:
            tier = state.tiers[name]
            lossy = not tier.codec.lossless
            room = state.room(name)
            fits = [
                b for i, b in todo if b.tier == device and not (lossy and (i + 1) * bs > newest)
            ]
            take = fits[: max(room, 0)]
            if take:
                self.move(take, name)
                moved += len(take)
        return moved

    def move(self, blocks: list[Block], dst_name: str) -> None:
        """Move full blocks of one tier to another, freeing their old slots."""
        state = self.state
        src_name = blocks[0].tier
        src, dst = state.tiers[src_name], state.tiers[dst_name]
        slots = dst.allocate(len(blocks))
        if slots is None:
            raise AssertionError(f"{dst_name}: no free slots for a planned move")
        src_slots = [b.slot for b in blocks]
        try:
            self.copy(src, src_slots, dst, slots)
        except BaseException:  # e.g. a full disk: the blocks stay where they were
            dst.free(slots)
            raise
        src.free(src_slots)
        link = f"{src_name}->{dst_name}"
        state.bytes_moved[link] = state.bytes_moved.get(link, 0) + len(blocks) * dst.block_bytes
        state.num_moves += len(blocks)
        on_src, on_dst = state.on_tier[src_name], state.on_tier[dst_name]
        for block, slot in zip(blocks, slots, strict=True):
            on_src.discard(block.block_id)
            block.tier, block.slot = dst_name, slot
            on_dst.add(block.block_id)
            if not state.hash_to_block.move(block.block_id, src_name, dst_name):
                state.order.move(block.block_id, src_name, dst_name)
        state.runs_by_table.clear()
        if state.on_move is not None:
            state.on_move(blocks)
