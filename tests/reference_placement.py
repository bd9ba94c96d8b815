"""The placement of the previous release, kept as a reference: it ranks every block
with a full sort per placement (O(n log n)). The incremental `BlockOrder` must give
exactly the same plans and orders; the state machines compare the two at every step."""

from __future__ import annotations

from collections.abc import Callable, Hashable

from kvstrata.blocks.eviction import BlockView
from kvstrata.blocks.manager import BlockManager
from kvstrata.blocks.placement import PendingBlock, Placement
from kvstrata.blocks.pool import Block
from kvstrata.core.errors import OutOfBlocksError
from kvstrata.core.units import format_bytes
from kvstrata.tiers.base import Tier


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
    state = mgr.state
    new_count: dict[Hashable, int] = {}
    for p in pending:
        if p.copy_of is None:
            new_count[p.table] = new_count.get(p.table, 0) + 1
    keys: dict[int, tuple] = {}
    for seq_id, table in state.tables.items():
        n = table.num_blocks + new_count.get(seq_id, 0)
        last, count = state.seq_last_access[seq_id], state.seq_access_count[seq_id]
        if seq_id in stepping:
            last, count = state.clock + 1, count + 1
        for i, block_id in enumerate(table.block_ids, start=table.first_block):
            v = BlockView(block_id, i < state.num_sink_blocks, n - 1 - i, last, count)
            key = (1, *state.policy.keep_key(v))
            old = keys.get(block_id)
            if old is None or key > old:
                keys[block_id] = key
    for block_id in state.cached:
        keys[block_id] = (0, state.pool.blocks[block_id].last_access, -block_id)
    for i, p in enumerate(pending):
        n = state.tables[p.table].num_blocks + new_count.get(p.table, 0)
        v = BlockView(
            -(i + 1), p.is_sink, n - 1 - p.index, state.clock + 1,
            state.seq_access_count[p.table] + 1,
        )  # fmt: skip
        keys[-(i + 1)] = (1, *state.policy.keep_key(v))
    return keys


def reference_order(mgr: BlockManager) -> list[int]:
    """Every block id in the old full-sort eviction order."""
    keys = rank_keys(mgr, [], set())
    return sorted(keys, key=keys.__getitem__)


def reference_plan(
    mgr: BlockManager, pending: list[PendingBlock], fixed: set[int], budgets: dict, stepping=()
) -> Placement:
    """The old `BlockManager._plan`."""
    state = mgr.state
    keys = rank_keys(mgr, pending, set(stepping))
    pending_key = {id(p): -(i + 1) for i, p in enumerate(pending)}
    fixed = fixed | {b for t in state.tables.values() for _, b in t.step_history + t.step_extra}

    def rank(b: object) -> tuple:
        return keys[pending_key[id(b)] if isinstance(b, PendingBlock) else b.block_id]

    resident = {n: [state.pool.blocks[i] for i in state.on_tier[n]] for n in state.tier_order}
    return plan_placement(
        state.tiers, state.tier_order, budgets, resident, pending, fixed, rank,
        state.layout.block_size, len(state.tables), state.layout.raw_block_bytes,
    )  # fmt: skip


def plan_summary(plan: Placement) -> tuple:
    """A plan as plain values (block ids, tiers) for comparison."""
    return (
        [b.block_id for b in plan.drops],
        [([b.block_id for b in blocks], dst) for blocks, dst in plan.moves],
        list(plan.new_tiers),
        list(plan.install_order),
    )


def compare_with_reference(mgr: BlockManager) -> None:
    """Make every placement of `mgr` also run the reference and assert equal plans."""
    real_plan = mgr._plan

    def checked(pending, fixed, budgets, stepping=()):
        try:
            want = plan_summary(reference_plan(mgr, pending, fixed, budgets, stepping))
        except OutOfBlocksError:
            want = None
        try:
            got = real_plan(pending, fixed, budgets, stepping)
        except OutOfBlocksError:
            assert want is None, "the incremental placement refused a step the reference took"
            raise
        assert want is not None, "the reference refused a step the incremental placement took"
        assert plan_summary(got) == want
        return got

    mgr._plan = checked


def check_order(mgr: BlockManager) -> None:
    """The incremental eviction order equals one rebuilt from the tables, and ranks
    blocks exactly as the reference sort."""
    state = mgr.state
    bs_sinks = state.num_sink_blocks
    live: dict[str, dict[Hashable, list]] = {n: {} for n in state.tier_order}
    owners: dict[int, dict[Hashable, int]] = {}
    for seq_id, table in state.tables.items():
        for i, block_id in enumerate(table.block_ids, start=table.first_block):
            tier = state.pool.blocks[block_id].tier
            live[tier].setdefault(seq_id, []).append((i < bs_sinks, i, block_id))
            owners.setdefault(block_id, {})[seq_id] = i
    got_live = {n: {t: list(e) for t, e in d.items()} for n, d in state.order.live.items()}
    assert got_live == {n: {t: sorted(e) for t, e in d.items()} for n, d in live.items()}
    assert state.order.owners == owners
    cached = {n: [] for n in state.tier_order}
    for block_id in state.cached:
        block = state.pool.blocks[block_id]
        cached[block.tier].append((block.last_access, -block_id))
    got_cached = {
        n: [rank for rank, _ in state.hash_to_block.ascending(n)] for n in state.tier_order
    }
    assert got_cached == {n: sorted(c) for n, c in cached.items()}
    assert mgr.eviction_order() == reference_order(mgr)
