"""The planner's CXL tier: a CPU-less NUMA node's memory between host RAM and disk, with
its own bandwidth bound (`make_hardware(cxl_memory=...)`, `kvstrata plan --cxl-memory`),
`auto` read from a recorded one-socket + CXL sysfs tree, and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvstrata.cli import main
from kvstrata.cli import plan as plan_cli
from kvstrata.platform.hardware import CXL_LINK, GIB, make_hardware
from kvstrata.platform.numa import cxl_memory, read_topology
from kvstrata.workload.memory_plan import HOST_USABLE_FRACTION, Workload, plan
from kvstrata.workload.zoo import load_geometry

LLAMA2 = load_geometry("llama-2-7b")
TREES = Path(__file__).parents[1] / "platform" / "numa_trees"
WORK = Workload(context_tokens=32 * 1024, concurrency=8)  # 128 GiB of KV (fp16)


def test_cold_kv_fills_host_then_cxl_then_disk():
    hw = make_hardware(host_memory=40 * GIB, cxl_memory=64 * GIB, disk_link="nvme-gen4")
    p = plan(LLAMA2, hw, WORK)
    t, b = p.tiers, p.bounds
    assert t.host_bytes == int(40 * GIB * HOST_USABLE_FRACTION)
    assert t.cxl_capacity == int(64 * GIB * HOST_USABLE_FRACTION) == t.cxl_bytes  # full
    cold = 128 * GIB - t.device_bytes
    assert t.host_bytes + t.cxl_bytes + t.disk_bytes == cold and t.unplaced_bytes == 0
    assert b.cxl_link_s == t.cxl_bytes / CXL_LINK.bandwidth
    assert b.host_link_s == cold / hw.link.bandwidth  # every cold byte still crosses PCIe
    assert b.tiered_s == max(b.hbm_s, b.host_link_s, b.disk_link_s, b.cxl_link_s)
    json.dumps(p.to_dict())


def test_cxl_takes_what_disk_would_and_nothing_is_left_over():
    without = plan(LLAMA2, make_hardware(host_memory=40 * GIB), WORK)
    assert without.tiers.cxl_bytes == 0 and without.bounds.cxl_link_s == 0.0
    assert without.tiers.unplaced_bytes > 0 and not without.feasible
    hw = make_hardware(host_memory=40 * GIB, cxl_memory=512 * GIB, cxl_bandwidth=60e9)
    with_cxl = plan(LLAMA2, hw, WORK)
    assert with_cxl.tiers.unplaced_bytes == 0 and with_cxl.feasible
    assert with_cxl.tiers.cxl_bytes == without.tiers.unplaced_bytes
    assert with_cxl.hardware.cxl.bandwidth == 60e9


def test_the_recorded_cxl_node_is_read_as_a_tier():
    assert cxl_memory(read_topology(TREES / "one_socket_cxl")) == (128 * GIB, 30e9)
    assert cxl_memory(read_topology(TREES / "two_socket")) is None
    assert cxl_memory(read_topology(TREES / "one_node")) is None


def test_plan_cxl_auto_on_the_recorded_machine(monkeypatch, capsys):
    monkeypatch.setattr(plan_cli, "read_topology", lambda: read_topology(TREES / "one_socket_cxl"))
    argv = ["plan", "--model", "llama-2-7b", "--context", "32k", "--concurrency", "8",
            "--host-memory", "40GiB", "--cxl-memory", "auto"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "cxl (CPU-less node, 30 GB/s)" in out
    assert "colder blocks (of 102.40 GiB usable)" in out
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["hardware"]["cxl_memory"] == 128 * GIB
    assert data["hardware"]["cxl"]["bandwidth"] == 30e9
    assert data["tiers"]["cxl_bytes"] > 0 and data["bounds"]["cxl_link_s"] > 0


@pytest.mark.parametrize(
    ("args", "start"),
    [
        (["--cxl-memory", "lots"], "cxl_memory='lots' is invalid: "),
        (["--cxl-memory", "0"], "cxl_memory='0' is invalid: "),
        (["--cxl-memory", "1TB", "--cxl-bandwidth", "-3"], "cxl_bandwidth='-3' is invalid: "),
        (["--cxl-bandwidth", "30GB/s"], "cxl_bandwidth='30GB/s' is invalid: set --cxl-memory"),
        (["--cxl-memory", "auto"], "cxl_memory='auto' is invalid: no CPU-less NUMA node here"),
    ],
)
def test_bad_cxl_flags_exit_2_with_one_line(monkeypatch, capsys, args, start):
    monkeypatch.setattr(plan_cli, "read_topology", lambda: read_topology(TREES / "one_node"))
    assert main(["plan", "--model", "llama-2-7b", *args]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == "" and len(lines) == 1
    assert lines[0].startswith(f"kvstrata plan: error: {start}")
