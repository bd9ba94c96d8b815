"""BlockManager: block tables -> (tier, slot); placement, eviction and cached blocks.

The request-level facade over the pool (ids, ref counts), the tiers (slots, bytes)
and a pure eviction policy. A *table* is one sequence in one layer group (any
hashable key; the store uses (sequence, group)). Placement runs only when a step
needs new blocks or a budget changed — decode steps that fill the open block touch
no Python per block.

Every mutation checks, then acts: the step's placement is planned as a value
(`blocks.placement.plan_placement`) before any block moves, copies or is allocated,
so a refused step (OutOfBlocksError) leaves everything as it was.

Invariants: a partially filled block lives on the device (lossy codecs only ever see
full blocks, so a block is encoded once); blocks written in the current step are
not moved until the step ends; a shared or cached block is never written.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from kvstrata.blocks.apply import ApplyPlacement
from kvstrata.blocks.cached import CachedBlocks
from kvstrata.blocks.eviction import EvictionPolicy
from kvstrata.blocks.order import BlockOrder
from kvstrata.blocks.placement import PendingBlock, Placement, PlacementView, plan_placement
from kvstrata.blocks.pool import Block, BlockPool
from kvstrata.blocks.runs import Run, TokenWrites, pack_writes, table_runs
from kvstrata.blocks.table import BlockTable
from kvstrata.core.errors import ConfigError, KvstrataError, OutOfBlocksError
from kvstrata.core.layout import BlockLayout
from kvstrata.core.units import format_bytes
from kvstrata.tiers.base import Tier
from kvstrata.tiers.memory import MemoryTier


class BlockManager(ApplyPlacement, CachedBlocks):
    """Block tables, their placement, and cached (unreferenced, hashed) blocks."""

    def __init__(
        self,
        layout: BlockLayout,
        tiers: list[Tier],
        policy: EvictionPolicy,
        sink_tokens: int = 0,
    ) -> None:
        if not tiers:
            raise ConfigError.field("tiers", [], "at least a device tier")
        self.layout = layout
        self.tiers = {t.name: t for t in tiers}
        self.tier_order = [t.name for t in tiers]
        self.policy = policy
        self.num_sink_blocks = -(-sink_tokens // layout.block_size) if sink_tokens else 0
        self.pool = BlockPool()
        self.tables: dict[Hashable, BlockTable] = {}
        self.budget_slots = {t.name: t.num_slots for t in tiers}
        self.on_tier: dict[str, set[int]] = {t.name: set() for t in tiers}
        self.cached: dict[int, None] = {}  # unreferenced hashed blocks
        self.order = BlockOrder(policy, self.tier_order, self.num_sink_blocks)
        self.num_cached_on: dict[str, int] = {t.name: 0 for t in tiers}
        self.peak_live_bytes = 0  # referenced blocks (all tiers), highest after a step
        self.hash_to_block: dict[bytes, int] = {}
        self.clock = 0
        self.seq_last_access: dict[Hashable, int] = {}
        self.seq_access_count: dict[Hashable, int] = {}
        self._runs: dict[Hashable, list[Run]] = {}
        self.num_moves = 0
        self.num_evicted_cached = 0
        self.bytes_moved: dict[str, int] = {}
        # store full blocks a sliding window skips in a long step when slots are free,
        # so they can serve later prefix hits (the store turns it on with prefix caching)
        self.keep_skipped_blocks = False
        self.on_move = None  # callback(blocks) after blocks moved tier (the store keys them)

    # -- tables -------------------------------------------------------------------------------
    def add_sequence(self, seq_id: Hashable, window: int | None = None) -> None:
        """A new empty table; `window` makes it drop blocks the window cannot see."""
        if seq_id in self.tables:
            raise AssertionError(f"sequence {seq_id} exists")
        self.tables[seq_id] = BlockTable(window=window)
        self.seq_last_access[seq_id] = self.clock
        self.seq_access_count[seq_id] = 0

    def has_sequence(self, seq_id: Hashable) -> bool:
        return seq_id in self.tables

    def num_tokens(self, seq_id: Hashable) -> int:
        return self.tables[seq_id].num_tokens

    def free_sequence(self, seq_id: Hashable) -> None:
        table = self.tables.pop(seq_id)
        self._unhold(seq_id, table.block_ids)
        for block_id in self._held(table):
            self._decref(block_id)
        self._runs.pop(seq_id, None)
        self.seq_last_access.pop(seq_id, None)
        self.seq_access_count.pop(seq_id, None)

    def _hold(self, seq_id: Hashable) -> None:
        """Enter every block of the table in the eviction order."""
        table = self.tables[seq_id]
        for i, block_id in enumerate(table.block_ids, start=table.first_block):
            self.order.hold(seq_id, i, block_id, self.pool.blocks[block_id].tier)

    def _unhold(self, seq_id: Hashable, block_ids: list[int]) -> None:
        """The table no longer holds these blocks in its `block_ids`."""
        for block_id in block_ids:
            self.order.drop(seq_id, block_id, self.pool.blocks[block_id].tier)

    @staticmethod
    def _held(table: BlockTable) -> list[int]:
        """Every block id a table holds a reference to."""
        return table.block_ids + [b for _, b in table.step_history + table.step_extra]

    def attach(
        self, seq_id: Hashable, block_ids: list[int], first_block: int, num_tokens: int
    ) -> None:
        """Point an empty table at existing full blocks (a prefix hit): logical blocks
        first_block .. first_block + len(block_ids) - 1, `num_tokens` tokens."""
        table = self.tables[seq_id]
        assert not table.block_ids and not table.num_tokens
        for block_id in block_ids:
            block = self.pool.blocks[block_id]
            if block.ref_count == 0:
                self._uncache(block)
            block.ref_count += 1
        table.block_ids = list(block_ids)
        table.first_block = first_block
        table.num_tokens = num_tokens
        self._hold(seq_id)
        self._runs.pop(seq_id, None)

    def fork(self, src_seq: Hashable, dst_seq: Hashable) -> None:
        """dst shares every block of src (ref counts); the first append to a shared
        partial block copies it (copy on write)."""
        table = self.tables[src_seq].copy()
        for block_id in self._held(table):
            self.pool.incref(block_id)
        if dst_seq in self.tables:
            self.free_sequence(dst_seq)
        self.tables[dst_seq] = table
        self._hold(dst_seq)
        self.seq_last_access[dst_seq] = self.seq_last_access[src_seq]
        self.seq_access_count[dst_seq] = self.seq_access_count[src_seq]
        self._runs.pop(dst_seq, None)

    def remap(self, sources: list) -> None:
        """Replace every table by new ones 0..len(sources)-1, where new table i shares
        every block of old table `sources[i]` (beam reorder, batch repeat, batch
        select). No data is copied; shared partial blocks are copied on write."""
        old = {i: self.tables[s].copy() for i, s in enumerate(sources)}
        last, count = self.seq_last_access, self.seq_access_count
        access = {i: (last[s], count[s]) for i, s in enumerate(sources)}
        for table in old.values():
            for block_id in self._held(table):
                self.pool.incref(block_id)
        for key in list(self.tables):
            self.free_sequence(key)
        for key, table in old.items():
            self.tables[key] = table
            self.seq_last_access[key], self.seq_access_count[key] = access[key]
            self._hold(key)
        self._runs.clear()

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Keep only the first `num_tokens` tokens (crop).

        Raises:
            OutOfBlocksError: the now-open last block must come back to the device
                and no device slot is free (nothing changed).
            KvstrataError: a sliding-window table already dropped blocks the cropped
                sequence's next query would see.
        """
        table = self.tables[seq_id]
        if num_tokens >= table.num_tokens:
            return
        bs = self.layout.block_size
        keep = -(-num_tokens // bs)
        if table.window is not None and table.first_block > 0:
            need = max(0, num_tokens - (table.window - 1))
            if need < table.first_block * bs or keep <= table.first_block:
                raise KvstrataError(
                    f"cannot crop a sliding-window layer group to {num_tokens} tokens: its "
                    f"blocks before token {table.first_block * bs} were dropped (window "
                    f"{table.window}); crop by at most one block ({bs} tokens) at a time"
                )
        last = self.pool.blocks[table.block_ids[keep - 1 - table.first_block]] if keep else None
        reopen = last is not None and num_tokens % bs != 0 and last.ref_count == 1
        device = self.tier_order[0]
        if reopen and last.tier != device:
            drop = table.block_ids[keep - table.first_block :]
            freed = sum(
                1
                for i in drop
                if self.pool.blocks[i].ref_count == 1 and self.pool.blocks[i].tier == device
            )
            if self.tiers[device].num_free + freed < 1:
                raise OutOfBlocksError(self._no_device_slot("a cropped block"))
        tail = table.block_ids[keep - table.first_block :]
        self._unhold(seq_id, tail)
        for block_id in tail:
            self._decref(block_id)
        del table.block_ids[keep - table.first_block :]
        table.num_tokens = num_tokens
        if reopen:
            self.unhash(last)
            last.num_tokens = num_tokens % bs
            if last.tier != device:  # a partial block must be on the device
                self._move([last], device)
        self._runs.pop(seq_id, None)

    def abort_step(self, seq_id: Hashable, num_tokens: int) -> None:
        """Undo a step that failed before `end_step`: the table goes back to its
        `num_tokens` tokens and the step's new blocks are released. Blocks the step
        moved stay where they are (their contents are whole).

        Raises:
            KvstrataError / OutOfBlocksError: the table cannot be restored (then the
                caller must not use it again).
        """
        table = self.tables[seq_id]
        if table.step_first is not None:  # the step skipped past its window: put the
            new = table.block_ids  # history back (there may be none: a first prefill)
            self._unhold(seq_id, new)
            extra = [b for _, b in table.step_extra]
            table.block_ids = [b for _, b in table.step_history]
            table.first_block = table.step_first
            table.step_history, table.step_extra, table.step_first = [], [], None
            table.num_tokens = num_tokens
            for block_id in new + extra:
                self._decref(block_id)
            self._hold(seq_id)
            self._runs.pop(seq_id, None)
            return
        self.end_step([seq_id])
        self.truncate(seq_id, num_tokens)

    # -- budgets ------------------------------------------------------------------------------
    def set_budget(self, tier: str, num_slots: int) -> None:
        """Change a tier's budget at run time (dynamic offload ratio); enforced now."""
        if tier not in self.tiers:
            raise ConfigError.field("tier", tier, f"one of {', '.join(self.tier_order)}")
        if not 0 <= num_slots <= self.tiers[tier].num_slots:
            raise ConfigError.field(
                f"{tier}_budget",
                num_slots,
                f"between 0 and the arena's {self.tiers[tier].num_slots} slots",
            )
        budgets = {**self.budget_slots, tier: num_slots}
        plan = self._plan([], set(), budgets)  # raises before anything changes
        self.budget_slots = budgets
        self._apply(plan, [])

    # -- the step -----------------------------------------------------------------------------
    def append(self, seq_ids: list, num_new: int | Sequence[int]) -> list[TokenWrites]:
        """Make room for `num_new` tokens at the end of each table (one count for all,
        or one per table: a ragged step).

        Returns where each new token goes: per tier, arena rows and the index of the
        token in the flattened order of this step (each table's tokens in turn).
        Tokens of a sliding table that its window no longer sees after the step are
        not stored.
        """
        counts = [num_new] * len(seq_ids) if isinstance(num_new, int) else list(num_new)
        if len(counts) != len(seq_ids) or min(counts, default=1) < 0:
            raise ValueError(f"append: {len(counts)} token counts for {len(seq_ids)} tables")
        bs = self.layout.block_size
        device = self.tier_order[0]
        pending: list[PendingBlock] = []
        fixed: set[int] = set()
        drops: list[tuple[Hashable, int, int]] = []  # (table, first live, first new)
        skip: dict[Hashable, int] = {}  # new tokens of a table not stored
        extra: dict[Hashable, range] = {}  # full skipped blocks worth keeping as cache
        self.end_step(seq_ids)  # blocks a failed step left held
        for seq_id, num_new in zip(seq_ids, counts, strict=True):
            table = self.tables[seq_id]
            total = table.num_tokens + num_new
            first_new = table.num_blocks
            if table.window is not None:
                live = self._first_live_block(table.window, table.num_tokens)
                after = self._first_live_block(table.window, total)
                if after > first_new:
                    skip[seq_id] = after * bs - table.num_tokens
                    if self.keep_skipped_blocks:
                        extra[seq_id] = range(first_new, after)
                    first_new = after
                drops.append((seq_id, live, first_new))
            if table.block_ids and table.num_tokens % bs and seq_id not in skip:
                last = self.pool.blocks[table.block_ids[-1]]
                if last.ref_count > 1 or last.tier != device:
                    pending.append(
                        PendingBlock(
                            seq_id, table.num_blocks - 1, table.num_tokens % bs,
                            last.is_sink, copy_of=last.block_id,
                        )
                    )  # fmt: skip
                fixed.add(last.block_id)
            for idx in range(first_new, -(-total // bs)):
                pending.append(
                    PendingBlock(seq_id, idx, min(bs, total - idx * bs), idx < self.num_sink_blocks)
                )
        plan = self._plan(pending, fixed, self.budget_slots, seq_ids) if pending else Placement()
        # -- act: moves first (a storage error there leaves every table as it was), then
        # the table changes, which cannot fail
        self._apply_moves(plan)
        self.clock += 1
        for seq_id in seq_ids:
            self.seq_last_access[seq_id] = self.clock
            self.seq_access_count[seq_id] += 1
        for seq_id, live, first_new in drops:
            self._drop_history(seq_id, live, first_new if seq_id in skip else None)
        self._install(plan, pending)
        for seq_id, indices in extra.items():
            kept = self._keep_extra(seq_id, indices)
            if kept is not None:
                skip[seq_id] = kept * bs - self.tables[seq_id].num_tokens
        writes = self._token_writes(seq_ids, counts, skip, grew=bool(pending))
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes())
        return writes

    def _keep_extra(self, seq_id: Hashable, indices: range) -> int | None:
        """Give the newest of `indices` (full blocks outside the window after this
        step) free slots within the budgets of the memory tiers, fastest first; they
        are written by the step and become cached blocks at end_step (and reach the
        disk tier when the store closes). Returns the first kept index, or None."""
        table = self.tables[seq_id]
        want = list(indices)
        kept: list[tuple[int, int]] = []
        for name in self.tier_order:
            tier = self.tiers[name]
            if not isinstance(tier, MemoryTier):  # no disk I/O for these in a prefill
                continue
            room = min(self.budget_slots[name] - tier.num_used, tier.num_free)
            take = want[max(0, len(want) - room) :] if room > 0 else []
            if not take:
                continue
            want = want[: len(want) - len(take)]
            slots = tier.allocate(len(take))
            assert slots is not None
            for idx, slot in zip(take, slots, strict=True):
                block = self.pool.new_block(name, slot)
                self.on_tier[name].add(block.block_id)
                kept.append((idx, block.block_id))
            if not want:
                break
        table.step_extra = sorted(kept)
        return table.step_extra[0][0] if kept else None

    def live_bytes(self) -> int:
        """Stored bytes of the blocks sequences hold on every tier (cached blocks and a
        step's prefix-cache copies of skipped blocks excluded)."""
        extra = dict.fromkeys(self.tier_order, 0)
        for table in self.tables.values():
            for _, block_id in table.step_extra:
                extra[self.pool.blocks[block_id].tier] += 1
        return sum(
            (len(self.on_tier[n]) - self.num_cached_on[n] - extra[n]) * self.tiers[n].block_bytes
            for n in self.tier_order
        )

    def block_at(self, seq_id: Hashable, index: int) -> int | None:
        """Id of the table's block at logical `index` (live or written by this step as
        a prefix-cache copy), or None when the table does not hold it."""
        table = self.tables[seq_id]
        pos = index - table.first_block
        if 0 <= pos < len(table.block_ids):
            return table.block_ids[pos]
        for i, block_id in table.step_extra:
            if i == index:
                return block_id
        return None

    def end_step(self, seq_ids: list) -> None:
        """The step's forward is over: release history held only for it."""
        for seq_id in seq_ids:
            table = self.tables.get(seq_id)
            if table is not None:
                table.step_first = None
            if table is not None and (table.step_history or table.step_extra):
                held = table.step_history + table.step_extra
                table.step_history, table.step_extra = [], []
                for _, block_id in held:
                    self._decref(block_id)
                self._runs.pop(seq_id, None)

    def _first_live_block(self, window: int, num_tokens: int) -> int:
        bs = self.layout.block_size
        return max(0, num_tokens - (window - 1) - bs) // bs

    def _drop_history(self, seq_id: Hashable, live: int, first_new: int | None) -> None:
        """Release a sliding table's blocks before `live`; with `first_new` (the step
        stores nothing before that block) the history is held until end_step."""
        table = self.tables[seq_id]
        count = min(len(table.block_ids), live - table.first_block)
        if first_new is not None:  # the step's queries still read it: drop at end_step
            self._unhold(seq_id, table.block_ids)
            first = table.step_first = table.first_block
            table.step_history = [(first + i, b) for i, b in enumerate(table.block_ids)]
            table.first_block, table.block_ids = first_new, []
        elif count > 0:
            self._unhold(seq_id, table.block_ids[:count])
            for block_id in table.block_ids[:count]:
                self._decref(block_id)
            del table.block_ids[:count]
            table.first_block += count
        else:
            return
        self._runs.pop(seq_id, None)

    def _token_writes(
        self, seq_ids: list, counts: list[int], skip: dict[Hashable, int], grew: bool
    ) -> list[TokenWrites]:
        bs = self.layout.block_size
        device = self.tier_order[0]
        rows_by_tier: dict[str, list[int]] = {}
        src_by_tier: dict[str, list[int]] = {}
        offset = 0
        for seq_id, num_new in zip(seq_ids, counts, strict=True):
            first_src, offset = offset, offset + num_new
            table = self.tables[seq_id]
            start = table.num_tokens
            pos = start + skip.get(seq_id, 0)
            extra = dict(table.step_extra)
            while pos < start + num_new:
                idx = pos // bs
                if idx < table.first_block:
                    block = self.pool.blocks[extra[idx]]
                else:
                    block = self.pool.blocks[table.block_ids[idx - table.first_block]]
                off = pos % bs
                take = min(bs - off, start + num_new - pos)
                base = block.slot * bs + off
                rows_by_tier.setdefault(block.tier, []).extend(range(base, base + take))
                src0 = first_src + (pos - start)
                src_by_tier.setdefault(block.tier, []).extend(range(src0, src0 + take))
                block.num_tokens = off + take
                pos += take
            table.num_tokens = start + num_new
            runs = self._runs.get(seq_id)
            if runs and not grew and runs[-1].tier == device:
                last = runs[-1]
                runs[-1] = Run(
                    last.tier, last.first_slot, last.num_slots, last.token_start,
                    last.num_tokens + num_new,
                )  # fmt: skip
            else:
                self._runs.pop(seq_id, None)
        return pack_writes(rows_by_tier, src_by_tier)

    # -- placement ----------------------------------------------------------------------------
    def eviction_order(self) -> list[int]:
        """Every block id, first to evict first (cached blocks before live ones; the
        blocks held only for a step in progress are not in the order)."""
        view = PlacementView(self, [], set(), set())
        return [block_id for _key, block_id in self.order.ascending(self.tier_order, view.state)]

    def _plan(
        self, pending: list[PendingBlock], fixed: set[int], budgets: dict, stepping: list = ()
    ) -> Placement:
        # blocks held only for a step in progress (another table's) do not move
        fixed = fixed | {b for t in self.tables.values() for _, b in t.step_history + t.step_extra}
        return plan_placement(PlacementView(self, pending, fixed, set(stepping)), budgets, pending)

    def _no_device_slot(self, what: str) -> str:
        device = self.tiers[self.tier_order[0]]
        return (
            f"device tier has no free slot ({format_bytes(device.block_bytes)}) for {what}: "
            f"all {device.num_slots} slots "
            f"({format_bytes(device.capacity_bytes)}) hold blocks being written; "
            f"raise device_budget or lower block_size"
        )

    # -- reading ------------------------------------------------------------------------------
    def runs(self, seq_id: Hashable) -> list[Run]:
        """The table's stored tokens as runs of consecutive slots per tier, in order
        (a sliding table starts at its first live block)."""
        runs = self._runs.get(seq_id)
        if runs is None:
            runs = table_runs(self.tables[seq_id], self.pool.blocks, self.layout.block_size)
            self._runs[seq_id] = runs
        return runs

    def blocks_of(self, seq_id: Hashable) -> list[Block]:
        return [self.pool.blocks[i] for i in self.tables[seq_id].block_ids]

    # -- stats --------------------------------------------------------------------------------
    def occupancy(self) -> dict[str, dict[str, int]]:
        cached_on = self.num_cached_on
        out = {}
        for name in self.tier_order:
            tier = self.tiers[name]
            out[name] = {
                "used_blocks": tier.num_used,
                "cached_blocks": cached_on[name],
                "budget_blocks": self.budget_slots[name],
                "capacity_blocks": tier.num_slots,
                "used_bytes": tier.used_bytes,
                "block_bytes": tier.block_bytes,
                "peak_used_blocks": tier.stats.peak_used_slots,
            }
        return out
