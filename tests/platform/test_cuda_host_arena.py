"""The host arena with CUDA: pinned once at construction with cudaHostRegister (exactly
its size, unregistered before it is freed), and a clean fallback to pageable memory
when CUDA refuses to lock it — with a stand-in for torch.cuda.cudart() here."""

from __future__ import annotations

import gc

import pytest
import torch

from kvstrata.codecs.registry import get_codec
from kvstrata.core.layout import BlockLayout
from kvstrata.platform import host_memory
from kvstrata.tiers.memory import HostTier, MemoryTier

LAYOUT = BlockLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)


class FakeCudart:
    """torch.cuda.cudart()'s host-registration calls; registration number `fail_at`
    (and later ones) fail with an error code, as CUDA does when it cannot lock."""

    def __init__(self, log: list, fail_at: int | None = None) -> None:
        self.log = log
        self.fail_at = fail_at
        self.registered: dict[int, int] = {}  # pointer -> bytes, still registered

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        assert flags == 0 and nbytes > 0
        self.log.append(("register", ptr))
        if self.fail_at is not None and len(self.log_of("register")) >= self.fail_at:
            return 2  # cudaErrorMemoryAllocation
        self.registered[ptr] = nbytes
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.log.append(("unregister", ptr))
        del self.registered[ptr]
        return 0

    def cudaGetErrorString(self, err: int) -> str:
        return "out of memory"

    def cudaGetLastError(self) -> int:
        self.log.append(("drain", None))
        return 0

    def log_of(self, what: str) -> list:
        return [p for w, p in self.log if w == what]


@pytest.fixture
def cudart(monkeypatch):
    log: list = []
    fake = FakeCudart(log)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: log.append(("sync", None)))
    return fake


def _round_trip(tier: MemoryTier) -> None:
    k = torch.randn(LAYOUT.raw_shape("k", 2))
    v = torch.randn(LAYOUT.raw_shape("v", 2))
    tier.write_blocks([2, 0], k, v)
    ko, vo = torch.empty_like(k), torch.empty_like(v)
    tier.read_blocks([2, 0], ko, vo)
    torch.testing.assert_close(ko, k, atol=0.05, rtol=0.05)  # int8
    torch.testing.assert_close(vo, v, atol=0.05, rtol=0.05)


def test_arenas_are_registered_at_their_exact_size_and_unregistered_when_freed(cudart):
    tier = MemoryTier("host", LAYOUT, 3, get_codec("int8"), pin_memory=True)
    assert tier.pinned is True
    arenas = tier.arenas
    # one registration per arena, of exactly its bytes (3 slots: no power of two)
    assert cudart.registered == {
        t.data_ptr(): t.numel() * t.element_size() for t in arenas.values()
    }
    assert sum(cudart.registered.values()) == 3 * tier.block_bytes
    _round_trip(tier)
    view = arenas["k.data"][1, :, 4:8]  # a view keeps its arena's memory registered
    kept = arenas["k.data"].data_ptr()
    del tier, arenas
    gc.collect()
    assert list(cudart.registered) == [kept]
    # every unregistration comes right after a device synchronisation
    log = cudart.log
    for i, (what, _) in enumerate(log):
        if what == "unregister":
            assert log[i - 1][0] == "sync"
    del view
    gc.collect()
    assert cudart.registered == {}


def test_refused_pinning_falls_back_to_pageable_arenas(cudart):
    cudart.fail_at = 2  # the first arena is locked, the second is refused
    with pytest.warns(
        RuntimeWarning, match=r"host tier: could not pin .* \(cudaHostRegister: out of memory\)"
    ):
        tier = MemoryTier("host", LAYOUT, 4, get_codec("int8"), pin_memory=True)
    gc.collect()
    assert tier.pinned is False and not any(t.is_pinned() for t in tier.arenas.values())
    assert cudart.registered == {}  # the arena locked before the refusal was released
    assert ("drain", None) in cudart.log  # the failed call's pending CUDA error consumed
    _round_trip(tier)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_pinning_without_a_cuda_runtime_falls_back():
    with pytest.warns(RuntimeWarning, match=r"could not pin .* \(no CUDA runtime: "):
        tier = MemoryTier("host", LAYOUT, 4, pin_memory=True)
    assert tier.pinned is False


def test_pinned_empty_shapes_and_dtypes(cudart):
    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.uint8):
        t = host_memory.pinned_empty((2, 3, 5), dtype)
        assert t.shape == (2, 3, 5) and t.dtype == dtype and t.is_contiguous()
        assert cudart.registered[t.data_ptr()] == 30 * t.element_size()
    assert host_memory.pinned_empty((0, 4), torch.float16).numel() == 0  # nothing to register


def test_other_allocation_errors_are_not_swallowed(monkeypatch):
    def empty(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(torch, "empty", empty)
    with pytest.raises(RuntimeError, match="boom"):
        MemoryTier("host", LAYOUT, 4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_host_tier_is_pageable_without_cuda():
    tier = HostTier(LAYOUT, 4)
    assert tier.pinned is False
