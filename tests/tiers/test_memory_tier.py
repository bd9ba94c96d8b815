"""Memory tiers and the slot allocator: exact free-list orders, round trips through
every codec with non-consecutive slots, and bit-exact encoded transfers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstrata.blocks.pool import BlockPool
from kvstrata.codecs.registry import get_codec
from kvstrata.core.layout import BlockLayout
from kvstrata.core.slots import slot_runs
from kvstrata.tiers.base import SlotAllocator
from kvstrata.tiers.memory import DeviceTier, HostTier, MemoryTier

# -- slot allocator and block pool: exact orders ---------------------------------------------


def test_slot_allocator_free_list_order() -> None:
    alloc = SlotAllocator(8)
    assert alloc.free_slots() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert alloc.allocate(3) == [0, 1, 2]
    assert alloc.allocate(1) == [3]
    alloc.free([1, 0])  # freed slots go to the back, in the order given
    assert alloc.free_slots() == [4, 5, 6, 7, 1, 0]
    assert alloc.allocate(1) == [4]  # one slot: the front of the free list
    assert alloc.allocate(2) == [0, 1]  # first-fit: the lowest run of 2
    assert alloc.free_slots() == [5, 6, 7]
    assert alloc.allocate(2, after=5) == [6, 7]  # continues a run
    alloc.free([3, 6])
    assert alloc.free_slots() == [5, 3, 6]
    assert alloc.allocate(2, after=4) == [5, 6]
    assert alloc.allocate(2) is None
    assert alloc.allocate(0) == []
    assert alloc.allocate(1, after=2) == [3]
    assert (alloc.num_free, alloc.num_used) == (0, 8)
    alloc.free([2])
    with pytest.raises(AssertionError, match="slot 2 freed twice"):
        alloc.free([2])


def test_slot_allocator_run_search_and_fallbacks() -> None:
    alloc = SlotAllocator(6)
    assert alloc.allocate(6) == [0, 1, 2, 3, 4, 5]
    alloc.free([5, 2, 3])
    # `after=4` can only continue with slot 5: not enough, so first-fit finds 2-3.
    assert alloc.allocate(2, after=4) == [2, 3]
    assert alloc.free_slots() == [5]
    alloc.free([1, 3])
    assert alloc.free_slots() == [5, 1, 3]
    # No run of 2 (1, 3, 5 are apart): the front of the free list.
    assert alloc.allocate(2) == [5, 1]
    assert alloc.free_slots() == [3]


def test_slot_allocator_take() -> None:
    alloc = SlotAllocator(4)
    alloc.take([2, 0])
    assert alloc.free_slots() == [1, 3]
    with pytest.raises(AssertionError, match="slot 2 is already in use"):
        alloc.take([2])


def test_block_pool_recycles_ids_in_free_order() -> None:
    pool = BlockPool()
    assert [pool.new_block("device", s).block_id for s in range(3)] == [0, 1, 2]
    assert pool.decref(1).block_id == 1
    assert pool.decref(0).block_id == 0
    pool.incref(2)
    assert pool.decref(2) is None  # still referenced
    assert pool.free_ids() == [1, 0]
    assert [pool.new_block("host", 0).block_id for _ in range(3)] == [1, 0, 3]
    assert pool.num_live == 4 and pool.free_ids() == []
    assert (pool.blocks[3].tier, pool.blocks[3].ref_count) == ("host", 1)


# -- data round trips ------------------------------------------------------------------------

# codec name -> (layout, max abs error relative to the data's max abs value)
CASES = {
    "none": (BlockLayout(2, 2, 4, 2), 0.0),
    "int8": (BlockLayout(2, 2, 8, 4), 0.01),
    "int4-g32": (BlockLayout(1, 2, 32, 32), 0.15),
    "int4": (BlockLayout(1, 1, 64, 64), 0.15),
}


def _tier(cls, layout: BlockLayout, num_slots: int, codec: str) -> MemoryTier:
    if cls is DeviceTier:
        return DeviceTier(layout, num_slots, get_codec(codec), device="cpu")
    return HostTier(layout, num_slots, get_codec(codec))


def _blocks(layout: BlockLayout, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(layout.raw_shape("k", n), generator=gen, dtype=layout.dtype)
    v = torch.randn(layout.raw_shape("v", n), generator=gen, dtype=layout.dtype)
    return k, v


def _read(tier: MemoryTier, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    lay = tier.layout
    k = torch.empty(lay.raw_shape("k", len(slots)), dtype=lay.dtype)
    v = torch.empty(lay.raw_shape("v", len(slots)), dtype=lay.dtype)
    tier.read_blocks(slots, k, v)
    return k, v


def _check_close(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    if rel == 0.0:
        assert torch.equal(got, want)
    else:
        err = (got - want).abs().max().item()
        assert err <= rel * want.abs().max().item(), err


@pytest.mark.parametrize("codec", list(CASES))
@pytest.mark.parametrize("cls", [DeviceTier, HostTier])
def test_write_read_blocks_non_consecutive_slots(cls, codec: str) -> None:
    layout, rel = CASES[codec]
    tier = _tier(cls, layout, 6, codec)
    bs = layout.block_size
    assert tier.block_bytes == get_codec(codec).block_nbytes(layout)
    k, v = _blocks(layout, 3, seed=1)
    slots = [4, 0, 2]
    tier.write_blocks(slots, k, v)
    assert (tier.stats.blocks_written, tier.stats.bytes_written) == (3, 3 * tier.block_bytes)
    got_k, got_v = _read(tier, slots)
    _check_close(got_k, k, rel)
    _check_close(got_v, v, rel)
    # Any subset, any order: block i of the output is block slots[i].
    sub_k, sub_v = _read(tier, [2, 4])
    assert torch.equal(sub_k[:, :, :bs], got_k[:, :, 2 * bs :])
    assert torch.equal(sub_k[:, :, bs:], got_k[:, :, :bs])
    assert torch.equal(sub_v[:, :, bs:], got_v[:, :, :bs])
    # One layer at a time gives the same values as whole blocks.
    for layer in range(layout.num_layers):
        lk = torch.empty_like(got_k[layer])
        lv = torch.empty_like(got_v[layer])
        tier.read_layer(layer, slots, lk, lv)
        assert torch.equal(lk, got_k[layer]) and torch.equal(lv, got_v[layer])
    if rel:
        assert not torch.equal(got_k, k)  # a lossy codec really encoded


@pytest.mark.parametrize("codec", list(CASES))
def test_write_layer_matches_write_blocks(codec: str) -> None:
    layout, _ = CASES[codec]
    by_block = _tier(HostTier, layout, 5, codec)
    by_layer = _tier(HostTier, layout, 5, codec)
    k, v = _blocks(layout, 2, seed=2)
    by_block.write_blocks([3, 1], k, v)
    for layer in range(layout.num_layers):
        by_layer.write_layer(layer, [3, 1], k[layer], v[layer])
    assert by_layer.stats.bytes_written == 2 * by_layer.block_bytes
    for slots in ([3, 1], [1], [1, 3]):
        want = _read(by_block, slots)
        got = _read(by_layer, slots)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("codec", list(CASES))
def test_encoded_transfer_is_bit_exact(codec: str) -> None:
    layout, _ = CASES[codec]
    src = _tier(DeviceTier, layout, 4, codec)
    dst = _tier(HostTier, layout, 7, codec)
    k, v = _blocks(layout, 3, seed=3)
    src.write_blocks([1, 3, 0], k, v)
    enc = src.read_encoded([3, 0])
    assert set(enc) == {f"{kind}.{f}" for kind in "kv" for f in src.field_specs[kind]}
    assert src.stats.bytes_read == 2 * src.block_bytes
    dst.write_encoded([6, 2], enc)
    want, got = _read(src, [3, 0]), _read(dst, [6, 2])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # The stored form itself is identical: the block is never re-quantized.
    again = dst.read_encoded([6, 2])
    assert all(torch.equal(again[key], enc[key]) for key in enc)


def _runs_by_loop(slots: list[int]) -> list[tuple[int, int, int]]:
    runs: list[tuple[int, int, int]] = []
    for i, s in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == s:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, s, 1))
    return runs


def test_slot_runs() -> None:
    assert slot_runs([]) == []
    assert slot_runs([2, 3, 4, 0, 5, 1, 2]) == [(0, 2, 3), (3, 0, 1), (4, 5, 1), (5, 1, 2)]
    assert slot_runs([7, 8, 9]) == [(0, 7, 3)]
    assert slot_runs([4, 4, 5]) == [(0, 4, 1), (1, 4, 2)]  # a repeat starts a new run
    g = torch.Generator().manual_seed(0)
    for n in (1, 5, 511, 512, 3000):  # both sides of the numpy threshold
        for p_break in (0.02, 0.5):
            jumps = torch.randint(0, 50, (n,), generator=g)
            step = torch.where(torch.rand(n, generator=g) < p_break, jumps, torch.ones(n))
            slots = torch.cumsum(step, 0).tolist()
            want = _runs_by_loop(slots)
            assert slot_runs(slots) == want
            assert slot_runs(np.asarray(slots)) == want
            assert all(type(x) is int for run in slot_runs(np.asarray(slots)) for x in run)


def test_zero_copy_views_and_runs() -> None:
    layout = BlockLayout(2, 2, 4, 2)
    tier = DeviceTier(layout, 6, device="cpu")
    assert tier.zero_copy and tier.block_bytes == layout.raw_block_bytes == 256
    k, v = _blocks(layout, 3, seed=4)
    tier.write_blocks([2, 3, 4], k, v)
    kv_k, kv_v = tier.layer_view(1, 2, 3)
    assert kv_k.shape == (2, 6, 4)
    assert kv_k.data_ptr() == tier.k_arena[1, :, 4:].data_ptr()  # a view, not a copy
    assert torch.equal(kv_k, k[1]) and torch.equal(kv_v, v[1])
    host = HostTier(layout, 2)
    assert host.pinned is torch.cuda.is_available()
    assert (host.capacity_bytes, host.used_bytes) == (512, 0)
