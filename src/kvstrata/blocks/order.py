"""The eviction order, kept up to date as blocks come and go instead of sorted per placement.

A policy's keep-key (`EvictionPolicy.keep_key`) of a live block depends on its table
(last access, access count, length) and on the block's position in it. Within one
table every policy ranks blocks by (is sink, logical index): non-sink blocks oldest
first, then the sinks. So `BlockOrder` keeps, per tier and per table, the table's
blocks on that tier as a sorted list of (is sink, index, block id) — a block that
appears, moves or goes costs O(log n) — and per tier the cached (unreferenced) blocks
sorted by (last access, -id) — the ranks of the content-hash index (`blocks/hash_index.py`),
which the order reads. Touching a table (LRU / LFU) changes no entry.

The lowest-ranked blocks of a tier are then a lazy k-way merge: cached blocks first
(they rank below every live block), then the heads of the per-table lists, each
keyed by the policy with its table's current state. Taking the m lowest of a tier
costs O(T log T + m log T) for T tables — not a sort of every block. A block several
tables share is ranked by its best owner: it is yielded at its last occurrence.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass

from sortedcontainers import SortedList

from kvstrata.blocks.eviction import BlockView, EvictionPolicy
from kvstrata.blocks.hash_index import HashIndex


@dataclass(frozen=True)
class TableState:
    """What a policy sees of one table during one placement."""

    num_blocks: int  # logical blocks, this step's new ones included
    last_access: int
    access_count: int


class BlockOrder:
    """Per tier: live blocks per table in rank order, and cached blocks oldest first."""

    def __init__(
        self,
        policy: EvictionPolicy,
        tiers: Iterable[str],
        num_sink_blocks: int,
        hashes: HashIndex[int],
    ) -> None:
        self.policy = policy
        self.num_sink_blocks = num_sink_blocks
        self.live: dict[str, dict[Hashable, SortedList]] = {t: {} for t in tiers}
        self.hashes = hashes  # ranks the cached blocks per tier
        self.owners: dict[int, dict[Hashable, int]] = {}  # block -> {table: logical index}

    # -- upkeep ---------------------------------------------------------------------------------
    def hold(self, table: Hashable, index: int, block_id: int, tier: str) -> None:
        """`table` now holds `block_id` at logical `index`."""
        self.owners.setdefault(block_id, {})[table] = index
        entries = self.live[tier].get(table)
        if entries is None:
            entries = self.live[tier][table] = SortedList()
        entries.add((index < self.num_sink_blocks, index, block_id))

    def drop(self, table: Hashable, block_id: int, tier: str) -> None:
        """`table` no longer holds `block_id`."""
        owners = self.owners[block_id]
        index = owners.pop(table)
        if not owners:
            del self.owners[block_id]
        entries = self.live[tier][table]
        entries.remove((index < self.num_sink_blocks, index, block_id))
        if not entries:
            del self.live[tier][table]

    def move(self, block_id: int, src: str, dst: str) -> None:
        """The live block moved tier (its tables' entries follow it)."""
        for table, index in self.owners.get(block_id, {}).items():
            entry = (index < self.num_sink_blocks, index, block_id)
            src_entries = self.live[src][table]
            src_entries.remove(entry)
            if not src_entries:
                del self.live[src][table]
            dst_entries = self.live[dst].get(table)
            if dst_entries is None:
                dst_entries = self.live[dst][table] = SortedList()
            dst_entries.add(entry)

    # -- ranking --------------------------------------------------------------------------------
    def live_key(self, state: TableState, index: int, block_id: int) -> tuple:
        view = BlockView(
            block_id,
            index < self.num_sink_blocks,
            state.num_blocks - 1 - index,
            state.last_access,
            state.access_count,
        )
        return (1, *self.policy.keep_key(view))

    def block_key(self, block_id: int, state: Callable[[Hashable], TableState]) -> tuple:
        """Keep-key of a live block: its best owner's."""
        return max(
            self.live_key(state(table), index, block_id)
            for table, index in self.owners[block_id].items()
        )

    def ascending(
        self, tiers: Iterable[str], state: Callable[[Hashable], TableState]
    ) -> Iterator[tuple[tuple, int]]:
        """(keep-key, block id) of every block on `tiers`, lowest first."""
        tiers = list(tiers)
        cached = heapq.merge(*(self.hashes.ascending(t) for t in tiers))
        yield from (((0, *rank), block_id) for rank, block_id in cached)
        streams = [
            self._table_stream(table, entries, state(table))
            for t in tiers
            for table, entries in self.live[t].items()
        ]
        pending: dict[int, int] = {}  # shared block -> occurrences still to come
        for key, block_id in heapq.merge(*streams):
            owners = self.owners[block_id]
            if len(owners) > 1:
                left = pending.get(block_id, len(owners)) - 1
                if left:
                    pending[block_id] = left
                    continue
                pending.pop(block_id, None)
            yield key, block_id

    def _table_stream(
        self, table: Hashable, entries: SortedList, state: TableState
    ) -> Iterator[tuple[tuple, int]]:
        for _sink, index, block_id in entries:
            yield self.live_key(state, index, block_id), block_id
