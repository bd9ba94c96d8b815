"""Which blocks the backend holds, on which tier, and which to evict first.

An entry is one stored block (one vLLM chunk) under its namespaced key. It may have a
host copy, a disk copy, or both (the disk is written through: a block stored on the
host is also written to disk, so the disk index is complete even after a crash):

    host copy:  allocated --(worker stored it)--> ready     (pinned while loading)
                allocated --(writer thread read it from disk: `reading`)--> ready
    disk copy:  allocated --(writer thread wrote it: `writing`)--> ready

The entries live in the store's content-hash index (`blocks/hash_index.py`, the one the
block manager keys its full blocks in): key -> entry, and per tier the copies that may
go ranked by kvstrata's eviction policy (`blocks/eviction.py`), so the lowest-ranked
are taken in O(log n) each. An offload cache has no sequences, so the
policy sees each block as a one-block table: `lru` ranks by last use, `lfu` by use
count then last use, `window` by store order (oldest first).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvstrata.blocks.eviction import BlockView, EvictionPolicy
from kvstrata.blocks.hash_index import HashIndex

TIERS = ("host", "disk")


@dataclass(eq=False)
class Entry:
    """One stored block. `pins` counts loads in flight and this step's hit leases."""

    key: bytes
    vllm_key: bytes | None  # None for blocks found on disk after a restart
    seq: int
    host_slot: int | None = None
    host_ready: bool = False
    disk_slot: int | None = None
    disk_ready: bool = False
    writing: bool = False  # the host copy is being written to disk
    reading: bool = False  # the disk copy is being read into the host slot
    doomed: bool = False  # dropped (reset) once its disk I/O in flight has ended
    pins: int = 0
    last_access: int = 0
    access_count: int = 0

    def evictable(self, tier: str) -> bool:
        """Whether this copy may be dropped now."""
        if self.doomed or self.reading or self.writing:
            return False  # I/O in flight uses both copies' slots
        if tier == "host":
            return self.host_ready and self.pins == 0
        return self.disk_ready


class BlockIndex:
    """Entries by key in a content-hash index, which ranks the evictable copies per tier.

    Args:
        policy: a kvstrata eviction policy name ("lru", "lfu", "window").
    """

    def __init__(self, policy: str) -> None:
        self.policy = EvictionPolicy(policy)
        self.entries: HashIndex[Entry] = HashIndex(TIERS)
        self._seq = itertools.count()
        self.clock = 0

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: bytes) -> Entry | None:
        return self.entries.get(key)

    def add(self, key: bytes, vllm_key: bytes | None) -> Entry:
        """A new entry (no copy yet); it counts as used now."""
        assert key not in self.entries, "a key is stored once"
        self.clock += 1
        entry = Entry(key, vllm_key, next(self._seq), last_access=self.clock)
        self.entries[key] = entry
        return entry

    def touch(self, entry: Entry) -> None:
        """The block was used (a hit, or vLLM's touch)."""
        self.clock += 1
        entry.last_access = self.clock
        entry.access_count += 1
        self.refresh(entry)

    def refresh(self, entry: Entry) -> None:
        """Re-rank the entry after any change of its state (call after every change)."""
        stored = entry.key in self.entries
        for tier in TIERS:
            if stored and entry.evictable(tier):
                self.entries.rank(tier, entry.key, (self._keep_key(entry), entry.seq))
            else:
                self.entries.unrank(tier, entry.key)

    def remove(self, entry: Entry) -> None:
        """Forget the entry (both copies must be gone)."""
        assert entry.host_slot is None and entry.disk_slot is None
        del self.entries[entry.key]
        self.refresh(entry)

    def victims(self, tier: str, count: int, protect: set[bytes]) -> list[Entry]:
        """Up to `count` evictable copies on `tier`, lowest-ranked first, skipping the
        keys in `protect`."""
        return [self.entries[key] for key in self.entries.lowest(tier, count, protect)]

    def room(self, tier: str, count: int, free: int, protect: set[bytes]) -> int:
        """How many of `count` slots `tier` can give (`free` + evictable copies)."""
        return self.entries.room(tier, count, free, protect)

    def evict(
        self,
        tier: str,
        count: int,
        protect: set[bytes],
        drop: Callable[[Entry, str], object],
        partial: bool = False,
    ) -> bool:
        """`HashIndex.evict`: `drop(entry, tier)` the `count` lowest-ranked copies on
        `tier` outside `protect` (all or none unless `partial`); whether `count` went."""
        entries = self.entries
        return entries.evict(tier, count, lambda key: drop(entries[key], tier), protect, partial)

    def num_evictable(self, tier: str) -> int:
        return self.entries.num_ranked(tier)

    def on(self, tier: str) -> Iterator[Entry]:
        """Entries with a copy on `tier`."""
        slot = "host_slot" if tier == "host" else "disk_slot"
        return (e for e in self.entries.values() if getattr(e, slot) is not None)

    def _keep_key(self, entry: Entry) -> tuple:
        # blocks_from_end counts back from the first block stored: the same order as from
        # the newest (a shift by the number stored), without re-ranking on every store.
        view = BlockView(
            block_id=entry.seq,
            is_sink=False,
            blocks_from_end=-entry.seq,
            last_access=entry.last_access,
            access_count=entry.access_count,
        )
        return self.policy.keep_key(view)
