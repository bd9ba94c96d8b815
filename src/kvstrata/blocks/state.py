"""BlockState: the one state the block manager's parts share, and nothing that decides.

What blocks exist (the pool: ids, ref counts), where they are (the tiers and, per
tier, the ids placed there), which tables hold them and in what eviction order,
the content-hash index and its cached (unreferenced) blocks, the tier budgets, the
per-table access clock, the runs each table reads, and the counters of moves and
evictions. The manager's parts — placement (`blocks/placement.py`), applying a
plan (`blocks/apply.py`), cached blocks (`blocks/cached.py`), a step's blocks
(`blocks/step.py`) — each receive this object (or the pieces they need) and read or
change it; the manager (`blocks/manager.py`) is the request-level facade over them.

Kept here: the bookkeeping that keeps the eviction order equal to the tables
(`hold` / `unhold`), which every part that changes a table must call.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from kvstrata.blocks.eviction import EvictionPolicy
from kvstrata.blocks.hash_index import HashIndex
from kvstrata.blocks.order import BlockOrder
from kvstrata.blocks.pool import Block, BlockPool
from kvstrata.blocks.runs import Run
from kvstrata.blocks.table import BlockTable
from kvstrata.core.errors import ConfigError
from kvstrata.core.layout import BlockLayout
from kvstrata.tiers.base import Tier


class BlockState:
    """Block tables, the blocks they hold, their tiers, budgets, order and counters."""

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
        self.tier_order = [t.name for t in tiers]  # fastest first; [0] is the device
        self.policy = policy
        self.num_sink_blocks = -(-sink_tokens // layout.block_size) if sink_tokens else 0
        self.pool = BlockPool()
        self.tables: dict[Hashable, BlockTable] = {}
        self.budget_slots = {t.name: t.num_slots for t in tiers}
        self.on_tier: dict[str, set[int]] = {t.name: set() for t in tiers}
        # content hash -> block id; the cached (unreferenced) blocks ranked per tier
        self.hash_to_block: HashIndex[int] = HashIndex(self.tier_order)
        self.order = BlockOrder(policy, self.tier_order, self.num_sink_blocks, self.hash_to_block)
        self.clock = 0
        self.seq_last_access: dict[Hashable, int] = {}
        self.seq_access_count: dict[Hashable, int] = {}
        self.runs_by_table: dict[Hashable, list[Run]] = {}  # built on read, dropped on change
        self.peak_live_bytes = 0  # referenced blocks (all tiers), highest after a step
        self.num_moves = 0
        self.num_evicted_cached = 0
        self.bytes_moved: dict[str, int] = {}
        # store full blocks a sliding window skips in a long step when slots are free,
        # so they can serve later prefix hits (the store turns it on with prefix caching)
        self.keep_skipped_blocks = False
        # called with the blocks after blocks moved tier (the store keys them)
        self.on_move: Callable[[list[Block]], object] | None = None
        # called with an indexed block just before it leaves the hash index (released,
        # evicted or unhashed): the store's KV event recorder, when one is attached
        self.on_unindex: Callable[[Block], object] | None = None
        # called with (table key, tokens kept) after a table is cut back (a crop, an
        # undone step): what was derived from the cut tokens (key summaries) must go
        self.on_truncate: Callable[[Hashable, int], object] | None = None

    @property
    def cached(self) -> set[int]:
        """The cached blocks' ids (a copy; `hash_to_block.is_ranked` for one block)."""
        return set(self.hash_to_block.ranked())

    def is_cached(self, block: Block) -> bool:
        return self.hash_to_block.is_ranked(block.tier, block.block_id)

    def room(self, tier: str) -> int:
        """Free slots of a tier within its budget (set_budget may cut a budget below
        the arena)."""
        t = self.tiers[tier]
        return min(self.budget_slots[tier] - t.num_used, t.num_free)

    def num_cached_on(self, tier: str) -> int:
        return self.hash_to_block.num_ranked(tier)

    def hold(self, seq_id: Hashable) -> None:
        """Enter every block of the table in the eviction order."""
        table = self.tables[seq_id]
        blocks = self.pool.blocks
        for i, block_id in enumerate(table.block_ids, start=table.first_block):
            self.order.hold(seq_id, i, block_id, blocks[block_id].tier)

    def unhold(self, seq_id: Hashable, block_ids: list[int]) -> None:
        """The table no longer holds these blocks in its `block_ids`."""
        blocks = self.pool.blocks
        for block_id in block_ids:
            self.order.drop(seq_id, block_id, blocks[block_id].tier)
