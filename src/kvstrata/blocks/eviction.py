"""Eviction / placement policies: pure ranking, no I/O, no tiers.

A policy ranks blocks by how much they deserve the faster tier. The manager keeps
the highest-ranked blocks on the device and demotes the lowest-ranked ones first.

    window: sinks first, then newest (the seed's "GPU keeps the latest ~1k tokens")
    lru:    sinks first, then most recently accessed, newest on ties
    lfu:    sinks first, then most often accessed, then most recent
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvstrata.core.errors import ConfigError


@dataclass(frozen=True)
class BlockView:
    """What a policy may look at for one block."""

    block_id: int
    is_sink: bool
    blocks_from_end: int  # 0 = the sequence's newest block
    last_access: int
    access_count: int


RankKey = Callable[[BlockView], tuple]


def _window(b: BlockView) -> tuple:
    return (b.is_sink, -b.blocks_from_end, -b.block_id)


def _lru(b: BlockView) -> tuple:
    return (b.is_sink, b.last_access, -b.blocks_from_end, -b.block_id)


def _lfu(b: BlockView) -> tuple:
    return (b.is_sink, b.access_count, b.last_access, -b.blocks_from_end, -b.block_id)


_POLICIES: dict[str, RankKey] = {"window": _window, "lru": _lru, "lfu": _lfu}


class EvictionPolicy:
    """Orders blocks for eviction. `eviction_order` returns lowest-value first."""

    def __init__(self, name: str) -> None:
        if name not in _POLICIES:
            raise ConfigError.field("policy", name, f"one of {', '.join(_POLICIES)}")
        self.name = name
        self._key = _POLICIES[name]

    def keep_key(self, block: BlockView) -> tuple:
        """Sort key: larger = more deserving of the faster tier."""
        return self._key(block)

    def eviction_order(self, blocks: list[BlockView]) -> list[int]:
        """Block ids, first to evict first."""
        return [b.block_id for b in sorted(blocks, key=self._key)]
