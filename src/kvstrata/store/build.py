"""What a store builds from its config once the K/V layout is known: its tiers.

device   DeviceTier, sized by `budgets.device_slots` (device_budget, or
         resident_fraction of max_tokens; at least the floor every sequence pins)
host     HostTier of host_budget bytes (pinned when CUDA is there), if any
disk     DiskTier of disk_budget bytes in disk_dir (durable, checksummed), if any
remote   RemoteTier on the server at remote_url (shared, content-addressed), if any:
         not an arena, the prefix index reads and writes it (store/remote.py)
"""

from __future__ import annotations

import torch

from kvstrata.codecs.base import Codec
from kvstrata.codecs.registry import get_codec
from kvstrata.config import CacheConfig
from kvstrata.core.layout import BlockLayout
from kvstrata.model import budgets
from kvstrata.model.groups import LayerGroup
from kvstrata.store.remote import RemoteBlocks
from kvstrata.tiers.base import Tier
from kvstrata.tiers.disk import DiskTier
from kvstrata.tiers.memory import DeviceTier, HostTier
from kvstrata.tiers.remote import RemoteTier

CODEC_FIELDS = ("device_codec", "host_codec", "disk_codec")


def lossy_below(codecs: dict[str, Codec]) -> bool:
    """A tier below the device stores a lossy codec (the residual window then stays on
    the device)."""
    return not all(codecs[f].lossless for f in ("host_codec", "disk_codec"))


def build_tiers(
    config: CacheConfig,
    codecs: dict[str, Codec],
    layout: BlockLayout,
    groups: list[LayerGroup],
    num_sequences: int,
    device: torch.device,
) -> list[Tier]:
    """The tiers, top down (see the module docstring).

    Args:
        config: the store's CacheConfig.
        codecs: the codec of each tier, by CacheConfig field (CODEC_FIELDS).
        layout: the block layout (dtype and shapes of the model's K/V).
        groups: the store's layer groups.
        num_sequences: sequences expected at once (the device floor of each).
        device: the device tier's device.
    """
    dev_codec = codecs["device_codec"]
    dev_slots = budgets.device_slots(
        config, groups, dev_codec.block_nbytes(layout), num_sequences, lossy_below(codecs)
    )
    tiers: list[Tier] = [DeviceTier(layout, dev_slots, dev_codec, device=str(device))]
    if config.host_budget:
        codec = codecs["host_codec"]
        slots = budgets.lower_slots(config.host_budget, codec.block_nbytes(layout), "host_budget")
        tiers.append(HostTier(layout, slots, codec))
    if config.disk_dir:
        codec = codecs["disk_codec"]
        slots = budgets.lower_slots(config.disk_budget, codec.block_nbytes(layout), "disk_budget")
        tiers.append(
            DiskTier(
                layout,
                slots,
                config.disk_dir,
                codec,
                compress=config.disk_compress,
                o_direct=config.disk_o_direct,
                delta=config.disk_delta,
            )
        )
    return tiers


def build_remote(
    config: CacheConfig, layout: BlockLayout, groups: list[LayerGroup]
) -> RemoteBlocks | None:
    """The remote tier of `remote_url` (codec: remote_codec, else the disk codec), or None."""
    if config.remote_url is None:
        return None
    name = config.remote_codec or config.disk_codec
    codec = get_codec(name, "remote_codec" if config.remote_codec else "disk_codec")
    codec.validate(layout)
    tier = RemoteTier(config.remote_url, ttl=config.remote_ttl, timeout=config.remote_timeout)
    return RemoteBlocks(tier, layout, codec, groups)
