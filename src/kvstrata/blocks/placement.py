"""Placement as a value: which blocks end on which tier, decided before anything moves.

The cascade, tiers ordered fastest first:

    tier 0 (device): keep the top-K ranked blocks (K = budget in slots), where the
                     candidates are its movable blocks + this step's new blocks;
                     the rest spill down
    tier 1 (host):   same, with the spill of tier 0 as incoming
    tier 2 (disk):   same; what spills from the last tier must be cached
                     (unreferenced) blocks, which are dropped — a live block spilling
                     there is an OutOfBlocksError, raised before anything changed

`plan_placement` is pure: it returns a `Placement` (moves, drops, the tier of every
new block) or raises. `BlockManager` applies it with steps that cannot fail (the
plan reserved every slot they take).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstrata.blocks.order import TableState
from kvstrata.blocks.pool import Block
from kvstrata.core.errors import OutOfBlocksError
from kvstrata.core.units import format_bytes

if TYPE_CHECKING:
    from kvstrata.blocks.manager import BlockManager


@dataclass
class PendingBlock:
    """A block this step needs, before placement gives it an id, a tier and a slot.

    `copy_of` is set for a copy on write of a shared or demoted open block."""

    table: object
    index: int  # logical position in the table
    num_tokens: int
    is_sink: bool = False
    copy_of: int | None = None


@dataclass
class Placement:
    """What a step does to the tiers, in the order it is applied."""

    drops: list[Block] = field(default_factory=list)  # cached blocks evicted for good
    moves: list[tuple[list[Block], str]] = field(default_factory=list)  # (blocks, dest)
    new_tiers: list[str] = field(default_factory=list)  # tier of each pending block
    install_order: list[int] = field(default_factory=list)  # pending indices, rank order


class PlacementView:
    """The manager as one placement sees it: counts, pinned blocks, keys, and each
    tier's eviction order (built per plan in O(tables + pinned blocks)).

    Pinned blocks do not move this step: `fixed_ids` (open blocks being written and
    blocks held for a step in progress) and partially filled blocks. Tables in
    `stepping` are seen as accessed by this step; `pending` blocks count in their
    table's length."""

    def __init__(
        self, mgr: BlockManager, pending: list[PendingBlock], fixed_ids: set[int], stepping: set
    ) -> None:
        self.mgr = mgr
        self.tiers, self.tier_order = mgr.tiers, mgr.tier_order
        self.block_size = bs = mgr.layout.block_size
        self.num_tables = len(mgr.tables)
        self.raw_block_bytes = mgr.layout.raw_block_bytes
        new_count: dict[Hashable, int] = {}
        for p in pending:
            if p.copy_of is None:
                new_count[p.table] = new_count.get(p.table, 0) + 1
        self._new_count = new_count
        self._stepping = stepping
        self._states: dict[Hashable, TableState] = {}
        blocks = mgr.pool.blocks
        self.pinned = set(fixed_ids)
        for table in mgr.tables.values():
            if table.block_ids and blocks[table.block_ids[-1]].num_tokens < bs:
                self.pinned.add(table.block_ids[-1])
        self._pinned_on = dict.fromkeys(self.tier_order, 0)
        for block_id in self.pinned:
            self._pinned_on[blocks[block_id].tier] += 1
        assert {p.table for p in pending} <= stepping, "new blocks belong to this step"
        self._pending_key = {
            id(p): mgr.order.live_key(self.state(p.table), p.index, -(i + 1))
            for i, p in enumerate(pending)
        }

    def state(self, table: Hashable) -> TableState:
        state = self._states.get(table)
        if state is None:
            mgr = self.mgr
            n = mgr.tables[table].num_blocks + self._new_count.get(table, 0)
            last, count = mgr.seq_last_access[table], mgr.seq_access_count[table]
            if table in self._stepping:
                last, count = mgr.clock + 1, count + 1
            state = self._states[table] = TableState(n, last, count)
        return state

    def num_on(self, tier: str) -> int:
        return len(self.mgr.on_tier[tier])

    def pinned_on(self, tier: str) -> int:
        return self._pinned_on[tier]

    def key(self, b: Block | PendingBlock) -> tuple:
        """Keep-key (larger = more deserving of the faster tier)."""
        if isinstance(b, PendingBlock):
            return self._pending_key[id(b)]
        if b.block_id in self.mgr.cached:
            return (0, b.last_access, -b.block_id)
        return self.mgr.order.block_key(b.block_id, self.state)

    def lowest(self, tier: str) -> Iterator[tuple[tuple, Block]]:
        """Movable blocks of a tier, lowest keep-key first."""
        blocks = self.mgr.pool.blocks
        for key, block_id in self.mgr.order.ascending([tier], self.state):
            if block_id not in self.pinned:
                yield key, blocks[block_id]


def plan_placement(
    view: PlacementView,
    budgets: dict[str, int],
    pending: list[PendingBlock],
) -> Placement:
    """Decide where every block goes; raise OutOfBlocksError when it cannot fit.

    Per tier only the blocks that must leave are looked at: the tier keeps its
    movable blocks plus the incoming ones up to its room, so the `excess` lowest of
    them (a lazy merge of the tier's eviction order with the sorted incoming blocks)
    spill to the next tier. Nothing is sorted but the incoming blocks.
    """
    tier_order, block_size = view.tier_order, view.block_size
    device = tier_order[0]
    incoming: list = list(pending)
    decisions: list[tuple[str, list, list]] = []  # (tier, arrive, leave)
    for depth, name in enumerate(tier_order):
        pinned = view.pinned_on(name)
        must = [b for b in incoming if b.num_tokens < block_size] if depth == 0 else []
        if depth > 0 and any(b.num_tokens < block_size for b in incoming):
            raise AssertionError("partial blocks never leave the device")
        room = budgets[name] - pinned - len(must)
        if room < 0:
            tier = view.tiers[name]
            need = (pinned + len(must)) * tier.block_bytes
            raise OutOfBlocksError(
                f"{name} tier needs {format_bytes(need)} for blocks being written "
                f"(open blocks of {view.num_tables} sequences) but its budget is "
                f"{format_bytes(budgets[name] * tier.block_bytes)}: raise "
                f"{name}_budget or lower block_size"
            )
        full_in = sorted(
            ((view.key(b), b) for b in incoming if b.num_tokens >= block_size),
            key=lambda e: e[0],
        )
        excess = view.num_on(name) - pinned + len(full_in) - room
        spill: list = []
        if excess > 0:
            merged = heapq.merge(view.lowest(name), full_in, key=lambda e: e[0])
            spill = [b for _key, b in itertools.islice(merged, excess)]
        spilled = {id(b) for b in spill}
        arrive = must + [b for _k, b in reversed(full_in) if id(b) not in spilled]
        leave = [b for b in spill if isinstance(b, Block) and b.tier == name]
        decisions.append((name, arrive, leave))
        incoming = spill[::-1]  # best first
        # No early exit when nothing spills: a lower tier whose budget just shrank
        # (set_budget) must still demote its own surplus.
    dropped = [b for b in incoming if isinstance(b, Block) and b.ref_count == 0]
    stuck = [b for b in incoming if not (isinstance(b, Block) and b.ref_count == 0)]
    if stuck:
        avail = ", ".join(
            f"{n}={format_bytes(budgets[n] * view.tiers[n].block_bytes)}" for n in tier_order
        )
        raise OutOfBlocksError(
            f"all tiers are full: {len(stuck)} more blocks "
            f"({format_bytes(len(stuck) * view.raw_block_bytes)} raw) needed, budgets {avail}; "
            + (
                "raise device_budget (or resident_fraction / max_tokens), or add a host "
                "tier (host_budget) or a disk tier (disk_dir, disk_budget)"
                if len(tier_order) == 1
                else "raise host_budget or disk_budget (or use a smaller codec on the lower tiers)"
            )
        )
    plan = Placement(drops=dropped)
    # Moves run deepest tier first so every move finds a free slot; a block that
    # spills through several tiers moves straight to the tier that keeps it.
    dest = {id(b): name for name, arrive, _leave in decisions for b in arrive}
    for _name, _arrive, leave in reversed(decisions):
        by_dest: dict[str, list[Block]] = {}
        for b in sorted(leave, key=lambda b: b.block_id):
            if id(b) in dest:
                by_dest.setdefault(dest[id(b)], []).append(b)
        for dst_name in sorted(by_dest, key=tier_order.index, reverse=True):
            plan.moves.append((by_dest[dst_name], dst_name))
    plan.new_tiers = [dest[id(p)] for p in pending]
    index = {id(p): i for i, p in enumerate(pending)}
    plan.install_order = [
        index[id(b)] for _n, arrive, _l in decisions for b in arrive if id(b) in index
    ]
    assert all(dest[id(p)] == device for p in pending if p.num_tokens < block_size)
    return plan
