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
new block) or raises. It reads the `BlockState` through a `PlacementView` and
changes nothing; `blocks/apply.py` carries a plan out with steps that cannot fail
(the plan reserved every slot they take).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass, field

from kvstrata.blocks.order import TableState
from kvstrata.blocks.pool import Block
from kvstrata.blocks.state import BlockState
from kvstrata.core.errors import OutOfBlocksError
from kvstrata.core.units import format_bytes


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
    """The block state as one placement sees it: counts, pinned blocks, keys, and each
    tier's eviction order (built per plan in O(tables + pinned blocks)).

    Pinned blocks do not move this step: `fixed_ids` (open blocks being written and
    blocks held for a step in progress) and partially filled blocks. Tables in
    `stepping` are seen as accessed by this step; `pending` blocks count in their
    table's length."""

    def __init__(
        self,
        block_state: BlockState,
        pending: list[PendingBlock],
        fixed_ids: set[int],
        stepping: set,
    ) -> None:
        self.block_state = block_state
        self.tiers, self.tier_order = block_state.tiers, block_state.tier_order
        self.block_size = bs = block_state.layout.block_size
        self.num_tables = len(block_state.tables)
        self.raw_block_bytes = block_state.layout.raw_block_bytes
        new_count: dict[Hashable, int] = {}
        for p in pending:
            if p.copy_of is None:
                new_count[p.table] = new_count.get(p.table, 0) + 1
        self._new_count = new_count
        self._stepping = stepping
        self._states: dict[Hashable, TableState] = {}
        blocks = block_state.pool.blocks
        self.pinned = set(fixed_ids)
        for table in block_state.tables.values():
            if table.block_ids and blocks[table.block_ids[-1]].num_tokens < bs:
                self.pinned.add(table.block_ids[-1])
        self._pinned_on = dict.fromkeys(self.tier_order, 0)
        for block_id in self.pinned:
            self._pinned_on[blocks[block_id].tier] += 1
        assert {p.table for p in pending} <= stepping, "new blocks belong to this step"
        self._pending_key = {
            id(p): block_state.order.live_key(self.state(p.table), p.index, -(i + 1))
            for i, p in enumerate(pending)
        }

    def state(self, table: Hashable) -> TableState:
        state = self._states.get(table)
        if state is None:
            block_state = self.block_state
            n = block_state.tables[table].num_blocks + self._new_count.get(table, 0)
            last, count = block_state.seq_last_access[table], block_state.seq_access_count[table]
            if table in self._stepping:
                last, count = block_state.clock + 1, count + 1
            state = self._states[table] = TableState(n, last, count)
        return state

    def num_on(self, tier: str) -> int:
        return len(self.block_state.on_tier[tier])

    def pinned_on(self, tier: str) -> int:
        return self._pinned_on[tier]

    def key(self, b: Block | PendingBlock) -> tuple:
        """Keep-key (larger = more deserving of the faster tier)."""
        if isinstance(b, PendingBlock):
            return self._pending_key[id(b)]
        if self.block_state.is_cached(b):
            return (0, b.last_access, -b.block_id)
        return self.block_state.order.block_key(b.block_id, self.state)

    def lowest(self, tier: str) -> Iterator[tuple[tuple, Block]]:
        """Movable blocks of a tier, lowest keep-key first."""
        blocks = self.block_state.pool.blocks
        for key, block_id in self.block_state.order.ascending([tier], self.state):
            if block_id not in self.pinned:
                yield key, blocks[block_id]


def plan_step_placement(
    block_state: BlockState,
    pending: list[PendingBlock],
    fixed_ids: set[int],
    budgets: dict[str, int],
    stepping: Iterable = (),
) -> Placement:
    """`plan_placement` for a step of the tables in `stepping` (pure, raises before
    anything changes). Blocks held only for a step in progress (another table's) do
    not move, besides `fixed_ids`."""
    tables = block_state.tables.values()
    fixed_ids = fixed_ids | {b for t in tables for _, b in t.step_history + t.step_extra}
    view = PlacementView(block_state, pending, fixed_ids, set(stepping))
    return plan_placement(view, budgets, pending)


def eviction_order(block_state: BlockState) -> list[int]:
    """Every block id, first to evict first (cached blocks before live ones; the
    blocks held only for a step in progress are not in the order)."""
    view = PlacementView(block_state, [], set(), set())
    return [block_id for _key, block_id in block_state.order.ascending(view.tier_order, view.state)]


Decision = tuple[str, list, list]  # (tier, blocks that arrive, blocks that leave)


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
    decisions, incoming = _cascade(view, budgets, pending)
    dropped = [b for b in incoming if isinstance(b, Block) and b.ref_count == 0]
    stuck = [b for b in incoming if not (isinstance(b, Block) and b.ref_count == 0)]
    if stuck:
        raise OutOfBlocksError(_all_tiers_full(view, budgets, len(stuck)))
    return _placement(view, decisions, dropped, pending)


def _cascade(
    view: PlacementView, budgets: dict[str, int], pending: list[PendingBlock]
) -> tuple[list[Decision], list]:
    """Each tier's decision, fastest first, and what spills from the last tier."""
    tier_order, block_size = view.tier_order, view.block_size
    incoming: list = list(pending)
    decisions: list[Decision] = []
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
    return decisions, incoming


def _all_tiers_full(view: PlacementView, budgets: dict[str, int], num_stuck: int) -> str:
    tier_order = view.tier_order
    avail = ", ".join(
        f"{n}={format_bytes(budgets[n] * view.tiers[n].block_bytes)}" for n in tier_order
    )
    return (
        f"all tiers are full: {num_stuck} more blocks "
        f"({format_bytes(num_stuck * view.raw_block_bytes)} raw) needed, budgets {avail}; "
        + (
            "raise device_budget (or resident_fraction / max_tokens), or add a host "
            "tier (host_budget) or a disk tier (disk_dir, disk_budget)"
            if len(tier_order) == 1
            else "raise host_budget or disk_budget (or use a smaller codec on the lower tiers)"
        )
    )


def _placement(
    view: PlacementView, decisions: list[Decision], dropped: list[Block], pending: list
) -> Placement:
    """The plan the decisions make: drops, moves (deepest tier first), new tiers."""
    tier_order, block_size = view.tier_order, view.block_size
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
    assert all(dest[id(p)] == tier_order[0] for p in pending if p.num_tokens < block_size)
    return plan
