"""A step's blocks: what an append needs before placement, and the table work after it.

`StepBlocks` is a part of the block manager that takes the `BlockState` and the
`CachedBlocks` that release blocks. Before placement it lists the blocks a step
needs (`needs`: new blocks, copies on write of shared or demoted open blocks, and
what a sliding window drops or skips) — reading only. After the plan's moves it
drops sliding-window history (`drop_history`), gives skipped full blocks free slots
as prefix-cache copies (`keep_extra`), and says where each new token is written
(`writes`); `end` releases what was held only for the step. A sliding table's
layout (dropped blocks, `step_history`, `step_extra`) is drawn in `blocks/table.py`.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from kvstrata.blocks.cached import CachedBlocks
from kvstrata.blocks.placement import PendingBlock
from kvstrata.blocks.runs import Run, TokenWrites, pack_writes
from kvstrata.blocks.state import BlockState
from kvstrata.tiers.memory import MemoryTier


@dataclass
class StepNeeds:
    """What a step needs, found before anything changes."""

    pending: list[PendingBlock] = field(default_factory=list)
    fixed_ids: set[int] = field(default_factory=set)  # open blocks the step writes
    drops: list[tuple[Hashable, int, int]] = field(default_factory=list)  # (table, first
    # live block, first new block) of each sliding table
    num_skipped: dict[Hashable, int] = field(default_factory=dict)  # new tokens not stored
    extra: dict[Hashable, range] = field(default_factory=dict)  # skipped full blocks worth
    # keeping as cache


def first_live_block(block_size: int, window: int, num_tokens: int) -> int:
    """The first block a sliding table of `num_tokens` tokens still needs."""
    return max(0, num_tokens - (window - 1) - block_size) // block_size


class StepBlocks:
    """The table side of a step: its needs, sliding history, kept copies, token writes."""

    def __init__(self, state: BlockState, cached: CachedBlocks) -> None:
        self.state = state
        self.cached = cached

    def needs(self, seq_ids: list, counts: list[int]) -> StepNeeds:
        """The blocks a step of `counts[i]` new tokens per table needs (changes nothing)."""
        state = self.state
        bs = state.layout.block_size
        device = state.tier_order[0]
        blocks = state.pool.blocks
        out = StepNeeds()
        for seq_id, num_new in zip(seq_ids, counts, strict=True):
            table = state.tables[seq_id]
            total = table.num_tokens + num_new
            first_new = table.num_blocks
            if table.window is not None:
                live = first_live_block(bs, table.window, table.num_tokens)
                after = first_live_block(bs, table.window, total)
                if after > first_new:
                    out.num_skipped[seq_id] = after * bs - table.num_tokens
                    if state.keep_skipped_blocks:
                        out.extra[seq_id] = range(first_new, after)
                    first_new = after
                out.drops.append((seq_id, live, first_new))
            if table.block_ids and table.num_tokens % bs and seq_id not in out.num_skipped:
                last = blocks[table.block_ids[-1]]
                if last.ref_count > 1 or last.tier != device:
                    out.pending.append(
                        PendingBlock(
                            seq_id, table.num_blocks - 1, table.num_tokens % bs,
                            last.is_sink, copy_of=last.block_id,
                        )
                    )  # fmt: skip
                out.fixed_ids.add(last.block_id)
            for idx in range(first_new, -(-total // bs)):
                out.pending.append(
                    PendingBlock(
                        seq_id, idx, min(bs, total - idx * bs), idx < state.num_sink_blocks
                    )
                )
        return out

    def drop_history(self, seq_id: Hashable, live: int, first_new: int | None) -> None:
        """Release a sliding table's blocks before `live`; with `first_new` (the step
        stores nothing before that block) the history is held until end_step."""
        state = self.state
        table = state.tables[seq_id]
        count = min(len(table.block_ids), live - table.first_block)
        if first_new is not None:  # the step's queries still read it: drop at end_step
            state.unhold(seq_id, table.block_ids)
            first = table.step_first = table.first_block
            table.step_history = [(first + i, b) for i, b in enumerate(table.block_ids)]
            table.first_block, table.block_ids = first_new, []
        elif count > 0:
            state.unhold(seq_id, table.block_ids[:count])
            for block_id in table.block_ids[:count]:
                self.cached.decref(block_id)
            del table.block_ids[:count]
            table.first_block += count
        else:
            return
        state.runs_by_table.pop(seq_id, None)

    def keep_extra(self, seq_id: Hashable, indices: range) -> int | None:
        """Give the newest of `indices` (full blocks outside the window after this
        step) free slots within the budgets of the memory tiers, fastest first; they
        are written by the step and become cached blocks at end_step (and reach the
        disk tier when the store closes). Returns the first kept index, or None."""
        state = self.state
        table = state.tables[seq_id]
        want = list(indices)
        kept: list[tuple[int, int]] = []
        for name in state.tier_order:
            tier = state.tiers[name]
            if not isinstance(tier, MemoryTier):  # no disk I/O for these in a prefill
                continue
            room = state.room(name)
            take = want[max(0, len(want) - room) :] if room > 0 else []
            if not take:
                continue
            want = want[: len(want) - len(take)]
            slots = tier.allocate(len(take))
            assert slots is not None
            for idx, slot in zip(take, slots, strict=True):
                block = state.pool.new_block(name, slot)
                state.on_tier[name].add(block.block_id)
                kept.append((idx, block.block_id))
            if not want:
                break
        table.step_extra = sorted(kept)
        return table.step_extra[0][0] if kept else None

    def writes(
        self, seq_ids: list, counts: list[int], num_skipped: dict[Hashable, int], grew: bool
    ) -> list[TokenWrites]:
        """Where each of the step's new tokens goes (per tier: arena rows and the token's
        index in the step's flattened order); the tables take their new length."""
        state = self.state
        bs = state.layout.block_size
        device = state.tier_order[0]
        blocks = state.pool.blocks
        rows_by_tier: dict[str, list[int]] = {}
        src_by_tier: dict[str, list[int]] = {}
        offset = 0
        for seq_id, num_new in zip(seq_ids, counts, strict=True):
            first_src, offset = offset, offset + num_new
            table = state.tables[seq_id]
            start = table.num_tokens
            pos = start + num_skipped.get(seq_id, 0)
            extra = dict(table.step_extra)
            while pos < start + num_new:
                idx = pos // bs
                if idx < table.first_block:
                    block = blocks[extra[idx]]
                else:
                    block = blocks[table.block_ids[idx - table.first_block]]
                off = pos % bs
                take = min(bs - off, start + num_new - pos)
                base = block.slot * bs + off
                rows_by_tier.setdefault(block.tier, []).extend(range(base, base + take))
                src0 = first_src + (pos - start)
                src_by_tier.setdefault(block.tier, []).extend(range(src0, src0 + take))
                block.num_tokens = off + take
                pos += take
            table.num_tokens = start + num_new
            runs = state.runs_by_table.get(seq_id)
            if runs and not grew and runs[-1].tier == device:
                last = runs[-1]
                runs[-1] = Run(
                    last.tier, last.first_slot, last.num_slots, last.token_start,
                    last.num_tokens + num_new,
                )  # fmt: skip
            else:
                state.runs_by_table.pop(seq_id, None)
        return pack_writes(rows_by_tier, src_by_tier)

    def end(self, seq_ids: list) -> None:
        """The step's forward is over: release history held only for it."""
        state = self.state
        for seq_id in seq_ids:
            table = state.tables.get(seq_id)
            if table is not None:
                table.step_first = None
            if table is not None and (table.step_history or table.step_extra):
                held = table.step_history + table.step_extra
                table.step_history, table.step_extra = [], []
                for _, block_id in held:
                    self.cached.decref(block_id)
                state.runs_by_table.pop(seq_id, None)
