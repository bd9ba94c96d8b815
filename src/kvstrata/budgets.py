"""Tier sizes from a CacheConfig: the one place budgets become slots.

Used by the store (and so by `TieredCache`), the planner's comparison with the
cache, `evaluate` and the CLI. A slot holds one block of one layer group; every
group has the same block size (kvstrata.groups).
"""

from __future__ import annotations

import math

from kvstrata.config import CacheConfig
from kvstrata.errors import ConfigError
from kvstrata.groups import LayerGroup
from kvstrata.units import format_bytes


def blocks_for_context(groups: list[LayerGroup], num_tokens: int, block_size: int) -> int:
    """Blocks (all groups) one sequence of `num_tokens` tokens needs at most."""
    return sum(g.max_blocks_held(num_tokens, block_size) for g in groups)


def blocks_held(groups: list[LayerGroup], num_tokens: int, block_size: int) -> int:
    """Blocks (all groups) one sequence holds once it has `num_tokens` tokens."""
    return sum(g.blocks_held(num_tokens, block_size) for g in groups)


def device_slots(
    config: CacheConfig,
    groups: list[LayerGroup],
    device_block_bytes: int,
    num_sequences: int = 1,
    lossy_below: bool = False,
) -> int:
    """Device-tier slots for `config`.

    `device_budget` bytes, else `resident_fraction` of what `max_tokens` needs, else
    all of it (one open block per sequence and group on top).

    Raises:
        ConfigError: lossy lower tiers need the residual window on the device and
            the budget is smaller (names the bytes needed).
    """
    bs = config.block_size
    total = blocks_for_context(groups, config.max_tokens, bs)
    if config.device_budget is not None:
        slots = config.device_budget // device_block_bytes
    elif config.resident_fraction is not None:
        slots = math.ceil(config.resident_fraction * total)
    else:
        slots = total + num_sequences * len(groups)
    per_seq = 1 + -(-config.residual_tokens // bs) + -(-config.sink_tokens // bs)
    need = num_sequences * len(groups) * per_seq
    if lossy_below and slots < need:
        raise ConfigError.field(
            "device_budget",
            format_bytes(slots * device_block_bytes),
            f"lossy lower tiers need the residual window ({config.residual_tokens} tokens) "
            f"+ sinks + an open block per sequence on the device: at least "
            f"{format_bytes(need * device_block_bytes)}",
        )
    return slots


def lower_slots(budget: int, block_bytes: int) -> int:
    """Slots of a host / disk tier of `budget` bytes."""
    return budget // block_bytes
