"""Eviction policies: exact eviction orders (lowest value first) with exact block ids."""

from __future__ import annotations

import pytest

from kvstrata.blocks.eviction import BlockView, EvictionPolicy
from kvstrata.core.errors import ConfigError


def _views() -> list[BlockView]:
    # One sequence of 5 blocks (ids 10..14, 10 = oldest, a sink) accessed at step 9,
    # 12 times; another of 3 blocks (ids 20..22) accessed at step 7, 30 times.
    seq_a = [BlockView(10 + i, i == 0, 4 - i, 9, 12) for i in range(5)]
    seq_b = [BlockView(20 + i, False, 2 - i, 7, 30) for i in range(3)]
    return seq_a + seq_b


def test_window_keeps_sinks_evicts_oldest_first() -> None:
    order = EvictionPolicy("window").eviction_order(_views())
    # Furthest from its sequence's end first; equal distance: the larger id first.
    assert order == [11, 20, 12, 21, 13, 22, 14, 10]


def test_lru_evicts_least_recently_used_sequence_first() -> None:
    order = EvictionPolicy("lru").eviction_order(_views())
    assert order == [20, 21, 22, 11, 12, 13, 14, 10]


def test_lfu_evicts_least_frequently_used_first() -> None:
    order = EvictionPolicy("lfu").eviction_order(_views())
    assert order == [11, 12, 13, 14, 20, 21, 22, 10]


def test_sinks_outrank_everything() -> None:
    views = [BlockView(1, True, 9, 0, 0), BlockView(2, False, 0, 99, 99)]
    for name in ("window", "lru", "lfu"):
        assert EvictionPolicy(name).eviction_order(views) == [2, 1]


def test_ties_keep_lower_ids() -> None:
    views = [BlockView(i, False, 0, 5, 5) for i in (3, 1, 2)]
    for name in ("window", "lru", "lfu"):
        assert EvictionPolicy(name).eviction_order(views) == [3, 2, 1]


def test_keep_key_ranks_the_same_way() -> None:
    policy = EvictionPolicy("lru")
    views = _views()
    ranked = sorted(views, key=policy.keep_key, reverse=True)
    assert [v.block_id for v in ranked] == list(reversed(policy.eviction_order(views)))


def test_unknown_policy_lists_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match=r"^policy='fifo' is invalid: one of window, lru, lfu$"):
        EvictionPolicy("fifo")
