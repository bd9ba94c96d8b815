"""MemoryPressureReader over recorded /proc and /sys trees: cgroup v1 and v2 limits
(the tightest ancestor's), droppable page cache left out, MemAvailable and PSI; and
the one-line errors of the options that use it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstrata import CacheConfig, ConfigError
from kvstrata.platform.memory_pressure import MemoryPressureReader

MIB = 1 << 20
MEMINFO = "MemTotal:       16384000 kB\nMemFree:  100 kB\nMemAvailable:    8192000 kB\n"
PSI = "some avg10=1.50 avg60=0.10 avg300=0.00 total=1\nfull avg10=0.25 avg60=0.00 avg300=0.00 total=0\n"  # noqa: E501


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_cgroup_v1_reads_the_hierarchical_limit_without_inactive_cache(tmp_path):
    cg = "sys/fs/cgroup/memory/jobs/server"
    root = _tree(
        tmp_path,
        {
            "proc/self/cgroup": "9:name=systemd:/\n4:memory:/jobs/server\n0::/\n",
            "proc/meminfo": MEMINFO,
            "proc/pressure/memory": PSI,
            f"{cg}/memory.usage_in_bytes": str(700 * MIB),
            f"{cg}/memory.limit_in_bytes": str(9223372036854771712),  # its own: none
            f"{cg}/memory.stat": f"cache 1\nhierarchical_memory_limit {1024 * MIB}\n"
            f"total_inactive_file {100 * MIB}\n",
        },
    )
    r = MemoryPressureReader(root)
    assert r.source == "cgroup1"
    m = r.read()
    assert (m.source, m.limit_bytes, m.used_bytes) == ("cgroup1", 1024 * MIB, 600 * MIB)
    assert m.available_bytes == 424 * MIB
    assert (m.psi_some_avg10, m.psi_full_avg10) == (1.5, 0.25)


def test_cgroup_v2_takes_the_smallest_max_on_the_way_up(tmp_path):
    base = "sys/fs/cgroup"
    root = _tree(
        tmp_path,
        {
            "proc/self/cgroup": "0::/a/b\n",
            "proc/meminfo": MEMINFO,
            f"{base}/cgroup.controllers": "cpu memory\n",
            f"{base}/a/memory.max": str(512 * MIB),
            f"{base}/a/b/memory.max": "max\n",
            f"{base}/a/b/memory.current": str(300 * MIB),
            f"{base}/a/b/memory.stat": f"anon 1\ninactive_file {50 * MIB}\n",
            f"{base}/a/b/memory.pressure": PSI.replace("0.25", "12.00"),
        },
    )
    m = MemoryPressureReader(root).read()
    assert (m.source, m.limit_bytes, m.used_bytes) == ("cgroup2", 512 * MIB, 250 * MIB)
    assert m.available_bytes == 262 * MIB and m.psi_full_avg10 == 12.0


def test_the_machine_limits_a_roomy_cgroup(tmp_path):
    cg = "sys/fs/cgroup/memory"  # a cgroup namespace: "/" is the mount itself
    root = _tree(
        tmp_path,
        {
            "proc/self/cgroup": "4:memory:/\n",
            "proc/meminfo": MEMINFO.replace("8192000", "102400"),  # 100 MiB available
            f"{cg}/memory.usage_in_bytes": str(100 * MIB),
            f"{cg}/memory.stat": f"hierarchical_memory_limit {4096 * MIB}\n",
        },
    )
    m = MemoryPressureReader(root).read()
    assert m.source == "cgroup1" and m.available_bytes == 100 * MIB


def test_no_cgroup_limit_reads_meminfo(tmp_path):
    cg = "sys/fs/cgroup/memory/x"
    root = _tree(
        tmp_path,
        {
            "proc/self/cgroup": "4:memory:/x\n",
            "proc/meminfo": MEMINFO,
            f"{cg}/memory.usage_in_bytes": "1",
            f"{cg}/memory.limit_in_bytes": "9223372036854771712",
        },
    )
    m = MemoryPressureReader(root).read()
    assert m.source == "meminfo" and m.psi_some_avg10 is None
    assert (m.limit_bytes, m.available_bytes) == (16384000 * 1024, 8192000 * 1024)
    assert MemoryPressureReader(tmp_path / "nothing").read() is None


def test_this_machine_can_be_read():
    m = MemoryPressureReader().read()
    assert m is not None and 0 <= m.available_bytes <= m.limit_bytes


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"host_pressure": "on"}, "host_pressure='on' is invalid: one of off, auto"),
        ({"host_pressure": True}, "host_pressure=True is invalid: one of off, auto"),
        ({"host_pressure": "auto"}, "set host_budget and disk_dir"),
        ({"host_pressure": "auto", "host_budget": "1MiB"}, "set host_budget and disk_dir"),
        ({"host_headroom": 0}, "host_headroom=0 is invalid"),
        ({"host_headroom": "lots"}, "host_headroom='lots' is invalid"),
        ({"host_headroom": 0.5}, "not a fraction"),
    ],
)
def test_bad_values_are_one_line_errors(fields, message):
    with pytest.raises(ConfigError) as err:
        CacheConfig(**fields)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_good_values(tmp_path):
    cfg = CacheConfig(
        host_pressure="auto",
        host_headroom="1GiB",
        host_budget="1MiB",
        disk_dir=str(tmp_path),
        disk_budget="1MiB",
    )
    assert (cfg.host_pressure, cfg.host_headroom) == ("auto", 1 << 30)
    assert CacheConfig().host_pressure == "off"
