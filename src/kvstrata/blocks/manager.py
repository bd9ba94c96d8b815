"""BlockManager: block tables -> (tier, slot); the request-level facade of blocks/.

The manager owns one `BlockState` (pool: ids and ref counts; tiers: slots and bytes;
tables; the eviction order of a pure policy; budgets, counters) and the parts that
take it: `CachedBlocks` (release, the content-hash index), `StepBlocks` (what a step
needs, sliding-window history, token writes), placement (`plan_step_placement`: pure) and the
`PlacementApplier`. A *table* is one sequence in one layer group (any hashable key;
the store uses (sequence, group)). Placement runs only when a step needs new blocks
or a budget changed — decode steps that fill the open block touch no Python per block.

Every mutation checks, then acts: the step's placement is planned as a value
(`blocks.placement.plan_placement`) before any block moves, copies or is allocated,
so a refused step (OutOfBlocksError) leaves everything as it was.

Invariants: a partially filled block lives on the device (lossy codecs only ever see
full blocks, so a block is encoded once); blocks written in the current step are
not moved until the step ends; a shared or cached block is never written.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from kvstrata.blocks import apply
from kvstrata.blocks.apply import PlacementApplier
from kvstrata.blocks.cached import CachedBlocks
from kvstrata.blocks.eviction import EvictionPolicy
from kvstrata.blocks.placement import PendingBlock, Placement, eviction_order, plan_step_placement
from kvstrata.blocks.pool import Block
from kvstrata.blocks.runs import Run, TokenWrites, table_runs
from kvstrata.blocks.state import BlockState
from kvstrata.blocks.step import StepBlocks
from kvstrata.blocks.table import BlockTable
from kvstrata.core.errors import ConfigError, KvstrataError, OutOfBlocksError
from kvstrata.core.layout import BlockLayout
from kvstrata.core.units import format_bytes
from kvstrata.tiers.base import Tier

__all__ = ["BlockManager", "Run", "TokenWrites"]


class BlockManager:
    """Block tables, their placement, and cached (unreferenced, hashed) blocks.

    The blocks' state (tables, pool, tiers, budgets, order, counters, hooks) is
    `self.state` (a `BlockState`); read and set it there."""

    def __init__(
        self,
        layout: BlockLayout,
        tiers: list[Tier],
        policy: EvictionPolicy,
        sink_tokens: int = 0,
    ) -> None:
        self.state = BlockState(layout, tiers, policy, sink_tokens)
        self._cached = CachedBlocks(self.state)
        self._step = StepBlocks(self.state, self._cached)
        # looked up at each copy (a subclass or a patch of copy_blocks takes effect)
        self._applier = PlacementApplier(self.state, self._cached, self._copy)

    # -- tables -------------------------------------------------------------------------------
    def add_sequence(self, seq_id: Hashable, window: int | None = None) -> None:
        """A new empty table; `window` makes it drop blocks the window cannot see."""
        state = self.state
        if seq_id in state.tables:
            raise AssertionError(f"sequence {seq_id} exists")
        state.tables[seq_id] = BlockTable(window=window)
        state.seq_last_access[seq_id] = state.clock
        state.seq_access_count[seq_id] = 0

    def has_sequence(self, seq_id: Hashable) -> bool:
        return seq_id in self.state.tables

    def num_tokens(self, seq_id: Hashable) -> int:
        return self.state.tables[seq_id].num_tokens

    def free_sequence(self, seq_id: Hashable) -> None:
        state = self.state
        table = state.tables.pop(seq_id)
        state.unhold(seq_id, table.block_ids)
        for block_id in table.held_ids():
            self._cached.decref(block_id)
        state.runs_by_table.pop(seq_id, None)
        state.seq_last_access.pop(seq_id, None)
        state.seq_access_count.pop(seq_id, None)

    def attach(
        self, seq_id: Hashable, block_ids: list[int], first_block: int, num_tokens: int
    ) -> None:
        """Point an empty table at existing full blocks (a prefix hit): logical blocks
        first_block .. first_block + len(block_ids) - 1, `num_tokens` tokens."""
        state = self.state
        table = state.tables[seq_id]
        assert not table.block_ids and not table.num_tokens
        for block_id in block_ids:
            block = state.pool.blocks[block_id]
            if block.ref_count == 0:
                self._cached.uncache(block)
            block.ref_count += 1
        table.block_ids = list(block_ids)
        table.first_block = first_block
        table.num_tokens = num_tokens
        state.hold(seq_id)
        state.runs_by_table.pop(seq_id, None)

    def fork(self, src_seq: Hashable, dst_seq: Hashable) -> None:
        """dst shares every block of src (ref counts); the first append to a shared
        partial block copies it (copy on write)."""
        state = self.state
        table = state.tables[src_seq].copy()
        for block_id in table.held_ids():
            state.pool.incref(block_id)
        if dst_seq in state.tables:
            self.free_sequence(dst_seq)
        state.tables[dst_seq] = table
        state.hold(dst_seq)
        state.seq_last_access[dst_seq] = state.seq_last_access[src_seq]
        state.seq_access_count[dst_seq] = state.seq_access_count[src_seq]
        state.runs_by_table.pop(dst_seq, None)

    def remap(self, sources: list) -> None:
        """Replace every table by new ones 0..len(sources)-1, where new table i shares
        every block of old table `sources[i]` (beam reorder, batch repeat, batch
        select). No data is copied; shared partial blocks are copied on write."""
        state = self.state
        old = {i: state.tables[s].copy() for i, s in enumerate(sources)}
        last, count = state.seq_last_access, state.seq_access_count
        access = {i: (last[s], count[s]) for i, s in enumerate(sources)}
        for table in old.values():
            for block_id in table.held_ids():
                state.pool.incref(block_id)
        for key in list(state.tables):
            self.free_sequence(key)
        for key, table in old.items():
            state.tables[key] = table
            state.seq_last_access[key], state.seq_access_count[key] = access[key]
            state.hold(key)
        state.runs_by_table.clear()

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Keep only the first `num_tokens` tokens (crop).

        Raises:
            OutOfBlocksError: the now-open last block must come back to the device
                and no device slot is free (nothing changed).
            KvstrataError: a sliding-window table already dropped blocks the cropped
                sequence's next query would see.
        """
        state = self.state
        table = state.tables[seq_id]
        if num_tokens >= table.num_tokens:
            return
        bs = state.layout.block_size
        keep = -(-num_tokens // bs)
        if table.window is not None and table.first_block > 0:
            need = max(0, num_tokens - (table.window - 1))
            if need < table.first_block * bs or keep <= table.first_block:
                raise KvstrataError(
                    f"cannot crop a sliding-window layer group to {num_tokens} tokens: its "
                    f"blocks before token {table.first_block * bs} were dropped (window "
                    f"{table.window}); crop by at most one block ({bs} tokens) at a time"
                )
        blocks = state.pool.blocks
        last = blocks[table.block_ids[keep - 1 - table.first_block]] if keep else None
        reopen = last is not None and num_tokens % bs != 0 and last.ref_count == 1
        device = state.tier_order[0]
        tail = table.block_ids[keep - table.first_block :]
        if reopen and last.tier != device:
            freed = sum(1 for i in tail if blocks[i].ref_count == 1 and blocks[i].tier == device)
            if state.room(device) + freed < 1:
                raise OutOfBlocksError(self._no_device_slot("a cropped block"))
        state.unhold(seq_id, tail)
        for block_id in tail:
            self._cached.decref(block_id)
        del table.block_ids[keep - table.first_block :]
        table.num_tokens = num_tokens
        if reopen:
            self._cached.unhash(last)
            last.num_tokens = num_tokens % bs
            if last.tier != device:  # a partial block must be on the device
                if state.room(device) < 1:  # the tail's blocks stayed cached
                    self._make_device_slot(last.tier)
                self._applier.move([last], device)
        state.runs_by_table.pop(seq_id, None)
        if state.on_truncate is not None:
            state.on_truncate(seq_id, num_tokens)

    def _make_device_slot(self, lower: str) -> None:
        """Free one device slot held by an unreferenced cached block (the check before
        counted them as free): the oldest one moves to tier `lower` when it has room,
        else it is dropped from the cache."""
        state = self.state

        def make_way(block_id: int) -> None:
            block = state.pool.blocks[block_id]
            if state.room(lower) > 0:
                self._applier.move([block], lower)
            else:
                self._cached.evict_cached(block_id)
                state.num_evicted_cached += 1

        if not state.hash_to_block.evict(state.tier_order[0], 1, make_way):
            raise OutOfBlocksError(self._no_device_slot("a cropped block"))

    def abort_step(self, seq_id: Hashable, num_tokens: int) -> None:
        """Undo a step that failed before `end_step`: the table goes back to its
        `num_tokens` tokens and the step's new blocks are released. Blocks the step
        moved stay where they are (their contents are whole).

        Raises:
            KvstrataError / OutOfBlocksError: the table cannot be restored (then the
                caller must not use it again).
        """
        state = self.state
        table = state.tables[seq_id]
        if table.step_first is not None:  # the step skipped past its window: put the
            new = table.block_ids  # history back (there may be none: a first prefill)
            state.unhold(seq_id, new)
            extra = [b for _, b in table.step_extra]
            table.block_ids = [b for _, b in table.step_history]
            table.first_block = table.step_first
            table.step_history, table.step_extra, table.step_first = [], [], None
            table.num_tokens = num_tokens
            for block_id in new + extra:
                self._cached.decref(block_id)
            state.hold(seq_id)
            state.runs_by_table.pop(seq_id, None)
            if state.on_truncate is not None:
                state.on_truncate(seq_id, num_tokens)
            return
        self.end_step([seq_id])
        self.truncate(seq_id, num_tokens)

    # -- budgets ------------------------------------------------------------------------------
    def set_budget(self, tier: str, num_slots: int) -> None:
        """Change a tier's budget at run time (dynamic offload ratio); enforced now."""
        state = self.state
        if tier not in state.tiers:
            raise ConfigError.field("tier", tier, f"one of {', '.join(state.tier_order)}")
        if not 0 <= num_slots <= state.tiers[tier].num_slots:
            raise ConfigError.field(
                f"{tier}_budget",
                num_slots,
                f"between 0 and the arena's {state.tiers[tier].num_slots} slots",
            )
        budgets = {**state.budget_slots, tier: num_slots}
        plan = self._plan([], set(), budgets)  # raises before anything changes
        state.budget_slots = budgets
        self._applier.apply(plan, [])

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
        state, step = self.state, self._step
        self.end_step(seq_ids)  # blocks a failed step left held
        needs = step.needs(seq_ids, counts)
        pending, skipped = needs.pending, needs.num_skipped
        plan = (
            self._plan(pending, needs.fixed_ids, state.budget_slots, seq_ids)
            if pending
            else Placement()
        )
        # -- act: moves first (a storage error there leaves every table as it was), then
        # the table changes, which cannot fail
        self._applier.apply_moves(plan)
        state.clock += 1
        for seq_id in seq_ids:
            state.seq_last_access[seq_id] = state.clock
            state.seq_access_count[seq_id] += 1
        for seq_id, live, first_new in needs.drops:
            step.drop_history(seq_id, live, first_new if seq_id in skipped else None)
        self._applier.install(plan, pending)
        bs = state.layout.block_size
        for seq_id, indices in needs.extra.items():
            kept = step.keep_extra(seq_id, indices)
            if kept is not None:
                skipped[seq_id] = kept * bs - state.tables[seq_id].num_tokens
        writes = step.writes(seq_ids, counts, skipped, grew=bool(pending))
        state.peak_live_bytes = max(state.peak_live_bytes, self.live_bytes())
        return writes

    def end_step(self, seq_ids: list) -> None:
        """The step's forward is over: release history held only for it."""
        self._step.end(seq_ids)

    def demote(self, seq_id: Hashable, keep_tokens: int = 0) -> int:
        """Move a table's full blocks off the device to the tiers below, as far as their
        budgets have free slots (a preempted sequence: nothing is dropped or recomputed).
        Stay: the open last block, sinks, blocks other tables share, and — where the
        tier below is lossy — blocks holding any of the newest `keep_tokens` tokens.
        Returns the number of blocks moved."""
        return self._applier.demote(seq_id, keep_tokens)

    # -- cached blocks ------------------------------------------------------------------------
    def set_hash(
        self,
        block_id: int,
        block_hash: bytes,
        token_ids: tuple[int, ...],
        parent: bytes | None = None,
    ) -> bool:
        """Index a full block under its content hash (chained to `parent`). False when
        another block already holds that hash (the first one stays the cached copy)."""
        return self._cached.set_hash(block_id, block_hash, token_ids, parent)

    def unhash(self, block: Block) -> None:
        """The block's contents no longer match its hash: unindex (and uncache) it."""
        self._cached.unhash(block)

    def evict_cached(self, block_id: int) -> None:
        """Drop an unreferenced cached block now (e.g. it failed verification)."""
        self._cached.evict_cached(block_id)

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
        return self._cached.adopt_cached(tier, slot, block_hash, token_ids, parent)

    # -- placement ----------------------------------------------------------------------------
    def eviction_order(self) -> list[int]:
        """Every block id, first to evict first (cached blocks before live ones; the
        blocks held only for a step in progress are not in the order)."""
        return eviction_order(self.state)

    def _plan(
        self, pending: list[PendingBlock], fixed: set[int], budgets: dict, stepping: list = ()
    ) -> Placement:
        return plan_step_placement(self.state, pending, fixed, budgets, stepping)

    def copy_blocks(self, src: Tier, src_slots: list[int], dst: Tier, dst_slots: list[int]) -> None:
        """Copy blocks between tiers, at most COPY_CHUNK_BYTES of raw blocks at a time:
        demoting a long sequence off a GPU must not need a raw copy of all of it there."""
        apply.copy_blocks(self.state.layout, src, src_slots, dst, dst_slots, self._copy_chunk)

    def _copy(self, src: Tier, src_slots: list[int], dst: Tier, dst_slots: list[int]) -> None:
        self.copy_blocks(src, src_slots, dst, dst_slots)

    def _copy_chunk(self, src: Tier, src_slots: list[int], dst: Tier, dst_slots: list[int]) -> None:
        apply.copy_chunk(self.state.layout, src, src_slots, dst, dst_slots)

    def _no_device_slot(self, what: str) -> str:
        device = self.state.tiers[self.state.tier_order[0]]
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
        state = self.state
        runs = state.runs_by_table.get(seq_id)
        if runs is None:
            runs = table_runs(state.tables[seq_id], state.pool.blocks, state.layout.block_size)
            state.runs_by_table[seq_id] = runs
        return runs

    def blocks_of(self, seq_id: Hashable) -> list[Block]:
        blocks = self.state.pool.blocks
        return [blocks[i] for i in self.state.tables[seq_id].block_ids]

    def block_at(self, seq_id: Hashable, index: int) -> int | None:
        """Id of the table's block at logical `index` (live or written by this step as
        a prefix-cache copy), or None when the table does not hold it."""
        table = self.state.tables[seq_id]
        pos = index - table.first_block
        if 0 <= pos < len(table.block_ids):
            return table.block_ids[pos]
        for i, block_id in table.step_extra:
            if i == index:
                return block_id
        return None

    # -- stats --------------------------------------------------------------------------------
    def live_bytes(self) -> int:
        """Stored bytes of the blocks sequences hold on every tier (cached blocks and a
        step's prefix-cache copies of skipped blocks excluded)."""
        state = self.state
        extra = dict.fromkeys(state.tier_order, 0)
        for table in state.tables.values():
            for _, block_id in table.step_extra:
                extra[state.pool.blocks[block_id].tier] += 1
        return sum(
            (len(state.on_tier[n]) - state.num_cached_on(n) - extra[n]) * state.tiers[n].block_bytes
            for n in state.tier_order
        )

    def occupancy(self) -> dict[str, dict[str, int]]:
        state = self.state
        out = {}
        for name in state.tier_order:
            tier = state.tiers[name]
            out[name] = {
                "used_blocks": tier.num_used,
                "cached_blocks": state.num_cached_on(name),
                "budget_blocks": state.budget_slots[name],
                "capacity_blocks": tier.num_slots,
                "used_bytes": tier.used_bytes,
                "block_bytes": tier.block_bytes,
                "peak_used_blocks": tier.stats.peak_used_slots,
            }
        return out
