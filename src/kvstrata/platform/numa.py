"""NUMA topology (read from sysfs) and where a store's host arenas and threads go.

`read_topology(root)` reads Linux's node tree, `<root>/devices/system/node/node*/`
(`cpulist`, `meminfo`, `distance`, and where the firmware gives them through ACPI HMAT
or CXL CDAT, `access*/initiators/read_bandwidth` and `read_latency`). `root` is "/sys"
on a machine, a recorded copy of the tree in the tests. A node with memory and no CPUs
is a CPU-less node: CXL-attached memory (or persistent memory) that Linux onlines as a
NUMA node of its own. A GPU's node is its PCI device's `numa_node`
(`<root>/bus/pci/devices/<bdf>/numa_node`): the node of its PCIe root port.

`plan_placement` decides, as a pure function of the topology, the CPUs the process may
use and the GPU's node, where the store's host arenas live and which CPUs the thread
that builds the store (the engine thread, or a `TieredCache`'s caller) is pinned to:

- one node with memory: nothing to decide, a no-op that says so;
- with a GPU: its node (host <-> device copies read and write the arenas over its
  PCIe root; memory on the other socket crosses the inter-socket link first), threads
  on that node's CPUs;
- CPU only, the process on CPUs of one node: that node, no pinning needed;
- CPU only, on CPUs of several nodes: the arenas interleaved page by page over those
  nodes (attention reads them from threads on every node: interleaving gives them the
  nodes' summed bandwidth instead of one node's), threads left where they are (pinning
  them to one socket would halve the cores the model's matmuls run on);
- `numa=<node>`: that node (a CPU-less one too: the host tier on CXL memory), threads
  on its CPUs, or on the nearest node's that has CPUs.

It also names the CPU-less node nearest to the arenas, with its size and bandwidth,
as a tier below local RAM (the planner's `--cxl-memory` row). `kvstrata.platform.
numa_bind` applies a plan: it pins the thread and binds the arenas' pages.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstrata.core.errors import ConfigError
from kvstrata.platform.hardware import CXL_LINK, machine_ram

NODE_DIR = "devices/system/node"
NUMA_HELP = "'auto', 'off', or a NUMA node id of this machine (an int >= 0)"
# A CPU-less (CXL) node's read bandwidth when its firmware publishes none (HMAT / CDAT).
CXL_DEFAULT_BANDWIDTH = CXL_LINK.bandwidth


@dataclass(frozen=True)
class NumaNode:
    """One NUMA node.

    Fields:
        node_id: Linux's node number.
        cpus: the CPUs on it (empty: a CPU-less node).
        memory_bytes / free_bytes: its MemTotal / MemFree.
        distances: SLIT distance to each node, by node id (10 = itself).
        read_bandwidth: bytes/s its best CPU initiator reads at (HMAT / CDAT), or None.
        read_latency_ns: the same initiator's read latency, or None.
    """

    node_id: int
    cpus: frozenset[int]
    memory_bytes: int
    free_bytes: int
    distances: dict[int, int] = field(default_factory=dict)
    read_bandwidth: float | None = None
    read_latency_ns: float | None = None

    @property
    def cpuless(self) -> bool:
        """Memory and no CPUs: CXL (or persistent) memory, a tier below local RAM."""
        return not self.cpus and self.memory_bytes > 0


@dataclass(frozen=True)
class Topology:
    """The NUMA nodes of a machine (`read_topology`), by node id."""

    nodes: dict[int, NumaNode]
    source: str = "/sys"

    @property
    def memory_nodes(self) -> list[int]:
        return sorted(n for n, node in self.nodes.items() if node.memory_bytes > 0)

    def distance(self, a: int, b: int) -> int:
        """SLIT distance from node a to node b (10 local, 20+ across sockets); 255 when
        the tree does not say."""
        return self.nodes[a].distances.get(b, 10 if a == b else 255)

    def nearest(self, node: int, candidates: list[int]) -> int | None:
        """The candidate nearest to `node` (ties: the lower id), or None."""
        return min(candidates, key=lambda c: (self.distance(node, c), c), default=None)


def parse_cpulist(text: str) -> frozenset[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11} (Linux's cpulist / nodelist format)."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(out)


def format_cpulist(cpus: frozenset[int] | tuple[int, ...] | set[int]) -> str:
    """{0, 1, 2, 3, 8} -> '0-3,8' (the inverse of `parse_cpulist`)."""
    ids, runs = sorted(cpus), []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        runs.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(runs)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _meminfo(text: str | None) -> dict[str, int]:
    """'Node 0 MemTotal:  24683772 kB' lines -> {'MemTotal': bytes}."""
    out = {}
    for line in (text or "").splitlines():
        parts = line.split()
        if len(parts) == 5 and parts[4] == "kB" and parts[3].isdigit():
            out[parts[2].rstrip(":")] = int(parts[3]) * 1024
    return out


def _access(node_dir: Path) -> tuple[float | None, float | None]:
    """(read bandwidth in bytes/s, read latency in ns) from HMAT / CDAT, CPU initiators
    first (access1), else the best initiator of any kind (access0); Linux gives MB/s."""
    for access in ("access1", "access0"):
        base = node_dir / access / "initiators"
        bw, lat = _read(base / "read_bandwidth"), _read(base / "read_latency")
        if bw is not None or lat is not None:
            bandwidth = float(bw) * 1e6 if bw and bw.strip() and float(bw) > 0 else None
            latency = float(lat) if lat and lat.strip() and float(lat) > 0 else None
            return bandwidth, latency
    return None, None


def read_topology(root: str | os.PathLike = "/sys") -> Topology:
    """The NUMA nodes under `root` (a sysfs mount, or a recorded copy of its node tree).

    A machine (or kernel) without a node tree is one node holding every CPU and all
    of its RAM."""
    base = Path(root) / NODE_DIR
    node_dirs = sorted((int(p.name[4:]), p) for p in base.glob("node*") if p.name[4:].isdigit())
    if not node_dirs:
        cpus = frozenset(range(os.cpu_count() or 1))
        ram = machine_ram()
        return Topology({0: NumaNode(0, cpus, ram, ram, {0: 10})}, str(root))
    nodes = {}
    for node_id, path in node_dirs:
        info = _meminfo(_read(path / "meminfo"))
        row = (_read(path / "distance") or "").split()
        ids = [n for n, _ in node_dirs]
        distances = {ids[i]: int(d) for i, d in enumerate(row) if i < len(ids)}
        bandwidth, latency = _access(path)
        nodes[node_id] = NumaNode(
            node_id,
            parse_cpulist(_read(path / "cpulist") or ""),
            info.get("MemTotal", 0),
            info.get("MemFree", 0),
            distances,
            bandwidth,
            latency,
        )
    return Topology(nodes, str(root))


def pci_node(bdf: str, root: str | os.PathLike = "/sys") -> int | None:
    """The NUMA node of PCI device `bdf` ('0000:17:00.0'), None when the tree does not
    say (-1: a one-node machine, or firmware that gives none)."""
    text = _read(Path(root) / "bus/pci/devices" / bdf.lower() / "numa_node")
    try:
        node = int(text) if text is not None else -1
    except ValueError:
        return None
    return node if node >= 0 else None


def gpu_bdf(index: int) -> str | None:
    """The PCI address of CUDA device `index` ('0000:17:00.0'), from torch's device
    properties; None without CUDA or where torch does not say."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(index)
    bus = getattr(props, "pci_bus_id", None)
    if bus is None:
        return None
    domain, device = getattr(props, "pci_domain_id", 0), getattr(props, "pci_device_id", 0)
    return f"{domain:04x}:{bus:02x}:{device:02x}.0"


def cxl_memory(topology: Topology) -> tuple[int, float] | None:
    """(bytes, read bandwidth in bytes/s) of the machine's CPU-less nodes taken together
    (each is its own expander and link: their bandwidths add up), each node's HMAT /
    CDAT figure or `CXL_DEFAULT_BANDWIDTH`; None when there is none."""
    nodes = [n for n in topology.nodes.values() if n.cpuless]
    if not nodes:
        return None
    size = sum(n.memory_bytes for n in nodes)
    return size, sum(n.read_bandwidth or CXL_DEFAULT_BANDWIDTH for n in nodes)


def check_numa(value: Any, topology: Topology | None = None) -> str | int:
    """`value` as CacheConfig.numa: 'auto', 'off', or a node id ('1' or 1) that the
    topology (this machine's by default) has, with memory.

    Raises:
        ConfigError: anything else, in one line naming the nodes there are.
    """
    if isinstance(value, str) and value.strip().lower() in ("auto", "off"):
        return value.strip().lower()
    node = value
    if isinstance(value, str) and value.strip().isdigit():
        node = int(value.strip())
    if isinstance(node, bool) or not isinstance(node, int) or node < 0:
        raise ConfigError.field("numa", value, NUMA_HELP)
    topology = topology or read_topology()
    have = topology.memory_nodes
    if node not in have:
        listed = ", ".join(map(str, have))
        raise ConfigError.field(
            "numa", value, f"this machine has NUMA nodes with memory: {listed}; or 'auto'/'off'"
        )
    return node


@dataclass(frozen=True)
class NumaPlan:
    """Where a store's host arenas and its building thread go (`plan_placement`).

    Fields:
        mode: the `numa` setting it follows ('auto', 'off' or a node id).
        nodes: the arenas' node(s): one ('preferred': filled from there first, then
            the next nearest when it is full) or several ('interleave': page by page).
            Empty: leave memory where the kernel puts it (no-op).
        policy: 'preferred', 'interleave' or 'none'.
        cpus: CPUs the building thread is pinned to (threads it starts inherit
            them); empty: left as they are.
        gpu_node: the GPU's node, when there is a GPU and sysfs names it.
        cxl_node: the nearest CPU-less node, a tier below local RAM, or None.
        cxl_bytes / cxl_bandwidth: its size (bytes) and read bandwidth (bytes/s).
        cxl_bandwidth_source: 'hmat' (its firmware's) or 'published' (the default).
        notice: what was decided and why, one line.
    """

    mode: str | int
    nodes: tuple[int, ...] = ()
    policy: str = "none"
    cpus: tuple[int, ...] = ()
    gpu_node: int | None = None
    cxl_node: int | None = None
    cxl_bytes: int = 0
    cxl_bandwidth: float = 0.0
    cxl_bandwidth_source: str = ""
    notice: str = ""

    @property
    def applies(self) -> bool:
        """Something to do: memory to bind or a thread to pin."""
        return bool(self.nodes or self.cpus)

    def as_dict(self) -> dict[str, Any]:
        """The plan for stats (JSON-safe; CPUs as a cpulist string)."""
        return {
            "mode": self.mode,
            "applies": self.applies,
            "nodes": list(self.nodes),
            "policy": self.policy,
            "cpus": format_cpulist(self.cpus),
            "gpu_node": self.gpu_node,
            "cxl_node": self.cxl_node,
            "cxl_bytes": self.cxl_bytes,
            "cxl_bandwidth": self.cxl_bandwidth,
            "notice": self.notice,
        }


def plan_placement(
    topology: Topology,
    mode: str | int = "auto",
    *,
    allowed_cpus: frozenset[int] | set[int] | None = None,
    gpu_node: int | None = None,
) -> NumaPlan:
    """Decide where host arenas and the building thread go (the module docstring).

    Args:
        topology: the machine's nodes (`read_topology`).
        mode: 'auto', 'off', or a node id (`check_numa`; ConfigError for a node
            without memory in this topology).
        allowed_cpus: the CPUs this process may run on (its affinity); None: all.
        gpu_node: the node of the GPU the store computes on; None: no GPU, or unknown.
    """
    allowed = frozenset(allowed_cpus) if allowed_cpus is not None else None
    mem = topology.memory_nodes

    def usable(node: int) -> frozenset[int]:
        cpus = topology.nodes[node].cpus
        return cpus if allowed is None else cpus & allowed

    cpu_nodes = [n for n in sorted(topology.nodes) if usable(n)]
    if mode == "off":
        return NumaPlan(mode, gpu_node=gpu_node, notice="NUMA placement off (numa='off')")
    if len(mem) < 2:
        where = f"node{mem[0]}" if mem else "no node tree"
        return NumaPlan(
            mode, gpu_node=gpu_node, notice=f"one NUMA node here ({where}): placement is a no-op"
        )
    if isinstance(mode, int):
        if mode not in mem:
            listed = ", ".join(map(str, mem))
            raise ConfigError.field("numa", mode, f"the NUMA nodes with memory are {listed}")
        node, why = mode, f"numa={mode}"
        pin_from = node if usable(node) else topology.nearest(node, cpu_nodes)
        cpus = usable(pin_from) if pin_from is not None else frozenset()
        nodes, policy = (node,), "preferred"
    elif gpu_node is not None and gpu_node in topology.nodes:
        node = gpu_node if usable(gpu_node) else topology.nearest(gpu_node, cpu_nodes)
        why = f"the GPU's PCIe root is on node {gpu_node}"
        if node != gpu_node:
            why += f", whose CPUs this process may not use: threads on node {node}"
        cpus = usable(node) if node is not None else frozenset()
        nodes, policy = ((gpu_node,), "preferred")
    elif len(cpu_nodes) == 1:
        node, why = cpu_nodes[0], f"this process runs on node {cpu_nodes[0]}'s CPUs only"
        nodes, policy, cpus = (node,), "preferred", frozenset()
    else:
        spread = [n for n in cpu_nodes if topology.nodes[n].memory_bytes > 0] or mem
        why = f"readers on nodes {', '.join(map(str, cpu_nodes))}: pages interleaved"
        nodes, policy, cpus = tuple(spread), "interleave", frozenset()
    cxl = [n for n in mem if topology.nodes[n].cpuless and n not in nodes]
    near = topology.nearest(nodes[0], cxl) if cxl else None
    extra: dict[str, Any] = {}
    if near is not None:
        cxl_node = topology.nodes[near]
        bw = cxl_node.read_bandwidth
        extra = {
            "cxl_node": near,
            "cxl_bytes": cxl_node.memory_bytes,
            "cxl_bandwidth": bw or CXL_DEFAULT_BANDWIDTH,
            "cxl_bandwidth_source": "hmat" if bw else "published",
        }
    shown = ("node " if len(nodes) == 1 else "nodes ") + ",".join(map(str, nodes))
    pinned = f", thread on CPUs {format_cpulist(cpus)}" if cpus else ""
    below = f"; CPU-less node {near} below it" if near is not None else ""
    notice = f"host arenas on {shown} ({policy}: {why}){pinned}{below}"
    return NumaPlan(
        mode, tuple(nodes), policy, tuple(sorted(cpus)), gpu_node, notice=notice, **extra
    )
