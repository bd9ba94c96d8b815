"""What a store builds from its config once the K/V layout is known: its tiers.

device   DeviceTier, sized by `budgets.device_slots` (device_budget, or
         resident_fraction of max_tokens; at least the floor every sequence pins)
host     HostTier of host_budget bytes (pinned when CUDA is there), if any
cxl      HostTier named "cxl" of cxl_budget bytes on the CPU-less (CXL) NUMA node, if any
disk     DiskTier of disk_budget bytes in disk_dir (durable, checksummed), if any
remote   RemoteTier on the server at remote_url (shared, content-addressed), if any:
         not an arena, the prefix index reads and writes it (store/remote.py)

NUMA (`numa`, kvstrata.platform.numa): before the arenas on the CPU (the host tier's, and
the device tier's on a CPU-only machine) are allocated, the plan of this machine's
topology pins the building thread (the engine thread, or a TieredCache's caller) and
binds the arenas' pages; a one-node machine gets a no-op that says so (a log line, and
`stats()["numa"]`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from kvstrata.codecs.base import Codec
from kvstrata.codecs.registry import get_codec
from kvstrata.config import CacheConfig
from kvstrata.core.layout import BlockLayout
from kvstrata.model import budgets
from kvstrata.model.groups import LayerGroup
from kvstrata.platform.numa import NumaPlan, gpu_bdf, pci_node, plan_placement, read_topology
from kvstrata.platform.numa_bind import pin_thread
from kvstrata.store.remote import RemoteBlocks
from kvstrata.tiers.base import Tier
from kvstrata.tiers.disk import DiskTier
from kvstrata.tiers.memory import DeviceTier, HostTier
from kvstrata.tiers.remote import RemoteTier

CODEC_FIELDS = ("device_codec", "host_codec", "disk_codec")
log = logging.getLogger(__name__)
_NOTICES: set[tuple[int, str]] = set()  # NUMA notices logged so far (level, text)


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
    on_cpu = device.type == "cpu" or config.host_budget > 0  # arenas in host RAM
    plan = place_numa(config.numa, device, on_cpu)
    numa = (plan.nodes, plan.policy) if plan.nodes else None
    tiers: list[Tier] = [DeviceTier(layout, dev_slots, dev_codec, str(device), numa)]
    if config.host_budget:
        codec = codecs["host_codec"]
        slots = budgets.lower_slots(config.host_budget, codec.block_nbytes(layout), "host_budget")
        tiers.append(HostTier(layout, slots, codec, numa))
    if config.cxl_budget:
        codec = codecs["host_codec"]
        slots = budgets.lower_slots(config.cxl_budget, codec.block_nbytes(layout), "cxl_budget")
        node = plan.cxl_node if plan.cxl_node is not None else (plan.nodes or (None,))[0]
        on_node = ((node,), "preferred") if node is not None else None
        tiers.append(HostTier(layout, slots, codec, on_node, name="cxl"))
    for tier in tiers:
        tier.numa_plan = plan
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


def place_numa(mode: str | int, device: torch.device, host_arenas: bool = True) -> NumaPlan:
    """The NUMA plan of this machine for `mode` (CacheConfig.numa), with the calling
    thread pinned to its CPUs (and its torch thread count cut to them); the plan's
    notice is logged once per process (a warning when its CPUs could not be pinned).
    Without arenas on the CPU there is nothing to place."""
    if mode == "off" or not host_arenas:
        why = "NUMA placement off (numa='off')" if mode == "off" else "no host arena to place"
        return NumaPlan(mode, notice=why)
    topology = read_topology()
    gpu = None
    if device.type == "cuda" and len(topology.memory_nodes) > 1:
        bdf = gpu_bdf(device.index or 0)
        gpu = pci_node(bdf) if bdf else None
    try:
        allowed = frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        allowed = None
    plan = plan_placement(topology, mode, allowed_cpus=allowed, gpu_node=gpu)
    if plan.cpus and not pin_thread(plan.cpus):
        log.warning("NUMA: could not pin the thread to CPUs %s", plan.as_dict()["cpus"])
    elif plan.cpus and torch.get_num_threads() > len(plan.cpus):
        torch.set_num_threads(len(plan.cpus))  # no more OpenMP workers than pinned CPUs
    # a node asked for on one node is said out loud; each notice once per process
    level = logging.WARNING if isinstance(mode, int) and not plan.applies else logging.INFO
    if (level, plan.notice) not in _NOTICES:
        _NOTICES.add((level, plan.notice))
        log.log(level, "NUMA: %s", plan.notice)
    return plan


def numa_stats(tiers: dict[str, Tier]) -> dict[str, Any]:
    """The NUMA plan the store's arenas follow (`NumaPlan.as_dict`), for `stats()`."""
    plan = next((t.numa_plan for t in tiers.values() if t.numa_plan is not None), None)
    return (plan or NumaPlan("off", notice="not placed")).as_dict()
