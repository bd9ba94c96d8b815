"""HashIndex's room-making (`lowest`, `room`, `evict`): the one way both stores choose
which copies go when a tier needs slots — the store's cached blocks (remote installs,
a cropped block's device slot) and the vLLM backend's host and disk copies."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvstrata.blocks.hash_index import HashIndex


def _index(ranks: dict[int, int]) -> HashIndex[int]:
    index: HashIndex[int] = HashIndex(["host", "disk"])
    for item, value in ranks.items():
        index.rank("host", item, (value, item))
    return index


@given(
    ranks=st.dictionaries(st.integers(0, 15), st.integers(0, 5), max_size=16),
    protect=st.sets(st.integers(0, 15)),
    count=st.integers(-1, 18),
    free=st.integers(0, 4),
    partial=st.booleans(),
)
def test_evict_drops_the_lowest_unprotected_all_or_none(ranks, protect, count, free, partial):
    index = _index(ranks)
    order = [i for i in sorted(ranks, key=lambda i: (ranks[i], i)) if i not in protect]
    want = order[: max(count, 0)]
    assert index.lowest("host", count, protect) == want
    assert index.room("host", count, free, protect) == min(count, free + len(want))
    dropped: list[int] = []

    def drop(item: int) -> None:
        dropped.append(item)
        index.unrank("host", item)

    enough = len(want) == max(count, 0)
    assert index.evict("host", count, drop, protect, partial=partial) == enough
    assert dropped == (want if enough or partial else [])
    assert index.num_ranked("disk") == 0  # another tier is never touched


def test_evict_of_nothing_needs_no_victim() -> None:
    index = _index({})
    assert index.evict("host", 0, lambda item: None)
    assert not index.evict("host", 1, lambda item: None)
    assert index.room("host", 3, 5) == 3
