"""CPU arenas on transparent huge pages (platform/host_memory.huge_empty): 2 MiB-aligned
private memory advised MADV_HUGEPAGE — what the memory tiers, the disk staging buffers
and the selection summaries allocate on the CPU — that works as any tensor, lives as
long as its last view, and is plain `torch.empty` where it cannot apply."""

from __future__ import annotations

import gc
import mmap
import os
import sys
import weakref

import pytest
import torch

from kvstrata.core.layout import BlockLayout
from kvstrata.platform import host_memory
from kvstrata.platform.host_memory import HUGE_MIN_BYTES, HUGE_PAGE, cpu_empty, huge_empty
from kvstrata.tiers.memory import HostTier

# a kernel built without THP refuses the advice (huge_empty then gives ordinary pages)
LINUX_THP = (
    sys.platform.startswith("linux")
    and hasattr(mmap, "MADV_HUGEPAGE")
    and os.path.isdir("/sys/kernel/mm/transparent_hugepage")
)


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not LINUX_THP, reason="MADV_HUGEPAGE is Linux's")
def test_a_large_arena_is_aligned_private_memory_advised_for_huge_pages():
    t = huge_empty((3, HUGE_MIN_BYTES // 4 // 3 + 5), torch.float32)
    assert t.shape == (3, HUGE_MIN_BYTES // 4 // 3 + 5) and t.dtype == torch.float32
    assert t.is_contiguous() and t.device.type == "cpu"
    assert t.data_ptr() % HUGE_PAGE == 0
    flags = _vm_flags(t.data_ptr())
    assert "hg" in flags  # MADV_HUGEPAGE
    assert "sh" not in flags  # private: THP's "madvise" setting does not cover shmem
    # the whole tensor is usable memory, end to end
    t.fill_(1.5)
    t[-1, -1] = 7.0
    assert float(t.sum()) == pytest.approx(1.5 * (t.numel() - 1) + 7.0)


@pytest.mark.skipif(not LINUX_THP, reason="MADV_HUGEPAGE is Linux's")
def test_the_mapping_lives_as_long_as_its_last_view():
    t = huge_empty((HUGE_MIN_BYTES // 2,), torch.float16)
    t.fill_(2.0)
    view = t[100:200]
    owner = weakref.ref(t)
    del t
    gc.collect()
    assert owner() is None
    assert float(view.sum()) == 200.0  # still mapped: the view keeps the buffer alive


def test_small_or_unsupported_arenas_are_torch_empty(monkeypatch):
    def no_mapping(*args, **kwargs):
        raise AssertionError("huge_empty mapped memory of its own")

    small = huge_empty((16, 16), torch.float32)  # below HUGE_MIN_BYTES
    assert small.shape == (16, 16)
    monkeypatch.setattr(host_memory.mmap, "mmap", no_mapping)
    assert huge_empty((16, 16), torch.float32).shape == (16, 16)
    monkeypatch.delattr(host_memory.mmap, "MADV_HUGEPAGE", raising=False)
    plain = huge_empty((HUGE_MIN_BYTES // 4,), torch.float32)  # no such advice here
    assert plain.numel() == HUGE_MIN_BYTES // 4 and plain.dtype == torch.float32


def test_cpu_empty_takes_huge_pages_on_the_cpu_only(monkeypatch):
    calls = []
    monkeypatch.setattr(
        host_memory, "huge_empty", lambda s, d, numa: calls.append((s, numa)) or torch.empty(s)
    )
    assert cpu_empty((4, 4), torch.float32, "cpu").shape == (4, 4)
    assert cpu_empty((4, 4), torch.float32, "cpu", ((0,), "preferred")).shape == (4, 4)
    assert calls == [((4, 4), None), ((4, 4), ((0,), "preferred"))]  # the NUMA binding too
    meta = cpu_empty((4, 4), torch.float32, "meta")
    assert meta.device.type == "meta" and len(calls) == 2


@pytest.mark.skipif(not LINUX_THP, reason="MADV_HUGEPAGE is Linux's")
def test_a_host_tier_keeps_its_blocks_in_advised_arenas():
    layout = BlockLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=64)
    slots = HUGE_MIN_BYTES // (2 * 2 * 64 * 64 * 4) + 1  # each arena past the threshold
    tier = HostTier(layout, slots)
    for arena in (tier.k_arena, tier.v_arena):
        assert arena.data_ptr() % HUGE_PAGE == 0 and "hg" in _vm_flags(arena.data_ptr())
    g = torch.Generator().manual_seed(0)
    k = torch.randn(layout.raw_shape("k", 3), generator=g)
    v = torch.randn(layout.raw_shape("v", 3), generator=g)
    tier.write_blocks([0, 5, slots - 1], k, v)
    k_out, v_out = torch.empty_like(k), torch.empty_like(v)
    tier.read_blocks([0, 5, slots - 1], k_out, v_out)
    assert torch.equal(k_out, k) and torch.equal(v_out, v)


def test_a_refused_mapping_falls_back_to_torch_empty(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(host_memory.mmap, "mmap", refuse)
    t = huge_empty((HUGE_MIN_BYTES // 4,), torch.float32)
    assert t.numel() == HUGE_MIN_BYTES // 4
    t.fill_(3.0)
    assert float(t[-1]) == 3.0
