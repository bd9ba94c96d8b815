"""The host arena with CUDA: pinned once at construction, and a clean fallback to
pageable memory when the OS refuses to lock it (simulated here)."""

from __future__ import annotations

import pytest
import torch

from kvstrata.codecs.registry import get_codec
from kvstrata.layout import BlockLayout
from kvstrata.tiers.memory import HostTier, MemoryTier

LAYOUT = BlockLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)


def test_refused_pinning_falls_back_to_pageable_arenas(monkeypatch):
    real_empty = torch.empty

    def empty(*args, pin_memory=False, **kwargs):
        if pin_memory:
            raise RuntimeError("CUDA error: out of memory\nmore details")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    with pytest.warns(RuntimeWarning, match=r"host tier: could not pin .* out of memory\)"):
        tier = MemoryTier("host", LAYOUT, 4, get_codec("int8"), pin_memory=True)
    monkeypatch.undo()
    assert tier.pinned is False and not any(t.is_pinned() for t in tier.arenas.values())
    k = torch.randn(LAYOUT.raw_shape("k", 2))
    v = torch.randn(LAYOUT.raw_shape("v", 2))
    tier.write_blocks([3, 1], k, v)
    ko, vo = torch.empty_like(k), torch.empty_like(v)
    tier.read_blocks([3, 1], ko, vo)
    torch.testing.assert_close(ko, k, atol=0.05, rtol=0.05)  # int8


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
