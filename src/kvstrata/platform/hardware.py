"""Hardware the planner sizes against: a GPU, the host link, an optional disk, host RAM.

Bandwidths are bytes per second, decimal (25 GB/s = 25e9 B/s), as vendors quote them.
Links are *measured* pinned-memory copy rates, not the PCIe headline numbers the seed
lists (PCIe 4.0 x16 is "32 GB/s" on paper, ~25 GB/s in a pinned cudaMemcpy). `LINKS`
is the one table of GPU<->host links: the planner sizes against it (`get_link`) and
the transfer engine's simulated links are made from it (`LinkModel.preset`).

A CPU-less NUMA node (CXL memory, kvstrata.platform.numa) is a `cxl` link of its own:
the planner puts the cold KV that host RAM cannot hold there before disk.

GPU capacities are the labelled size read as GiB (a "24 GB" RTX 4090 shows 24564 MiB
in nvidia-smi); the planner's reserve covers the driver/context share that is not usable.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvstrata.core.errors import ConfigError

GIB = 1024**3


@dataclass(frozen=True)
class GPUSpec:
    """An accelerator: memory capacity (bytes) and HBM/GDDR bandwidth (bytes/s)."""

    name: str
    memory_bytes: int
    bandwidth: float


@dataclass(frozen=True)
class LinkSpec:
    """A copy path: GPU<->host (PCIe) or disk<->host (NVMe), in bytes/s."""

    name: str
    bandwidth: float
    description: str = ""


@dataclass(frozen=True)
class Hardware:
    """Everything the planner needs to know about the machine.

    Fields:
        gpu: the accelerator.
        link: GPU <-> host copy link.
        disk: disk <-> host link, None when there is no disk tier.
        host_memory: host RAM in bytes.
        disk_capacity: disk space for KV in bytes; None = not given (assumed ample).
        cxl: host <-> CXL memory (a CPU-less NUMA node), None when there is none.
        cxl_memory: that memory's size in bytes (0 without one).
    """

    gpu: GPUSpec
    link: LinkSpec
    disk: LinkSpec | None
    host_memory: int
    disk_capacity: int | None = None
    cxl: LinkSpec | None = None
    cxl_memory: int = 0


GPUS: dict[str, GPUSpec] = {
    "rtx4090": GPUSpec("rtx4090", 24 * GIB, 1008e9),
    "a100-40": GPUSpec("a100-40", 40 * GIB, 1555e9),
    "a100-80": GPUSpec("a100-80", 80 * GIB, 2039e9),
    "h100": GPUSpec("h100", 80 * GIB, 3350e9),
    "h200": GPUSpec("h200", 141 * GIB, 4800e9),
    "l4": GPUSpec("l4", 24 * GIB, 300e9),
}

LINKS: dict[str, LinkSpec] = {
    "pcie3": LinkSpec("pcie3", 12e9, "PCIe 3.0 x16, measured pinned copy"),
    "pcie3-x8": LinkSpec("pcie3-x8", 6e9, "PCIe 3.0 x8, measured pinned copy"),
    "pcie4": LinkSpec("pcie4", 25e9, "PCIe 4.0 x16, measured pinned copy"),
    "pcie5": LinkSpec("pcie5", 50e9, "PCIe 5.0 x16, measured pinned copy"),
}

DISKS: dict[str, LinkSpec] = {
    "nvme-gen3": LinkSpec("nvme-gen3", 3.5e9, "NVMe PCIe 3.0 x4 sequential read"),
    "nvme-gen4": LinkSpec("nvme-gen4", 7e9, "NVMe PCIe 4.0 x4 sequential read"),
}

# A CPU-less NUMA node of CXL memory: one CXL 2.0 expander on PCIe 5.0 x8, its vendor's
# figure (docs/numa.md); `kvstrata plan --cxl-memory auto` reads the node's own (HMAT).
CXL_LINK = LinkSpec("cxl", 35e9, "CXL 2.0 memory expander, PCIe 5.0 x8 (vendor figure)")

# Fixed cost of one host<->device copy (driver call and DMA setup), seconds; the
# transfer engine's simulated links add it to bytes / bandwidth.
LINK_LATENCY_S = 10e-6

# The seed's "PCIe bandwidth limited (e.g. PCIe 3.0 x8)" threshold, bytes/s.
SLOW_LINK_BANDWIDTH = 8e9


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask; os.cpu_count() where
    the platform has none)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def machine_ram() -> int:
    """This machine's physical RAM in bytes (os.sysconf), 0 when the OS does not say."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def _positive(value: float | None, field: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError.field(field, value, "a positive number")
    return value


def get_gpu(name: str, memory: int | None = None, bandwidth: float | None = None) -> GPUSpec:
    """A GPU preset, optionally with its memory (bytes) or bandwidth (bytes/s) overridden.

    `name="custom"` needs both overrides.

    Raises:
        ConfigError: unknown name (lists the presets) or a bad override.
    """
    memory = _positive(memory, "gpu_memory")
    bandwidth = _positive(bandwidth, "gpu_bandwidth")
    key = name.lower()
    if key == "custom":
        if memory is None or bandwidth is None:
            raise ConfigError.field("gpu", name, "'custom' needs --gpu-memory and --gpu-bandwidth")
        return GPUSpec("custom", int(memory), float(bandwidth))
    if key not in GPUS:
        accepted = f"presets: {', '.join(GPUS)}; or 'custom' with --gpu-memory/--gpu-bandwidth"
        raise ConfigError.field("gpu", name, accepted)
    base = GPUS[key]
    return GPUSpec(
        base.name,
        int(memory) if memory is not None else base.memory_bytes,
        float(bandwidth) if bandwidth is not None else base.bandwidth,
    )


def lookup_preset(table: dict[str, LinkSpec], name: str, field: str, also: str = "") -> LinkSpec:
    """table[name], case-insensitive.

    Raises:
        ConfigError: unknown name: `<field>='<name>' is invalid: one of <names><also>`.
    """
    spec = table.get(name.lower())
    if spec is None:
        raise ConfigError.field(field, name, f"one of {', '.join(table)}{also}")
    return spec


def _get_link(
    table: dict[str, LinkSpec], name: str, bandwidth: float | None, field: str
) -> LinkSpec:
    bandwidth = _positive(bandwidth, f"{field}_bandwidth")
    if name.lower() == "custom" and bandwidth is not None:
        return LinkSpec("custom", float(bandwidth), "user-given bandwidth")
    base = lookup_preset(table, name, field, also="; or 'custom' with a bandwidth")
    if bandwidth is None:
        return base
    return LinkSpec(base.name, float(bandwidth), base.description + " (bandwidth overridden)")


def get_link(name: str, bandwidth: float | None = None) -> LinkSpec:
    """A GPU<->host link preset (pcie3, pcie3-x8, pcie4, pcie5), bandwidth overridable.

    Raises:
        ConfigError: unknown name (lists the valid ones).
    """
    return _get_link(LINKS, name, bandwidth, "link")


def get_disk(name: str, bandwidth: float | None = None) -> LinkSpec:
    """A disk link preset (nvme-gen3, nvme-gen4), bandwidth overridable.

    Raises:
        ConfigError: unknown name (lists the valid ones).
    """
    return _get_link(DISKS, name, bandwidth, "disk_link")


def make_hardware(
    gpu: str = "rtx4090",
    link: str = "pcie4",
    disk_link: str | None = None,
    *,
    gpu_memory: int | None = None,
    gpu_bandwidth: float | None = None,
    link_bandwidth: float | None = None,
    disk_bandwidth: float | None = None,
    host_memory: int | None = None,
    disk_capacity: int | None = None,
    cxl_memory: int | None = None,
    cxl_bandwidth: float | None = None,
) -> Hardware:
    """Assemble a `Hardware` from preset names and overrides.

    Args:
        gpu / link / disk_link: preset names (disk_link None or "none": no disk tier).
        gpu_memory / host_memory / disk_capacity / cxl_memory: bytes.
        gpu_bandwidth / link_bandwidth / disk_bandwidth / cxl_bandwidth: bytes per second
            (cxl_bandwidth needs cxl_memory; its default is `CXL_LINK`'s).

    Returns:
        The hardware; host_memory defaults to this machine's RAM.

    Raises:
        ConfigError: unknown preset or non-positive override (names the field).
    """
    disk = None
    if disk_link is not None and disk_link.lower() != "none":
        disk = get_disk(disk_link, disk_bandwidth)
    elif disk_capacity is not None:
        raise ConfigError.field("disk_capacity", disk_capacity, "set --disk-link to add a disk")
    if host_memory is None:
        host_memory = machine_ram()
    elif isinstance(host_memory, bool) or not isinstance(host_memory, int) or host_memory < 0:
        raise ConfigError.field("host_memory", host_memory, "a byte count >= 0")
    _positive(disk_capacity, "disk_capacity")
    cxl = None
    if cxl_memory is not None:
        _positive(cxl_memory, "cxl_memory")
        bw = _positive(cxl_bandwidth, "cxl_bandwidth")
        cxl = CXL_LINK if bw is None else LinkSpec("cxl", float(bw), "CXL memory, user-given")
    elif cxl_bandwidth is not None:
        raise ConfigError.field("cxl_bandwidth", cxl_bandwidth, "set --cxl-memory to add CXL")
    return Hardware(
        gpu=get_gpu(gpu, gpu_memory, gpu_bandwidth),
        link=get_link(link, link_bandwidth),
        disk=disk,
        host_memory=host_memory,
        disk_capacity=disk_capacity,
        cxl=cxl,
        cxl_memory=int(cxl_memory or 0),
    )


def device_memory(device: str) -> tuple[str, int]:
    """(what, bytes) of memory behind `device` ('auto' resolved): the GPU's total
    memory for CUDA, physical RAM for the CPU (0 when unknown)."""
    if device == "cpu":
        return "this machine's RAM", machine_ram()
    import torch

    if device == "auto" and not torch.cuda.is_available():
        return "this machine's RAM", machine_ram()
    index = 0 if device in ("auto", "cuda") else int(device.split(":")[1])
    return f"cuda:{index}", int(torch.cuda.get_device_properties(index).total_memory)
