"""NUMA placement (platform/numa.py, numa_bind.py; store/build.py's place_numa): the
topology read from sysfs trees recorded under numa_trees/ (a 2-socket machine with a GPU
on each socket, one socket with a CPU-less CXL node, one node), the decisions taken on
them, the one-line errors of `numa`, and the real system calls that apply a plan on this
machine (mbind / get_mempolicy on node 0, the thread's affinity), ending in a store whose
host arena is bound where the plan says."""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch

from blockstore_harness import read_sequence
from kvstrata.attention.writes import write_layer, write_plan
from kvstrata.config import CacheConfig
from kvstrata.core.errors import ConfigError
from kvstrata.model.geometry import KVGeometry
from kvstrata.platform import numa_bind
from kvstrata.platform.numa import (
    CXL_DEFAULT_BANDWIDTH,
    check_numa,
    format_cpulist,
    parse_cpulist,
    pci_node,
    plan_placement,
    read_topology,
)
from kvstrata.store import build
from kvstrata.store.kvstore import KVStore

TREES = Path(__file__).parent / "numa_trees"
TWO, CXL, ONE = TREES / "two_socket", TREES / "one_socket_cxl", TREES / "one_node"
GIB = 1 << 30
NODE0_CPUS = tuple(range(32)) + tuple(range(64, 96))
NODE1_CPUS = tuple(range(32, 64)) + tuple(range(96, 128))


def test_cpulists_read_and_write_back():
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpulist("") == frozenset()
    assert format_cpulist({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11"
    assert format_cpulist(parse_cpulist("0-31,64-95")) == "0-31,64-95"


def test_the_two_socket_tree_reads_as_two_nodes():
    topo = read_topology(TWO)
    assert sorted(topo.nodes) == [0, 1] and topo.memory_nodes == [0, 1]
    assert tuple(sorted(topo.nodes[0].cpus)) == NODE0_CPUS
    assert tuple(sorted(topo.nodes[1].cpus)) == NODE1_CPUS
    assert topo.nodes[0].memory_bytes == 527958016 * 1024
    assert topo.nodes[1].free_bytes == 522190848 * 1024
    assert topo.distance(0, 1) == 21 and topo.distance(1, 1) == 10
    assert not any(n.cpuless for n in topo.nodes.values())
    assert pci_node("0000:17:00.0", TWO) == 0
    assert pci_node("0000:CA:00.0", TWO) == 1  # torch may spell the address in capitals
    assert pci_node("0000:00:01.0", TWO) is None  # no such device


def test_with_a_gpu_the_arena_goes_to_its_socket_and_the_thread_with_it():
    topo = read_topology(TWO)
    for bdf, node, cpus in (("0000:17:00.0", 0, NODE0_CPUS), ("0000:ca:00.0", 1, NODE1_CPUS)):
        plan = plan_placement(topo, "auto", gpu_node=pci_node(bdf, TWO))
        assert (plan.nodes, plan.policy, plan.cpus) == ((node,), "preferred", cpus)
        assert plan.applies and plan.gpu_node == node and plan.cxl_node is None
        assert f"PCIe root is on node {node}" in plan.notice


def test_a_gpu_beside_cpus_the_process_may_not_use():
    # GPU on node 0, the process confined (cgroup cpuset) to eight CPUs of node 1: the
    # arena stays by the GPU (its copies), the thread goes where it may run.
    plan = plan_placement(read_topology(TWO), allowed_cpus=set(range(32, 40)), gpu_node=0)
    assert plan.nodes == (0,) and plan.cpus == tuple(range(32, 40))
    assert "may not use" in plan.notice


def test_cpu_only_the_arena_follows_the_readers():
    topo = read_topology(TWO)
    spread = plan_placement(topo, "auto")  # readers on both sockets: interleaved
    assert (spread.nodes, spread.policy, spread.cpus) == ((0, 1), "interleave", ())
    one = plan_placement(topo, "auto", allowed_cpus=set(range(40, 48)))  # all on node 1
    assert (one.nodes, one.policy, one.cpus) == ((1,), "preferred", ())


def test_an_explicit_node_wins():
    plan = plan_placement(read_topology(TWO), 1, gpu_node=0)
    assert (plan.nodes, plan.policy, plan.cpus) == ((1,), "preferred", NODE1_CPUS)
    with pytest.raises(
        ConfigError, match=r"^numa=5 is invalid: the NUMA nodes with memory are 0, 1$"
    ):
        plan_placement(read_topology(TWO), 5)
    off = plan_placement(read_topology(TWO), "off", gpu_node=0)
    assert not off.applies and off.notice == "NUMA placement off (numa='off')"


def test_a_cpuless_node_is_a_tier_below_local_ram():
    topo = read_topology(CXL)
    cxl = topo.nodes[1]
    assert cxl.cpuless and cxl.memory_bytes == 128 * GIB and not topo.nodes[0].cpuless
    assert cxl.read_bandwidth == 30000e6 and cxl.read_latency_ns == 271  # HMAT: MB/s, ns
    plan = plan_placement(topo, "auto", gpu_node=pci_node("0000:4a:00.0", CXL))
    assert plan.nodes == (0,) and plan.cpus == tuple(range(64))
    assert (plan.cxl_node, plan.cxl_bytes, plan.cxl_bandwidth) == (1, 128 * GIB, 30e9)
    assert plan.cxl_bandwidth_source == "hmat"
    assert plan.notice.endswith("CPU-less node 1 below it")
    # the host tier on the CXL node itself: threads on the nearest node with CPUs
    on_cxl = plan_placement(topo, 1, gpu_node=0)
    assert (on_cxl.nodes, on_cxl.cpus, on_cxl.cxl_node) == ((1,), tuple(range(64)), None)


def test_without_firmware_figures_the_cxl_bandwidth_is_the_published_one(tmp_path):
    tree = tmp_path / "cxl"
    shutil.copytree(CXL, tree)
    for access in ("access0", "access1"):
        shutil.rmtree(tree / "devices/system/node/node1" / access)
    plan = plan_placement(read_topology(tree), "auto")
    assert plan.cxl_bandwidth == CXL_DEFAULT_BANDWIDTH and plan.cxl_bandwidth_source == "published"


def test_one_node_is_a_no_op_that_says_so():
    for root in (ONE, TREES / "no_such_tree"):  # no node tree at all: one node
        for mode in ("auto", 0):
            plan = plan_placement(read_topology(root), mode, gpu_node=0)
            assert not plan.applies and plan.nodes == () and plan.cpus == ()
            assert plan.notice == "one NUMA node here (node0): placement is a no-op"
    assert pci_node("0000:00:04.0", ONE) is None  # numa_node -1: none given


def test_numa_values_are_checked_in_one_line():
    two = read_topology(TWO)
    assert check_numa("auto", two) == "auto" and check_numa(" OFF ", two) == "off"
    assert check_numa("1", two) == 1 and check_numa(1, read_topology(CXL)) == 1
    for bad in ("bogus", -1, True, 1.0, None, "1.5"):
        with pytest.raises(ConfigError) as err:
            check_numa(bad, two)
        assert str(err.value).startswith(f"numa={bad!r} is invalid: 'auto', 'off', or a NUMA")
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"^numa=2 is invalid: .*nodes with memory: 0, 1;"):
        check_numa(2, two)


def test_the_config_field_checks_against_this_machine():
    here = read_topology()
    assert CacheConfig().numa == "auto" and CacheConfig(numa="Off").numa == "off"
    assert CacheConfig(numa=str(here.memory_nodes[0])).numa == here.memory_nodes[0]
    absent = max(here.nodes) + 1
    with pytest.raises(ConfigError, match=rf"^numa={absent} is invalid: this machine has"):
        CacheConfig(numa=absent)
    with pytest.raises(ConfigError, match=r"^numa='near' is invalid: "):
        CacheConfig.from_dict({"numa": "near"})


# -- applying a plan: real system calls on this machine ------------------------------------
def _mapping(nbytes: int = 4 << 20) -> tuple[mmap.mmap, int]:
    import ctypes

    region = mmap.mmap(-1, nbytes)
    return region, ctypes.addressof(ctypes.c_char.from_buffer(region))


def _mbind_or_skip(address: int, nbytes: int, nodes: tuple[int, ...], policy: str) -> None:
    try:
        numa_bind.bind_region(address, nbytes, nodes, policy)
    except OSError as err:
        if err.errno in (errno.ENOSYS, errno.EPERM):  # a sandbox without mbind
            pytest.skip(f"mbind refused here: {err}")
        raise


@pytest.mark.skipif(numa_bind._syscall_numbers() is None, reason="mbind is Linux's")
def test_mbind_binds_a_fresh_mapping_to_node_0():
    region, address = _mapping()
    _mbind_or_skip(address, len(region), (0,), "preferred")
    assert numa_bind.region_policy(address) == (numa_bind.MPOL_PREFERRED, [0])
    region[:] = b"\x01" * len(region)  # touched: its pages come from node 0
    assert numa_bind.page_node(address) == 0
    assert numa_bind.page_node(address + len(region) - 1) == 0
    other, address2 = _mapping()
    _mbind_or_skip(address2, len(other), (0,), "interleave")
    assert numa_bind.region_policy(address2) == (numa_bind.MPOL_INTERLEAVE, [0])
    with pytest.raises(OSError) as err:  # a node this machine does not have
        numa_bind.bind_region(address2, len(other), (max(read_topology().nodes) + 1,), "bind")
    assert err.value.errno == errno.EINVAL
    region.close()
    other.close()


def test_pinning_sets_the_calling_threads_mask_only():
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no affinity calls here")
    before = os.sched_getaffinity(0)
    cpu = min(before)
    seen = {}

    def worker() -> None:
        seen["pinned"] = numa_bind.pin_thread((cpu,))
        seen["mask"] = os.sched_getaffinity(0)
        inner = threading.Thread(target=lambda: seen.update(child=os.sched_getaffinity(0)))
        inner.start()
        inner.join()

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == {"pinned": True, "mask": {cpu}, "child": {cpu}}  # inherited by its threads
    assert os.sched_getaffinity(0) == before  # the test's own thread is untouched
    assert numa_bind.pin_thread(()) is False


# -- a store on this machine, and on the recorded 2-socket machine ------------------------
def _geometry() -> KVGeometry:
    return KVGeometry(
        model_type="toy", num_layers=2, num_heads=2, num_kv_heads=2, head_dim=64, v_head_dim=64,
        dtype="fp32",
    )  # fmt: skip


def _built(**fields) -> KVStore:
    cfg = CacheConfig(block_size=16, max_tokens=256, device="cpu", host_budget="16MiB", **fields)
    store = KVStore(_geometry(), cfg)
    store.build(torch.float32)
    return store


def test_on_this_machine_the_store_says_what_it_did():
    store = _built()
    numa = store.stats()["numa"]
    if len(read_topology().memory_nodes) == 1:
        assert numa["applies"] is False and numa["nodes"] == [] and numa["cpus"] == ""
        assert numa["notice"] == "one NUMA node here (node0): placement is a no-op"
    store.close()
    off = _built(numa="off")
    assert off.stats()["numa"]["notice"] == "NUMA placement off (numa='off')"
    off.close()


@pytest.mark.skipif(numa_bind._syscall_numbers() is None, reason="mbind is Linux's")
def test_a_store_on_the_recorded_two_socket_machine_binds_its_host_arena(monkeypatch):
    # The decision from the recorded topology, applied for real: this process's CPUs
    # are node 0's there, so the host arena is bound to node 0 (which exists here too).
    monkeypatch.setattr(build, "read_topology", lambda: read_topology(TWO))
    store = _built()
    numa = store.stats()["numa"]
    assert (numa["nodes"], numa["policy"], numa["cpus"]) == ([0], "preferred", "")
    host = store.manager.state.tiers["host"]
    assert host.numa == ((0,), "preferred")
    address = host.arenas["k.data"].data_ptr()
    try:
        mode, nodes = numa_bind.region_policy(address)
    except OSError as err:
        pytest.skip(f"get_mempolicy refused here: {err}")
    if mode == 0:  # MPOL_DEFAULT: the kernel refused mbind (warned), first touch instead
        pytest.skip("mbind refused here")
    assert (mode, nodes) == (numa_bind.MPOL_PREFERRED, [0])
    store.close()


def test_placing_pins_the_building_thread_and_caps_its_torch_threads(monkeypatch):
    # numa=0 on the recorded 2-socket machine: the thread that builds the store is
    # pinned to node 0's CPUs that this process may use, its torch threads cut to them.
    monkeypatch.setattr(build, "read_topology", lambda: read_topology(TWO))
    allowed = os.sched_getaffinity(0)
    seen = {}

    def worker() -> None:
        torch.set_num_threads(len(allowed) + 3)
        plan = build.place_numa(0, torch.device("cpu"))
        seen.update(plan=plan, mask=os.sched_getaffinity(0), threads=torch.get_num_threads())

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    mine = tuple(sorted(set(NODE0_CPUS) & allowed))
    assert seen["plan"].nodes == (0,) and seen["plan"].cpus == mine
    assert seen["mask"] == set(mine) and seen["threads"] == len(mine)
    assert build.place_numa("auto", torch.device("cpu"), host_arenas=False).notice == (
        "no host arena to place"
    )


def test_the_numa_flag_is_checked_in_one_line():
    import argparse

    from kvstrata.cli._cache_flags import add_placement_flags, cache_fields

    parser = argparse.ArgumentParser()
    add_placement_flags(parser)
    assert cache_fields(parser.parse_args(["--numa", "off"]))["numa"] == "off"
    assert "numa" not in cache_fields(parser.parse_args([]))
    with pytest.raises(ConfigError, match=r"^numa='socket' is invalid: 'auto', 'off', or a"):
        cache_fields(parser.parse_args(["--numa", "socket"]))


# -- the "cxl" tier: a CPU-less node's memory below the host tier -------------------------
def test_cxl_budget_is_checked_in_one_line():
    base = {"host_budget": "16MiB"}
    assert CacheConfig(**base).cxl_budget == 0
    cases = [
        ({"cxl_budget": "lots", **base}, r"^cxl_budget='lots' is invalid: a byte size"),
        ({"cxl_budget": "8MiB"}, r"^cxl_budget='8MiB' is invalid: .*set host_budget too$"),
        ({"cxl_budget": "8MiB", "numa": "off", **base}, r"^cxl_budget='8MiB' .*numa='off'"),
    ]
    if not any(n.cpuless for n in read_topology().nodes.values()):
        cases.append(({"cxl_budget": "8MiB", **base}, r"no CPU-less NUMA node \(CXL memory\)"))
    for fields, message in cases:
        with pytest.raises(ConfigError, match=message) as err:
            CacheConfig(**fields)
        assert "\n" not in str(err.value)


def test_a_store_on_the_recorded_cxl_machine_has_a_cxl_tier(monkeypatch):
    # The recorded 1-socket + CXL topology decides: host arena on node 0 (this
    # process's CPUs are node 0's there), the cxl tier on CPU-less node 1, below it.
    # Node 1 does not exist here, so its mbind is refused (one warning) and first touch
    # places those pages: the tier works as memory all the same, end to end.
    from kvstrata.config import CacheConfig as Config
    from kvstrata.platform import host_memory

    cxl_tree = lambda: read_topology(CXL)  # noqa: E731
    monkeypatch.setattr("kvstrata.config.read_topology", cxl_tree)
    monkeypatch.setattr(build, "read_topology", cxl_tree)
    monkeypatch.setattr(host_memory, "_REFUSED", [])
    with pytest.raises(ConfigError, match=r"^cxl_budget='1TiB' is invalid: larger than the 128"):
        Config(host_budget="16MiB", cxl_budget="1TiB")
    cfg = Config(
        block_size=16, max_tokens=512, device="cpu", device_budget="256KiB",
        host_budget="256KiB", cxl_budget="16MiB", disk_codec="none",
    )  # fmt: skip
    store = KVStore(_geometry(), cfg)
    with pytest.warns(RuntimeWarning, match=r"not bound to NUMA node\(s\) \[1\]"):
        store.build(torch.float32)
    tiers = store.manager.state.tiers
    assert store.manager.state.tier_order == ["device", "host", "cxl"]
    assert tiers["host"].numa == ((0,), "preferred")
    assert tiers["cxl"].numa == ((1,), "preferred")
    numa = store.stats()["numa"]
    assert (numa["nodes"], numa["cxl_node"], numa["cxl_bandwidth"]) == ([0], 1, 30e9)
    # a sequence longer than the device and host budgets, a block per step: its
    # oldest blocks move down to cxl, and read back as written
    lay, seq = store.layout, store.add_sequence(None)[0]
    k = torch.randn(_geometry().num_layers, lay.num_kv_heads, 512, lay.head_dim)
    for start in range(0, 512, 16):
        plans = [write_plan(store.runtime, w, 1) for w in store.extend([seq], 16)]
        for group in store.groups:
            for local, layer in enumerate(group.layers):
                chunk = k[layer, :, start : start + 16]
                write_layer(plans[group.index], local, chunk[None], -chunk[None])
        store.step_done([seq])
    used = {t: o["used_blocks"] for t, o in store.stats()["tiers"].items()}
    assert used["cxl"] > 0 and sum(used.values()) == 512 // 16 * len(store.groups)
    for group in store.groups:
        for local, layer in enumerate(group.layers):
            got_k, got_v = read_sequence(store.manager, (seq, group.index), local)
            assert torch.equal(got_k, k[layer]) and torch.equal(got_v, -k[layer])
    store.close()


def test_generate_stats_print_the_numa_line(capsys):
    from kvstrata.cli.generate import render_stats

    store = _built()
    render_stats(store.stats())
    store.close()
    out = capsys.readouterr().out
    assert "NUMA: " in out
    if len(read_topology().memory_nodes) == 1:
        assert "NUMA: one NUMA node here (node0): placement is a no-op" in out


def test_a_node_asked_for_on_one_node_is_logged_as_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(build, "read_topology", lambda: read_topology(ONE))
    monkeypatch.setattr(build, "_NOTICES", set())
    with caplog.at_level("INFO", logger="kvstrata.store.build"):
        build.place_numa("auto", torch.device("cpu"))
        build.place_numa(0, torch.device("cpu"))
        build.place_numa(0, torch.device("cpu"))  # once per process
    noop = "NUMA: one NUMA node here (node0): placement is a no-op"
    got = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert got == [("INFO", noop), ("WARNING", noop)]


@pytest.mark.skipif(numa_bind._syscall_numbers() is None, reason="mbind is Linux's")
def test_a_pinned_arena_is_bound_before_cuda_registers_it(monkeypatch):
    # cudaHostRegister faults every page in: the binding must already be there. A
    # stand-in for torch.cuda.cudart() records the policy it finds, and touches the
    # pages as the real call does.
    import ctypes

    from kvstrata.platform import host_memory

    seen = {}

    class Cudart:
        def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
            seen["policy"] = numa_bind.region_policy(ptr)
            ctypes.memset(ptr, 0, nbytes)  # faulted in, as registration does
            seen["node"] = numa_bind.page_node(ptr)
            return 0

        def cudaHostUnregister(self, ptr: int) -> int:
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    arena = host_memory.pinned_empty((1 << 20,), torch.uint8, ((0,), "preferred"))
    if seen["policy"][0] == 0:
        pytest.skip("mbind refused here")
    assert seen == {"policy": (numa_bind.MPOL_PREFERRED, [0]), "node": 0}
    assert arena.numel() == 1 << 20
