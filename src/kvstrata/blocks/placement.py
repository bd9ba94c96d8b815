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

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstrata.blocks.pool import Block
from kvstrata.errors import OutOfBlocksError
from kvstrata.policies.eviction import BlockView
from kvstrata.tiers.base import Tier
from kvstrata.units import format_bytes

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

    @property
    def is_empty(self) -> bool:
        return not (self.drops or self.moves) and not self.new_tiers


def plan_placement(
    tiers: dict[str, Tier],
    tier_order: list[str],
    budgets: dict[str, int],
    resident: dict[str, list[Block]],
    pending: list[PendingBlock],
    fixed_ids: set[int],
    rank: Callable[[object], tuple],
    block_size: int,
    num_tables: int,
    raw_block_bytes: int,
) -> Placement:
    """Decide where every block goes; raise OutOfBlocksError when it cannot fit.

    Args:
        resident: blocks on each tier now (live and cached).
        pending: new blocks of this step (partial ones must land on tier 0).
        fixed_ids: blocks that may not move this step (open blocks being written).
        rank: larger = more deserving of the faster tier (blocks and pending blocks).
    """
    device = tier_order[0]
    incoming: list = list(pending)
    decisions: list[tuple[str, list, list]] = []  # (tier, arrive, leave)
    for depth, name in enumerate(tier_order):
        here = resident[name]
        fixed = [b for b in here if b.block_id in fixed_ids or b.num_tokens < block_size]
        movable = [b for b in here if not (b.block_id in fixed_ids or b.num_tokens < block_size)]
        must = [b for b in incoming if b.num_tokens < block_size] if depth == 0 else []
        if depth > 0 and any(b.num_tokens < block_size for b in incoming):
            raise AssertionError("partial blocks never leave the device")
        room = budgets[name] - len(fixed) - len(must)
        if room < 0:
            need = (len(fixed) + len(must)) * tiers[name].block_bytes
            raise OutOfBlocksError(
                f"{name} tier needs {format_bytes(need)} for blocks being written "
                f"(open blocks of {num_tables} sequences) but its budget is "
                f"{format_bytes(budgets[name] * tiers[name].block_bytes)}: raise "
                f"{name}_budget or lower block_size"
            )
        candidates = movable + [b for b in incoming if b.num_tokens >= block_size]
        ranked = sorted(candidates, key=rank, reverse=True)
        keep, spill = ranked[:room], ranked[room:]
        arrive = must + [b for b in keep if not (isinstance(b, Block) and b.tier == name)]
        leave = [b for b in spill if isinstance(b, Block) and b.tier == name]
        decisions.append((name, arrive, leave))
        incoming = spill
        # No early exit when nothing spills: a lower tier whose budget just shrank
        # (set_budget) must still demote its own surplus.
    dropped = [b for b in incoming if isinstance(b, Block) and b.ref_count == 0]
    stuck = [b for b in incoming if not (isinstance(b, Block) and b.ref_count == 0)]
    if stuck:
        avail = ", ".join(
            f"{n}={format_bytes(budgets[n] * tiers[n].block_bytes)}" for n in tier_order
        )
        raise OutOfBlocksError(
            f"all tiers are full: {len(stuck)} more blocks "
            f"({format_bytes(len(stuck) * raw_block_bytes)} raw) needed, budgets {avail}; "
            f"raise host_budget or disk_budget (or use a smaller codec on the lower tiers)"
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


def rank_keys(mgr: BlockManager, pending: list[PendingBlock], stepping: set) -> dict[int, tuple]:
    """Policy keep-keys of every block (shared blocks: newest / most used owner),
    live blocks above cached ones; `pending` blocks come after their table's;
    tables in `stepping` are seen as accessed by this step."""
    new_count: dict[Hashable, int] = {}
    for p in pending:
        if p.copy_of is None:
            new_count[p.table] = new_count.get(p.table, 0) + 1
    keys: dict[int, tuple] = {}
    for seq_id, table in mgr.tables.items():
        n = table.num_blocks + new_count.get(seq_id, 0)
        last, count = mgr.seq_last_access[seq_id], mgr.seq_access_count[seq_id]
        if seq_id in stepping:
            last, count = mgr.clock + 1, count + 1
        for i, block_id in enumerate(table.block_ids, start=table.first_block):
            v = BlockView(block_id, i < mgr.num_sink_blocks, n - 1 - i, last, count)
            key = (1, *mgr.policy.keep_key(v))
            old = keys.get(block_id)
            if old is None or key > old:
                keys[block_id] = key
    for block_id in mgr.cached:
        keys[block_id] = (0, mgr.pool.blocks[block_id].last_access, -block_id)
    for i, p in enumerate(pending):
        n = mgr.tables[p.table].num_blocks + new_count.get(p.table, 0)
        v = BlockView(
            -(i + 1), p.is_sink, n - 1 - p.index, mgr.clock + 1,
            mgr.seq_access_count[p.table] + 1,
        )  # fmt: skip
        keys[-(i + 1)] = (1, *mgr.policy.keep_key(v))
    return keys
