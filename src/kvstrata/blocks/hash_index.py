"""The content-hash index: one stored copy per hash, and per tier the copies that may go.

kvstrata keeps full blocks under a content hash in two places, and both use this one
index:

- the store's block manager (`BlockState.hash_to_block`): hash -> block id. A hashed
  block whose last reference went stays *cached*: ranked on its tier by
  (last access, -id), evicted before every live block (`blocks/cached.py`);
- the vLLM backend's offload index (`integrations/vllm/index.py`): key -> entry. A copy
  that is ready and unpinned is ranked on its tier (host or disk) by the eviction
  policy's keep-key.

The index holds the mapping and, per tier, the *ranked* items in ascending order
(lowest first = first to evict): ranking, re-ranking, moving and dropping an item cost
O(log n), and the lowest m of a tier are read without a sort. What a rank means, and
when an item is ranked, is the owner's: the index only keeps the order. A rank must
be unique within its tier (end it with the item's id or a sequence number), so ties
never compare items.

Room on a tier is made the same way for both owners (`evict`): the lowest-ranked
items outside the ones a caller protects (the blocks of the lookup or store that
needs the room) go first, all or none (or as many as can, where falling short is
fine), each dropped by the owner's own function.
The store's remote tier installs fetched blocks that way, the block manager frees a
device slot for a cropped block, and the vLLM backend takes host slots for stores,
disk reads and remote hits and disk slots for its write-through.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Hashable, Iterable, Iterator
from typing import Generic, TypeVar

from sortedcontainers import SortedList

V = TypeVar("V")


class HashIndex(Generic[V]):
    """hash -> stored copy, plus per tier the ranked (evictable) items, lowest first.

    Args:
        tiers: the tier names items may be ranked on.
    """

    def __init__(self, tiers: Iterable[str]) -> None:
        self._by_hash: dict[bytes, V] = {}
        self._order: dict[str, SortedList] = {t: SortedList() for t in tiers}
        self._ranks: dict[str, dict[Hashable, tuple]] = {t: {} for t in self._order}

    # -- the mapping ----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._by_hash)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._by_hash

    def __getitem__(self, block_hash: bytes) -> V:
        return self._by_hash[block_hash]

    def __setitem__(self, block_hash: bytes, value: V) -> None:
        self._by_hash[block_hash] = value

    def __delitem__(self, block_hash: bytes) -> None:
        del self._by_hash[block_hash]

    def get(self, block_hash: bytes, default: V | None = None) -> V | None:
        return self._by_hash.get(block_hash, default)

    def values(self) -> Iterable[V]:
        return self._by_hash.values()

    # -- the ranked items -----------------------------------------------------------------------
    def rank(self, tier: str, item: Hashable, key: tuple) -> None:
        """Rank `item` on `tier` by `key` (replacing its rank there, if any)."""
        self.unrank(tier, item)
        self._order[tier].add((key, item))
        self._ranks[tier][item] = key

    def unrank(self, tier: str, item: Hashable) -> bool:
        """Take `item` out of `tier`'s order; False when it was not in it."""
        key = self._ranks[tier].pop(item, None)
        if key is None:
            return False
        self._order[tier].remove((key, item))
        return True

    def move(self, item: Hashable, src: str, dst: str) -> bool:
        """The item's copy moved from `src` to `dst`: it keeps its rank there. False when
        it was not ranked on `src`."""
        key = self._ranks[src].get(item)
        if key is None:
            return False
        self.unrank(src, item)
        self.rank(dst, item, key)
        return True

    def is_ranked(self, tier: str, item: Hashable) -> bool:
        return item in self._ranks[tier]

    def num_ranked(self, tier: str) -> int:
        return len(self._ranks[tier])

    def ranked(self) -> Iterator[Hashable]:
        """Every ranked item, tier by tier."""
        for ranks in self._ranks.values():
            yield from ranks

    def ascending(self, tier: str) -> Iterator[tuple[tuple, Hashable]]:
        """(rank, item) of the items ranked on `tier`, lowest first."""
        return iter(self._order[tier])

    def lowest(self, tier: str, count: int, protect: Container = ()) -> list[Hashable]:
        """Up to `count` items ranked on `tier`, lowest first, skipping those in
        `protect`: the first to evict."""
        out: list[Hashable] = []
        if count <= 0:
            return out
        for _, item in self._order[tier]:
            if item not in protect:
                out.append(item)
                if len(out) == count:
                    break
        return out

    def room(self, tier: str, count: int, free: int, protect: Container = ()) -> int:
        """How many of `count` slots `tier` can give: its `free` ones plus those
        `evict` would make by dropping items outside `protect`."""
        return min(count, free + len(self.lowest(tier, count - free, protect)))

    def evict(
        self,
        tier: str,
        count: int,
        drop: Callable[[Hashable], object],
        protect: Container = (),
        partial: bool = False,
    ) -> bool:
        """Make room for `count` on `tier`: `drop(item)` for each of the `count` lowest
        items outside `protect` (the owner frees the slot and unranks it). Nothing is
        dropped when fewer can go, unless `partial` (then as many as can). Returns
        whether `count` went (True at once for a count <= 0)."""
        if count <= 0:
            return True
        items = self.lowest(tier, count, protect)
        if len(items) < count and not partial:
            return False
        for item in items:
            drop(item)
        return len(items) == count
