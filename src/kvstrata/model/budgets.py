"""Tier sizes from a CacheConfig: the one place budgets become slots.

Used by the store (and so by `TieredCache`), the planner's comparison with the
cache, `evaluate` and the CLI. A slot holds one block of one layer group; every
group has the same block size (kvstrata.model.groups). The device floor, the blocks a
running sequence pins on the device (`device_floor_blocks`), is computed here only.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvstrata.codecs.registry import get_codec
from kvstrata.config import CacheConfig
from kvstrata.core.errors import ConfigError
from kvstrata.core.layout import BlockLayout
from kvstrata.core.units import format_bytes, parse_fraction, parse_tokens
from kvstrata.model.geometry import KVGeometry
from kvstrata.model.groups import LayerGroup, layer_groups
from kvstrata.platform.hardware import device_memory


def model_groups(model_or_config: Any) -> list[LayerGroup]:
    """The layer groups of a model (or its config / KVGeometry)."""
    config = getattr(model_or_config, "config", model_or_config)
    g = config if isinstance(config, KVGeometry) else KVGeometry.from_hf_config(config)
    return layer_groups(g.num_layers, g.sliding_layers, g.sliding_window)


def group_layout(
    model_or_config: Any,
    block_size: int,
    dtype: Any = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    v_head_dim: int | None = None,
) -> BlockLayout:
    """The layout of one block of one layer group: what a store's tiers hold per slot.

    Args:
        model_or_config: a model (its parameter dtype is the default dtype), a
            transformers config or a KVGeometry.
        dtype: the KV dtype (default: the model's parameters, else float32).
        num_kv_heads / head_dim / v_head_dim: override the config (the K/V a model
            really produces).
    """
    config = getattr(model_or_config, "config", model_or_config)
    g = config if isinstance(config, KVGeometry) else KVGeometry.from_hf_config(config)
    if dtype is None:
        params = getattr(model_or_config, "parameters", None)
        dtype = next(params()).dtype if params is not None else torch.float32
    return g.head_layout(
        block_size,
        dtype,
        num_layers=len(model_groups(g)[0].layers),
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
    )


def blocks_for_context(
    groups: list[LayerGroup], num_tokens: int, block_size: int, num_sequences: int = 1
) -> int:
    """Blocks (all groups) that `num_tokens` tokens need at most, split over
    `num_sequences` sequences (each sliding group holds a window per sequence)."""
    total = -(-num_tokens // block_size)
    return sum(
        total
        if g.window is None
        else min(total + num_sequences, num_sequences * g.max_blocks_held(num_tokens, block_size))
        for g in groups
    )


def blocks_held(groups: list[LayerGroup], num_tokens: int, block_size: int) -> int:
    """Blocks (all groups) one sequence holds once it has `num_tokens` tokens."""
    return sum(g.blocks_held(num_tokens, block_size) for g in groups)


def device_floor_blocks(
    block_size: int,
    sink_tokens: int,
    residual_tokens: int,
    *,
    lossy: bool,
    crossing: bool = False,
) -> int:
    """Blocks a running sequence pins on the device tier, per layer group: the blocks of
    its `sink_tokens` sinks, its open block, the blocks of the `residual_tokens` residual
    window when a lower tier is lossy (the newest tokens stay full-precision), and one
    more while a step crosses a block boundary (`crossing`: the closing block and the
    newly opened one).

    ceil(sinks / bs) + 1 + (ceil(residual / bs) if lossy) + (1 if crossing). The one
    floor behind the device tier's check (device_slots), `placement`'s device share and
    the engine's admission (with `crossing`).
    """
    blocks = -(-sink_tokens // block_size) + 1
    if lossy:
        blocks += -(-residual_tokens // block_size)
    return blocks + (1 if crossing else 0)


def _device_field(config: CacheConfig) -> tuple[str, Any]:
    """The field that sized the device tier, and its value as the user gave it."""
    if config.device_budget is not None:
        return "device_budget", config.device_budget
    if config.resident_fraction is not None:
        return "resident_fraction", config.resident_fraction
    return "max_tokens", config.max_tokens


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
        ConfigError: naming the field that sized the device tier (device_budget,
            resident_fraction or max_tokens) when the tier cannot hold one open block
            per sequence and group; when there is no host or disk tier and it cannot
            hold `max_tokens`; when it is larger than the device's memory (it is
            allocated up front); or when lossy lower tiers need the residual window and
            the sinks on the device and it is smaller (names the bytes needed). Naming
            sink_tokens when the sinks alone do not fit on the device.
    """
    bs = config.block_size
    total = blocks_for_context(groups, config.max_tokens, bs, num_sequences)
    if config.device_budget is not None:
        slots = config.device_budget // device_block_bytes
    elif config.resident_fraction is not None:
        # never below one open block per sequence and group: a fraction of a small
        # max_tokens would otherwise refuse the first step
        slots = max(math.ceil(config.resident_fraction * total), num_sequences * len(groups))
    else:
        slots = total + num_sequences * len(groups)
    field, value = _device_field(config)
    if slots < num_sequences * len(groups):
        raise ConfigError.field(
            field,
            value,
            f"the device tier needs one open {bs}-token block per sequence and layer group: "
            f"at least {format_bytes(num_sequences * len(groups) * device_block_bytes)} "
            f"({format_bytes(device_block_bytes)} per block)",
        )
    lower = config.host_budget > 0 or config.disk_dir is not None
    if not lower and slots < total:
        raise ConfigError.field(
            field,
            value,
            f"with no host or disk tier the device must hold max_tokens={config.max_tokens}: "
            f"at least {format_bytes(total * device_block_bytes)} (device_budget); or add "
            "host_budget / disk_dir for the rest, or lower max_tokens",
        )
    what, memory = device_memory(config.device)
    if memory and slots * device_block_bytes > memory:
        raise ConfigError.field(
            field,
            value,
            f"the device tier would take {format_bytes(slots * device_block_bytes)}, more "
            f"than the {format_bytes(memory)} of {what}: lower max_tokens, or keep part of "
            "it on the device (resident_fraction / device_budget) with host_budget / disk_dir",
        )
    tables = num_sequences * len(groups)
    sink_blocks = -(-config.sink_tokens // bs)
    if tables * sink_blocks > slots:
        per_seq = slots // tables * bs
        raise ConfigError.field(
            "sink_tokens",
            config.sink_tokens,
            f"the sinks stay on the device, which holds {per_seq} tokens per sequence and "
            f"layer group ({field}={value!r}): at most {per_seq}, or raise {field}",
        )
    per_group = device_floor_blocks(bs, config.sink_tokens, config.residual_tokens, lossy=True)
    need = tables * per_group
    if lossy_below and slots < need:
        raise ConfigError.field(
            field,
            value,
            f"lossy lower tiers need the residual window (residual_tokens="
            f"{config.residual_tokens}) + the sinks (sink_tokens={config.sink_tokens}) + an "
            f"open block per sequence on the device: at least "
            f"{format_bytes(need * device_block_bytes)}; raise {field} or lower residual_tokens "
            "/ sink_tokens",
        )
    return slots


def lower_slots(budget: int, block_bytes: int, field: str) -> int:
    """Slots of a host / disk tier of `budget` bytes.

    Raises:
        ConfigError: a budget above 0 smaller than one block (the tier would hold
            nothing: a silent no-tier).
    """
    if 0 < budget < block_bytes:
        raise ConfigError.field(
            field,
            budget,
            f"smaller than one block of this model ({format_bytes(block_bytes)}): raise it "
            "to at least that",
        )
    return budget // block_bytes


def lower_tier_bytes(
    model: Any, codec: str, max_tokens: int, block_size: int, field: str = "codec"
) -> int:
    """Bytes a host / disk tier of `codec` needs to hold every block of a
    `max_tokens`-token sequence, plus one spare block per group (the last block may
    still be open when the device evicts)."""
    groups = model_groups(model)
    blocks = blocks_for_context(groups, max_tokens, block_size) + len(groups)
    return blocks * get_codec(codec, field).block_nbytes(group_layout(model, block_size))


def placement(
    model: Any,
    context: int,
    *,
    codec: str = "none",
    resident: float = 1.0,
    block_size: int = 64,
    residual_tokens: int = 128,
    sink_tokens: int = 4,
    disk_dir: str | None = None,
    disk_share: float | None = None,
) -> dict[str, Any]:
    """CacheConfig fields that keep `resident` of a `context`-token sequence on the device
    and the rest on the host (and, with `disk_dir`, half of the rest on disk, or
    `disk_share` of the whole on disk).

    The codec applies to the lower tiers. A lossy codec needs the residual window (the
    newest `residual_tokens`) + the sinks + the open block on the device (per layer
    group), so the device gets at least that many blocks whatever `resident` says.

    Args:
        model: The model (sizes blocks and groups).
        context: Tokens the cache must hold.
        codec: Codec of the host (and disk) tier.
        resident: Fraction of the context resident on the device, in (0, 1].
        block_size: Tokens per block.
        residual_tokens / sink_tokens: The full-precision window and the sinks.
        disk_dir: Parent directory of a disk tier (None = no disk tier).
        disk_share: With disk_dir, the share of the context on disk (None: half of
            what is not resident); the host holds the rest of the cold blocks.

    Returns:
        Keyword fields for :class:`~kvstrata.config.CacheConfig`.
    """
    if isinstance(resident, str):
        raise ConfigError.field("resident", resident, "a fraction in (0, 1], e.g. 0.1")
    resident = parse_fraction(resident, "resident")
    context = parse_tokens(context, "context")
    lower = get_codec(codec, "codec")
    layout = group_layout(model, block_size)
    groups = model_groups(model)
    total_blocks = blocks_for_context(groups, context, block_size)
    dev_blocks = math.ceil(resident * total_blocks - 1e-9)
    if not lower.lossless:
        per_group = device_floor_blocks(block_size, sink_tokens, residual_tokens, lossy=True)
        dev_blocks = max(dev_blocks, len(groups) * per_group)
    dev_blocks = min(max(dev_blocks, len(groups)), total_blocks)
    kwargs: dict[str, Any] = {
        "block_size": block_size,
        "max_tokens": context,
        "residual_tokens": residual_tokens,
        "sink_tokens": sink_tokens,
        "device_budget": dev_blocks * get_codec("none").block_nbytes(layout),
    }
    cold_blocks = total_blocks - dev_blocks
    if cold_blocks == 0:
        return kwargs
    # One spare block per group and lower tier: the last block may still be open when
    # the device evicts, so the lower tiers can briefly hold one block more.
    spare = len(groups)
    lower_bytes = lower.block_nbytes(layout)
    kwargs["host_codec"] = codec
    if disk_dir is None:
        kwargs["host_budget"] = (cold_blocks + spare) * lower_bytes
        return kwargs
    host_blocks = max(1, cold_blocks // 2)
    if disk_share is not None:
        share = parse_fraction(disk_share, "disk_share")
        host_blocks = max(0, cold_blocks - math.ceil(share * total_blocks - 1e-9))
    kwargs["host_budget"] = host_blocks * lower_bytes
    kwargs["disk_dir"] = disk_dir
    kwargs["disk_codec"] = codec
    kwargs["disk_budget"] = (cold_blocks - host_blocks + spare) * lower_bytes
    return kwargs
