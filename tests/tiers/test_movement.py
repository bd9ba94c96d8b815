"""tiers/movement.py's disk writes and read-backs, the ones both stores make: a keyed
write (the vLLM backend's write-through, the store's persist at close) keys a slot only
once its bytes are there; a read-back names the blocks that fail their checksums."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstrata.core.errors import TierFullError
from kvstrata.core.layout import BlockLayout
from kvstrata.tiers.disk import DiskTier
from kvstrata.tiers.memory import HostTier
from kvstrata.tiers.movement import copy_blocks, unreadable_slots, write_keyed

LAYOUT = BlockLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)


def _host(n: int) -> HostTier:
    host = HostTier(LAYOUT, n)
    slots = host.allocate(n)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(LAYOUT.raw_shape("k", n), generator=g).to(LAYOUT.dtype)
    v = torch.randn(LAYOUT.raw_shape("v", n), generator=g).to(LAYOUT.dtype)
    host.write_blocks(slots, k, v)
    return host


def test_a_keyed_write_is_found_after_a_restart(tmp_path: Path) -> None:
    host = _host(3)
    with DiskTier(LAYOUT, 8, str(tmp_path)) as disk:
        slots = disk.allocate(3)
        keys = [b"a", b"b", b"c"]
        write_keyed(host, [0, 1, 2], disk, slots, keys, [[1, 2], [3], []], [None, b"a", b"b"])
    with DiskTier(LAYOUT, 8, str(tmp_path)) as disk:
        assert disk.keyed_slots() == dict(zip(slots, keys, strict=True))
        assert disk.lookup(b"b") == (slots[1], [3]) and disk.parent_of(b"c") == b"b"
        back = HostTier(LAYOUT, 3)
        copy_blocks(LAYOUT, disk, slots, back, back.allocate(3))
        assert all(
            torch.equal(back.read_encoded([i])[f], host.read_encoded([i])[f])
            for i in range(3)
            for f in host.read_encoded([i])
        )


def test_a_failed_copy_keys_nothing(tmp_path: Path) -> None:
    def full(*args: object) -> None:
        raise TierFullError("injected: no space left on device")

    host = _host(2)
    with DiskTier(LAYOUT, 4, str(tmp_path)) as disk:
        slots = disk.allocate(2)
        with pytest.raises(TierFullError):
            write_keyed(host, [0, 1], disk, slots, [b"a", b"b"], copy=full)
        assert disk.keyed_slots() == {} and disk.num_free == 2  # the slots stay the caller's
        write_keyed(host, [0, 1], disk, slots, [b"a", b"b"])  # token ids: none known
        assert disk.lookup(b"a") == (slots[0], [])


def test_a_read_back_names_the_corrupt_block(tmp_path: Path) -> None:
    host = _host(3)
    with DiskTier(LAYOUT, 4, str(tmp_path)) as disk:
        slots = disk.allocate(3)
        write_keyed(host, [0, 1, 2], disk, slots, [b"a", b"b", b"c"])
        assert unreadable_slots(disk, slots) == set()
        with open(disk.path, "r+b") as f:  # inside the middle block's first layer
            f.seek(slots[1] * disk.slot_bytes + 16)
            f.write(b"\xff\x00\xff\x00")
        disk.drop_cache()
        assert unreadable_slots(disk, slots) == {slots[1]}
        assert unreadable_slots(disk, [slots[0], slots[2]]) == set()
