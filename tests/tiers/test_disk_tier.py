"""DiskTier: bit-exact round trips, checksums, missing/truncated files, ENOSPC, restarts."""

from __future__ import annotations

import errno
import os
import sqlite3
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import pytest
import torch

from kvstrata.codecs.registry import get_codec
from kvstrata.core.errors import (
    BlockCorruptError,
    BlockMissingError,
    ConfigError,
    TierFullError,
    TierIOError,
)
from kvstrata.core.hashing import sequence_block_hashes
from kvstrata.core.layout import BlockLayout
from kvstrata.platform import native as _native
from kvstrata.tiers import disk as disk_mod
from kvstrata.tiers import disk_format
from kvstrata.tiers.disk import ARENA_FILE, DiskTier
from kvstrata.tiers.memory import HostTier

LAYOUT = BlockLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4)
LAYOUT16 = BlockLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=8, dtype=torch.float16)


def _blocks(layout: BlockLayout, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(layout.raw_shape("k", n), generator=g).to(layout.dtype)
    v = torch.randn(layout.raw_shape("v", n), generator=g).to(layout.dtype)
    return k, v


class _ZlibCompressor:
    """Stand-in for kvstrata.codecs.compress when that module is absent."""

    @staticmethod
    def compress(buf: np.ndarray, elem_size: int) -> bytes:
        return zlib.compress(bytes(buf), 1)

    @staticmethod
    def decompress(data: np.ndarray, out: np.ndarray) -> None:
        out[:] = np.frombuffer(zlib.decompress(bytes(data)), dtype=np.uint8)


@pytest.fixture(autouse=True, params=["native", "numpy"])
def io_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs on both I/O paths: the native vectored I/O with XXH3-64
    (kvstrata/platform/csrc/pio.cpp) and the staged fallback (pread/pwrite, xxhash package)."""
    if request.param == "numpy":
        monkeypatch.setattr(disk_mod, "load_native", lambda: None)
    elif _native.load_pio() is None:
        pytest.skip("native disk I/O unavailable (no C++ compiler or no usable xxhash)")
    return request.param


@pytest.fixture
def compressor(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        disk_mod._load_compressor()
    except ConfigError:
        fake = _ZlibCompressor()
        monkeypatch.setattr(disk_mod, "_load_compressor", lambda: (fake.compress, fake.decompress))


def _corrupt_byte(tier: DiskTier, slot: int, layer: int, offset: int = 5) -> None:
    pos = slot * tier.slot_bytes + layer * tier.layer_bytes + offset
    with open(tier.path, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 0x10]))


# -- round trips --------------------------------------------------------------------------
@pytest.mark.parametrize("layout", [LAYOUT, LAYOUT16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("checksum", ["xxh3-64", "crc32"])
def test_round_trip_none_codec_bit_exact(tmp_path, layout, checksum):
    tier = DiskTier(layout, 8, tmp_path, checksum=checksum)
    slots = [6, 1, 2, 3, 0]  # a run (1, 2, 3) between single slots
    k, v = _blocks(layout, len(slots))
    tier.write_blocks(slots, k, v)
    k_out, v_out = torch.empty_like(k), torch.empty_like(v)
    tier.read_blocks(slots, k_out, v_out)
    assert torch.equal(k_out, k) and torch.equal(v_out, v)
    bs = layout.block_size
    for layer in range(layout.num_layers):
        kl = torch.empty(layout.num_kv_heads, 2 * bs, layout.head_dim, dtype=layout.dtype)
        vl = torch.empty_like(kl)
        tier.read_layer(layer, [2, 6], kl, vl)
        assert torch.equal(kl[:, :bs], k[layer, :, 2 * bs : 3 * bs])
        assert torch.equal(vl[:, bs:], v[layer, :, 0:bs])
    enc = tier.read_encoded([3, 0])
    assert set(enc) == {"k.data", "v.data"}
    assert torch.equal(enc["k.data"], k[:, :, 3 * bs :])
    tier.write_encoded([7, 5], enc)
    k2, v2 = torch.empty_like(k[:, :, : 2 * bs]), torch.empty_like(v[:, :, : 2 * bs])
    tier.read_blocks([7, 5], k2, v2)
    assert torch.equal(k2, k[:, :, 3 * bs :]) and torch.equal(v2, v[:, :, 3 * bs :])
    assert tier.stats.blocks_written == 7
    assert tier.stats.bytes_written == 7 * layout.num_layers * tier.layer_bytes
    tier.close()


@pytest.mark.parametrize("codec_name", ["int8", "int4", "fp8"])
def test_lossy_codec_matches_host_tier_bit_exact(tmp_path, codec_name):
    """Same codec, same input: the disk tier returns exactly what the host tier returns."""
    layout = BlockLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=64)
    try:
        codec = get_codec(codec_name)
        codec.validate(layout)
    except Exception as exc:  # another helper's module; skip when it cannot run here
        pytest.skip(f"codec {codec_name} unavailable: {exc}")
    host = HostTier(layout, 4, get_codec(codec_name))
    tier = DiskTier(layout, 4, tmp_path, codec=codec)
    k, v = _blocks(layout, 3, seed=1)
    slots = [3, 0, 1]
    # the host tier gets one run of slots (its index_copy_ has no fp8 kernel on CPU)
    host.write_blocks([0, 1, 2], k, v)
    tier.write_blocks(slots, k, v)
    want_k, want_v = torch.empty_like(k), torch.empty_like(v)
    host.read_blocks([0, 1, 2], want_k, want_v)
    got_k, got_v = torch.empty_like(k), torch.empty_like(v)
    tier.read_blocks(slots, got_k, got_v)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    enc_disk, enc_host = tier.read_encoded([0, 1]), host.read_encoded([1, 2])
    assert set(enc_disk) == set(enc_host)
    for key in enc_host:
        assert torch.equal(enc_disk[key], enc_host[key]), key
    kl = torch.empty(layout.num_kv_heads, 3 * layout.block_size, layout.head_dim)
    vl = torch.empty_like(kl)
    tier.read_layer(1, slots, kl, vl)
    assert torch.equal(kl, want_k[1]) and torch.equal(vl, want_v[1])
    tier.close()


def test_compressed_round_trip(tmp_path, compressor):
    layout = BlockLayout(num_layers=3, num_kv_heads=2, head_dim=16, block_size=8)
    tier = DiskTier(layout, 6, tmp_path, compress=True)
    k, v = _blocks(layout, 3)
    k[:, :, 8:16] = 0.0  # slot 4 compresses well in every layer; the rest is noise
    v[:, :, 8:16] = 1.0
    slots = [2, 4, 5]
    tier.write_blocks(slots, k, v)
    lens = tier._lens[4]
    assert (lens < tier.layer_bytes).all()  # stored compressed
    assert tier.stats.bytes_written < 3 * layout.num_layers * tier.layer_bytes
    k_out, v_out = torch.empty_like(k), torch.empty_like(v)
    tier.read_blocks(slots, k_out, v_out)
    assert torch.equal(k_out, k) and torch.equal(v_out, v)
    kl = torch.empty(2, 24, 16)
    vl = torch.empty_like(kl)
    tier.read_layer(2, slots, kl, vl)
    assert torch.equal(kl, k[2]) and torch.equal(vl, v[2])
    # a corrupt compressed layer is caught before it reaches the decompressor
    _corrupt_byte(tier, 4, 0, offset=int(lens[0]) + 3)  # inside layer 1's packed bytes
    tier.read_layer(0, [4], kl[:, :8], vl[:, :8])
    with pytest.raises(BlockCorruptError) as info:
        tier.read_layer(1, [4], kl[:, :8], vl[:, :8])
    assert info.value.slots == [4]
    tier.close()


def test_compressed_slots_are_read_across_threads_bad_ones_named_in_order(tmp_path, compressor):
    """A read of many compressed slots splits them over io_threads threads: the blocks
    come back exact, in the caller's order, and corrupt slots are named in that order
    whichever thread found them; `read_encoded_into` fills the caller's views."""
    layout = BlockLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=8)
    tier = DiskTier(layout, 12, tmp_path, compress=True, io_threads=3)
    k, v = _blocks(layout, 10, seed=4)
    k[..., ::2] = 0.0  # compressible: every slot is stored packed
    slots = [11, 3, 0, 7, 1, 9, 2, 8, 5, 4]
    tier.write_blocks(slots, k, v)
    assert (tier._lens[slots] < tier.layer_bytes).all()
    k_out, v_out = torch.empty_like(k), torch.empty_like(v)
    tier.read_blocks(slots, k_out, v_out)
    assert torch.equal(k_out, k) and torch.equal(v_out, v)
    assert tier._file._pool is not None  # the threads did the reading
    whole = tier.read_encoded(slots)
    into = {key: torch.zeros_like(t) for key, t in whole.items()}
    tier.read_encoded_into(slots, into)
    assert all(torch.equal(into[key], whole[key]) for key in whole)
    _corrupt_byte(tier, slot=5, layer=0, offset=3)  # the 9th slot read, then the 2nd
    _corrupt_byte(tier, slot=3, layer=0, offset=3)
    with pytest.raises(BlockCorruptError) as info:
        tier.read_blocks(slots, k_out, v_out)
    assert info.value.slots == [3, 5]
    tier.close()
    assert tier._file._pool is None


# -- damage -------------------------------------------------------------------------------
def test_corrupt_byte_is_reported_never_served(tmp_path):
    tier = DiskTier(LAYOUT, 4, tmp_path)
    k, v = _blocks(LAYOUT, 3)
    tier.write_blocks([0, 1, 2], k, v)
    _corrupt_byte(tier, slot=1, layer=2)
    k_out, v_out = torch.zeros_like(k), torch.zeros_like(v)
    with pytest.raises(BlockCorruptError) as info:
        tier.read_blocks([0, 1, 2], k_out, v_out)
    assert info.value.slots == [1]
    assert info.value.path == str(tmp_path / ARENA_FILE)
    assert "slots [1]" in str(info.value) and ARENA_FILE in str(info.value)
    assert tier.stats.read_errors == 1
    # other layers of the same block and other blocks are still served
    kl, vl = torch.empty(2, 8, 8), torch.empty(2, 8, 8)
    tier.read_layer(1, [1, 2], kl, vl)
    assert torch.equal(kl[:, :4], k[1, :, 4:8])
    with pytest.raises(BlockCorruptError):
        tier.read_layer(2, [2, 1], kl, vl)
    with pytest.raises(BlockCorruptError):
        tier.read_encoded([1])
    # rewriting the slot heals it
    tier.write_blocks([1], k[:, :, 4:8], v[:, :, 4:8])
    tier.read_blocks([0, 1, 2], k_out, v_out)
    assert torch.equal(k_out, k)
    tier.close()


def test_truncated_file_is_missing(tmp_path):
    tier = DiskTier(LAYOUT, 4, tmp_path)
    k, v = _blocks(LAYOUT, 4)
    tier.write_blocks([0, 1, 2, 3], k, v)
    os.truncate(tier.path, 2 * tier.slot_bytes + 100)
    with pytest.raises(BlockMissingError) as info:
        tier.read_blocks([2], k[:, :, :4].clone(), v[:, :, :4].clone())
    assert info.value.slots == [2]
    assert isinstance(info.value, TierIOError)
    kl, vl = torch.empty(2, 4, 8), torch.empty(2, 4, 8)
    with pytest.raises(BlockMissingError):
        tier.read_layer(2, [3], kl, vl)
    tier.read_layer(0, [1], kl, vl)  # before the cut: fine
    assert torch.equal(kl, k[0, :, 4:8])


def test_unwritten_slot_is_missing(tmp_path):
    tier = DiskTier(LAYOUT, 4, tmp_path)
    k, v = _blocks(LAYOUT, 1)
    with pytest.raises(BlockMissingError) as info:
        tier.read_blocks([3], k, v)
    assert info.value.slots == [3]


def test_deleted_file_is_missing_while_open_and_empty_after_reopen(tmp_path):
    tier = DiskTier(LAYOUT, 4, tmp_path)
    k, v = _blocks(LAYOUT, 1)
    tier.write_blocks([2], k, v)
    tier.put_key(2, b"h" * 16, [1, 2, 3, 4])
    os.remove(tier.path)
    with pytest.raises(BlockMissingError, match="deleted") as info:
        tier.read_blocks([2], torch.empty_like(k), torch.empty_like(v))
    assert info.value.slots == [2]
    with pytest.raises(BlockMissingError, match="deleted"):  # every read path alike
        tier.read_layer(0, [2], torch.empty(2, 4, 8), torch.empty(2, 4, 8))
    with pytest.raises(TierIOError, match="deleted"):  # and every write path
        tier.write_blocks([1], k, v)
    with pytest.raises(TierIOError, match="deleted"):
        tier.put_key(2, b"g" * 16, [1, 2, 3, 4])
    tier.close()
    # index says slot 2 is keyed; its file is new: the key is dropped, and it says so
    with pytest.warns(RuntimeWarning, match="blocks.bin .* was missing"):
        tier = DiskTier(LAYOUT, 4, tmp_path)
    assert tier.lookup(b"h" * 16) is None
    assert tier.num_used == 0
    with pytest.raises(BlockMissingError) as info:
        tier.read_blocks([2], torch.empty_like(k), torch.empty_like(v))
    assert info.value.slots == [2]
    tier.close()


# -- full disk ----------------------------------------------------------------------------
def test_budget_over_cap_is_tier_full_at_construction(tmp_path):
    with pytest.raises(TierFullError, match="max_file_bytes"):
        DiskTier(LAYOUT, 100, tmp_path, max_file_bytes=99 * 4096)
    assert not (tmp_path / ARENA_FILE).exists()


def test_enospc_at_creation_is_tier_full(tmp_path, monkeypatch):
    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space, raising=False)
    with pytest.raises(TierFullError, match="out of space"):
        DiskTier(LAYOUT, 4, tmp_path)


def test_enospc_on_write_is_tier_full_and_leaves_slot_free(tmp_path, monkeypatch, io_path):
    tier = DiskTier(LAYOUT, 4, tmp_path)
    k, v = _blocks(LAYOUT, 2)
    if io_path == "native":  # writes to /dev/full fail with a real ENOSPC
        arena_fd, full_fd = tier._fd, os.open("/dev/full", os.O_WRONLY)
        tier._fd = full_fd
        with pytest.raises(TierFullError) as info:
            tier.write_blocks([0, 1], k, v)
        tier._fd = arena_fd
        os.close(full_fd)
        assert info.value.slots == [0, 1]
        with pytest.raises(BlockMissingError):
            tier.read_blocks([0], k[:, :, :4].clone(), v[:, :, :4].clone())
        tier.close()
        return

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", no_space)
    monkeypatch.setattr(os, "pwritev", no_space)  # the direct (vectored) path
    with pytest.raises(TierFullError) as info:
        tier.write_blocks([0, 1], k, v)
    assert info.value.slots == [0, 1]
    monkeypatch.undo()
    with pytest.raises(BlockMissingError):  # nothing half-written is ever served
        tier.read_blocks([0], k[:, :, :4].clone(), v[:, :, :4].clone())


# -- keys and restarts --------------------------------------------------------------------
def test_keys_put_lookup_free(tmp_path):
    tier = DiskTier(LAYOUT, 4, tmp_path)
    k, v = _blocks(LAYOUT, 2)
    slots = tier.allocate(2)
    assert slots == [0, 1]
    tier.write_blocks(slots, k, v)
    tier.put_key(0, b"a" * 16, [1, 2, 3, 4])
    tier.put_key(1, b"b" * 16, [5, 6, 7, 8])
    assert tier.lookup(b"a" * 16) == (0, [1, 2, 3, 4])
    assert tier.keyed_slots() == {0: b"a" * 16, 1: b"b" * 16}
    tier.write_blocks([1], k[:, :, :4], v[:, :, :4])  # new content: the old key goes
    assert tier.lookup(b"b" * 16) is None
    tier.free([0])
    assert tier.lookup(b"a" * 16) is None
    assert tier.allocator.free_slots() == [2, 3, 0]
    with pytest.raises(BlockMissingError):
        tier.put_key(3, b"c" * 16, [0, 0, 0, 0])


def test_reopen_with_other_layout_is_config_error(tmp_path):
    DiskTier(LAYOUT, 4, tmp_path).close()
    other = BlockLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=8)
    with pytest.raises(ConfigError, match="layout") as info:
        DiskTier(other, 4, tmp_path)
    assert str(tmp_path) in str(info.value)
    with pytest.raises(ConfigError, match="checksum"):
        DiskTier(LAYOUT, 4, tmp_path, checksum="crc32")


_CHILD = textwrap.dedent(
    """
    import os, sys, torch
    from kvstrata.core.hashing import sequence_block_hashes
    from kvstrata.core.layout import BlockLayout
    from kvstrata.tiers.disk import DiskTier
    layout = BlockLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4)
    tier = DiskTier(layout, 8, sys.argv[1])
    g = torch.Generator().manual_seed(0)
    k = torch.randn(layout.raw_shape("k", 3), generator=g)
    v = torch.randn(layout.raw_shape("v", 3), generator=g)
    tokens = list(range(100, 112))
    hashes = sequence_block_hashes(tokens, 4, {"model": "tiny"})
    slots = tier.allocate(3, after=3)  # [4, 5, 6]
    tier.write_blocks(slots, k, v)
    for i, (slot, h) in enumerate(zip(slots, hashes)):
        tier.put_key(slot, h, tokens[4 * i : 4 * i + 4])
    tier.write_blocks([1], k[:, :, :4], v[:, :, :4])  # unkeyed: free after restart
    os._exit(0)  # no close(), no clean shutdown
    """
)


def test_killed_process_blocks_are_found_after_reopen(tmp_path):
    env = dict(os.environ, PYTHONHASHSEED="123")
    subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path)], check=True, env=env)
    tier = DiskTier(LAYOUT, 8, tmp_path)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(LAYOUT.raw_shape("k", 3), generator=g)
    v = torch.randn(LAYOUT.raw_shape("v", 3), generator=g)
    tokens = list(range(100, 112))
    hashes = sequence_block_hashes(tokens, 4, {"model": "tiny"})
    found = [tier.lookup(h) for h in hashes]
    assert found == [(4, tokens[0:4]), (5, tokens[4:8]), (6, tokens[8:12])]
    assert tier.allocator.free_slots() == [0, 1, 2, 3, 7]
    k_out, v_out = torch.empty_like(k), torch.empty_like(v)
    tier.read_blocks([4, 5, 6], k_out, v_out)
    assert torch.equal(k_out, k) and torch.equal(v_out, v)
    with pytest.raises(BlockMissingError):  # slot 1 was never keyed: treated as free
        tier.read_blocks([1], k_out[:, :, :4], v_out[:, :, :4])
    tier.close()


def test_interrupted_rewrite_leaves_no_stale_key(tmp_path, monkeypatch):
    """A crash after the data of a rewrite but before its index row: the slot is free
    on reopen, and its old key is gone (the old checksum would not match anyway)."""
    tier = DiskTier(LAYOUT, 4, tmp_path)
    k, v = _blocks(LAYOUT, 1)
    tier.write_blocks([3], k, v)
    tier.put_key(3, b"x" * 16, [9, 9, 9, 9])

    def crash(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(DiskTier, "_commit_rows", crash)
    with pytest.raises(KeyboardInterrupt):
        tier.write_blocks([3], k + 1, v + 1)
    monkeypatch.undo()
    tier.close()
    tier = DiskTier(LAYOUT, 4, tmp_path)
    assert tier.lookup(b"x" * 16) is None
    assert tier.num_used == 0


def test_index_names_block_but_bytes_differ_is_corrupt_after_reopen(tmp_path):
    tier = DiskTier(LAYOUT, 4, tmp_path)
    k, v = _blocks(LAYOUT, 1)
    tier.write_blocks([0], k, v)
    (h,) = sequence_block_hashes([1, 2, 3, 4], 4)
    tier.put_key(0, h, [1, 2, 3, 4])
    tier.close()
    # simulate a torn write: the index row survived, part of the data did not
    with open(tmp_path / ARENA_FILE, "r+b") as f:
        f.write(b"\0" * 64)
    tier = DiskTier(LAYOUT, 4, tmp_path)
    assert tier.lookup(h) == (0, [1, 2, 3, 4])
    with pytest.raises(BlockCorruptError) as info:
        tier.read_blocks([0], torch.empty_like(k), torch.empty_like(v))
    assert info.value.slots == [0]
    tier.close()


# -- direct (vectored) I/O ----------------------------------------------------------------
def _file_sums(tier: DiskTier, slot: int) -> np.ndarray:
    """XXH3-64 per layer of the bytes on disk, computed the staged way (the format)."""
    L, lb = tier.layout.num_layers, tier.layer_bytes
    raw = np.fromfile(tier.path, dtype=np.uint8, count=L * lb, offset=slot * tier.slot_bytes)
    return tier._checksum.rows(raw.reshape(L, lb))


def test_direct_and_staged_paths_write_the_same_format(tmp_path):
    """In-place writes (contiguous tensors) and staged writes (rows not contiguous)
    store the same bytes and checksums, and each path reads the other's blocks."""
    tier = DiskTier(LAYOUT, 4, tmp_path)
    k, v = _blocks(LAYOUT, 2)
    wide_k = torch.zeros(*k.shape[:-1], 2 * LAYOUT.head_dim)
    wide_k[..., : LAYOUT.head_dim] = k
    k_strided = wide_k[..., : LAYOUT.head_dim]  # a block's rows are not contiguous
    assert disk_format.direct_view(k_strided, LAYOUT.block_size, 4 * 4 * 8) is None
    tier.write_blocks([0, 1], k, v)
    tier.write_blocks([2, 3], k_strided, v)
    for slot in range(4):
        assert (tier._sums[slot] == _file_sums(tier, slot)).all()
    sb = tier.slot_bytes
    a = np.fromfile(tier.path, dtype=np.uint8, count=2 * sb)
    assert np.array_equal(a, np.fromfile(tier.path, dtype=np.uint8, count=2 * sb, offset=2 * sb))
    out_wide = torch.zeros_like(wide_k)
    out_k, out_v = out_wide[..., : LAYOUT.head_dim], torch.empty_like(v)
    tier.read_blocks([2, 3], out_k, out_v)  # staged read
    assert torch.equal(out_k, k) and torch.equal(out_v, v)
    assert torch.equal(out_wide[..., LAYOUT.head_dim :], torch.zeros_like(k))
    tier.close()


def test_padding_is_written_as_zeros_and_checksummed(tmp_path):
    """fp8 scales (4 bytes per head) are staged, their 16-byte padding is zero."""
    layout = BlockLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4)
    codec = get_codec("fp8")
    try:
        codec.validate(layout)
    except Exception as exc:  # another helper's module; skip when it cannot run here
        pytest.skip(f"codec fp8 unavailable: {exc}")
    tier = DiskTier(layout, 3, tmp_path, codec=codec)
    off, nbytes = tier.regions["k.scale"]
    assert nbytes == 8 and tier.regions["v.data"][0] == off + 16  # 8 bytes of padding
    k, v = _blocks(layout, 3)
    tier.write_blocks([2, 0, 1], k, v)
    for slot in range(3):
        assert (tier._sums[slot] == _file_sums(tier, slot)).all()
        for layer in range(2):
            pos = slot * tier.slot_bytes + layer * tier.layer_bytes + off + nbytes
            pad = np.fromfile(tier.path, dtype=np.uint8, count=8, offset=pos)
            assert pad.tolist() == [0] * 8
    enc = tier.read_encoded([2, 0, 1])
    assert enc["k.scale"].shape == (2, 2, 3, 1)
    tier.close()


def test_short_transfers_are_resumed(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_mod, "load_native", lambda: None)  # the staged path
    real_preadv, real_pwrite = os.preadv, os.pwrite
    calls = {"r": 0, "w": 0}

    def short_read(fd, bufs, offset):
        calls["r"] += 1
        if calls["r"] % 2:  # every other call moves only part of its buffer
            return real_preadv(fd, [bufs[0][: max(1, len(bufs[0]) // 3)]], offset)
        return real_preadv(fd, bufs, offset)

    def short_write(fd, buf, offset):
        calls["w"] += 1
        if calls["w"] % 2:
            return real_pwrite(fd, buf[: max(1, len(buf) // 3)], offset)
        return real_pwrite(fd, buf, offset)

    tier = DiskTier(LAYOUT16, 4, tmp_path)
    monkeypatch.setattr(os, "preadv", short_read)
    monkeypatch.setattr(os, "pwrite", short_write)
    k, v = _blocks(LAYOUT16, 3)
    tier.write_blocks([1, 2, 3], k, v)
    k_out, v_out = torch.zeros_like(k), torch.zeros_like(v)
    tier.read_blocks([1, 2, 3], k_out, v_out)
    assert torch.equal(k_out, k) and torch.equal(v_out, v)
    kl = torch.empty(2, 16, 16, dtype=torch.float16)
    vl = torch.empty_like(kl)
    tier.read_layer(1, [3, 1], kl, vl)
    assert torch.equal(kl[:, :8], k[1, :, 16:24]) and torch.equal(vl[:, 8:], v[1, :, 0:8])
    assert calls["r"] > 4 and calls["w"] >= 2
    monkeypatch.undo()
    for slot in (1, 2, 3):
        assert (tier._sums[slot] == _file_sums(tier, slot)).all()
    tier.close()


def test_native_short_transfers_are_resumed(tmp_path, io_path):
    """Every preadv/pwritev of the native path moves at most 1,000 bytes (a test hook),
    so each batch resumes inside an iovec many times: data and checksums stay exact."""
    if io_path != "native":
        pytest.skip("native I/O only")
    lib = _native.load_pio()
    tier = DiskTier(LAYOUT16, 4, tmp_path)
    k, v = _blocks(LAYOUT16, 3)
    lib.kv_pio_limit_call_bytes(1000)
    try:
        tier.write_blocks([1, 2, 3], k, v)
        k_out, v_out = torch.zeros_like(k), torch.zeros_like(v)
        tier.read_blocks([1, 2, 3], k_out, v_out)
        kl = torch.empty(2, 16, 16, dtype=torch.float16)
        vl = torch.empty_like(kl)
        tier.read_layer(1, [3, 1], kl, vl)
    finally:
        lib.kv_pio_limit_call_bytes(0)
    assert torch.equal(k_out, k) and torch.equal(v_out, v)
    assert torch.equal(kl[:, :8], k[1, :, 16:24]) and torch.equal(vl[:, 8:], v[1, :, 0:8])
    for slot in (1, 2, 3):
        assert (tier._sums[slot] == _file_sums(tier, slot)).all()
    tier.close()


def test_corrupt_block_is_never_left_in_output(tmp_path, io_path):
    """In place (native): the corrupt block's bytes are zeroed in the output, verified
    blocks are served. Staged: a chunk with a bad block is not copied out at all."""
    tier = DiskTier(LAYOUT, 4, tmp_path)
    k, v = _blocks(LAYOUT, 3)
    tier.write_blocks([0, 1, 2], k, v)
    _corrupt_byte(tier, slot=2, layer=0, offset=9)
    k_out, v_out = torch.full_like(k, 7.0), torch.full_like(v, 7.0)
    with pytest.raises(BlockCorruptError) as info:
        tier.read_blocks([0, 2, 1], k_out, v_out)
    assert info.value.slots == [2]
    fill = 0.0 if io_path == "native" else 7.0
    assert torch.equal(k_out[:, :, 4:8], torch.full((3, 2, 4, 8), fill))
    assert torch.equal(v_out[:, :, 4:8], torch.full((3, 2, 4, 8), fill))
    if io_path == "native":
        assert torch.equal(k_out[:, :, 8:12], k[:, :, 4:8])  # slot 1 verified and served
    kl, vl = torch.full((2, 4, 8), 7.0), torch.full((2, 4, 8), 7.0)
    with pytest.raises(BlockCorruptError):
        tier.read_layer(0, [2], kl, vl)
    assert torch.equal(kl, torch.full((2, 4, 8), fill))
    tier.read_layer(1, [2], kl, vl)  # another layer of the same block is fine
    assert torch.equal(kl, k[1, :, 8:12])
    tier.close()


# -- O_DIRECT -----------------------------------------------------------------------------
def _o_direct_tier(tmp_path, layout, n):
    try:
        return DiskTier(layout, n, tmp_path, o_direct=True)
    except ConfigError as exc:
        pytest.skip(f"no O_DIRECT here: {exc}")


def test_o_direct_round_trip_layers_and_corruption(tmp_path):
    """O_DIRECT tier: whole blocks and single layers (unaligned within the slot) read
    back bit-exact, the format is the buffered one, and corruption is still caught."""
    tier = _o_direct_tier(tmp_path, LAYOUT16, 5)
    k, v = _blocks(LAYOUT16, 4)
    tier.write_blocks([3, 0, 1, 2], k, v)
    k_out, v_out = torch.zeros_like(k), torch.zeros_like(v)
    tier.read_blocks([3, 0, 1, 2], k_out, v_out)
    assert torch.equal(k_out, k) and torch.equal(v_out, v)
    assert tier.layer_bytes % 4096  # a layer is not page-aligned: the unaligned path
    kl = torch.empty(2, 16, 16, dtype=torch.float16)
    vl = torch.empty_like(kl)
    tier.read_layer(1, [1, 3], kl, vl)
    assert torch.equal(kl[:, :8], k[1, :, 16:24]) and torch.equal(vl[:, 8:], v[1, :, 0:8])
    for slot in range(4):
        assert (tier._sums[slot] == _file_sums(tier, slot)).all()
        tier.put_key(slot, bytes([slot]) * 16, [slot])  # keyed blocks survive a reopen
    tier.close()
    buffered = DiskTier(LAYOUT16, 5, tmp_path)  # same directory, buffered I/O
    buffered.read_blocks([3, 0, 1, 2], k_out, v_out)
    assert torch.equal(k_out, k)
    buffered.close()
    tier = _o_direct_tier(tmp_path, LAYOUT16, 5)
    _corrupt_byte(tier, slot=1, layer=1, offset=40)
    with pytest.raises(BlockCorruptError):
        tier.read_layer(1, [1], kl[:, :8], vl[:, :8])
    tier.read_layer(0, [1], kl[:, :8], vl[:, :8])  # the other layer is intact
    assert torch.equal(kl[:, :8], k[0, :, 16:24])
    tier.close()


def test_o_direct_with_compress_is_a_config_error(tmp_path, compressor):
    with pytest.raises(ConfigError, match="o_direct"):
        DiskTier(LAYOUT, 4, tmp_path, compress=True, o_direct=True)


def test_uncreatable_directory_is_a_config_error():
    with pytest.raises(ConfigError, match="disk_dir='/proc/kvstrata-no/x' is invalid: cannot"):
        DiskTier(LAYOUT, 4, "/proc/kvstrata-no/x")


def test_native_threads_and_batches_hash_each_layer_in_file_order(tmp_path, io_path):
    """Large blocks: one native call splits a chunk over threads (at layer boundaries)
    and a layer over several 512 KiB batches; the streamed XXH3-64 of each layer
    equals the xxhash package's value of its bytes on disk, and corruption deep in a
    layer is still caught."""
    if io_path != "native":
        pytest.skip("native I/O only")
    layout = BlockLayout(num_layers=2, num_kv_heads=4, head_dim=128, block_size=256)
    tier = DiskTier(layout, 5, tmp_path, io_threads=4)
    assert tier.layer_bytes >= 2 * disk_format.NATIVE_BATCH  # a layer spans batches
    k, v = _blocks(layout, 4, seed=3)
    tier.write_blocks([4, 0, 1, 2], k, v)
    k_out, v_out = torch.zeros_like(k), torch.zeros_like(v)
    tier.read_blocks([4, 0, 1, 2], k_out, v_out)
    assert torch.equal(k_out, k) and torch.equal(v_out, v)
    for slot in (0, 1, 2, 4):
        assert (tier._sums[slot] == _file_sums(tier, slot)).all()
    _corrupt_byte(tier, slot=1, layer=1, offset=tier.layer_bytes - 3)
    with pytest.raises(BlockCorruptError) as info:
        tier.read_blocks([4, 0, 1, 2], k_out, v_out)
    assert info.value.slots == [1]
    kl = torch.empty(4, 256, 128)
    tier.read_layer(0, [1], kl, torch.empty_like(kl))  # layer 0 of that slot is intact
    assert torch.equal(kl, k[0, :, 512:768])
    tier.close()


# -- XXH3-64 from the xxhash package ---------------------------------------------------
def _pio(lib, fd: int, write: bool, bufs: list[np.ndarray], regions: list[int], nth: int = 1):
    """One raw kv_pio call: bufs[i] at consecutive file offsets, bufs[i] in region
    regions[i] (-1: not checksummed). Returns (rc, sums)."""
    lens = np.array([b.nbytes for b in bufs], dtype=np.int64)
    addr = np.array([b.ctypes.data for b in bufs], dtype=np.int64)
    foff = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    out = np.array(regions, dtype=np.int64)
    sums = np.zeros(max(regions) + 1, dtype=np.uint64)
    status = np.zeros(len(bufs), dtype=np.uint8)
    ptr = lambda a: a.ctypes.data  # noqa: E731
    rc = lib.kv_pio(
        fd, int(write), len(bufs), ptr(addr), ptr(lens), ptr(foff), ptr(out),
        ptr(sums), ptr(status), disk_format.NATIVE_BATCH, nth,
    )  # fmt: skip
    assert not status.any()
    return rc, sums


def test_native_xxh3_equals_the_package_at_every_size(tmp_path, io_path):
    """Regions of every XXH3 size class (1 byte .. several MiB), each written and read
    as many uneven pieces over 4 threads: every streamed sum equals
    xxhash.xxh3_64 of the region's bytes, on the way out and on the way back."""
    import xxhash

    if io_path != "native":
        pytest.skip("native I/O only")
    lib = _native.load_pio()
    rng = np.random.default_rng(7)
    sizes = [1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1023, 1024, 1025, 4096, 70001]
    sizes += [3 << 20, (5 << 20) + 77]  # spans batches and gives the threads work
    bufs, regions, want = [], [], []
    for r, size in enumerate(sizes):
        data = rng.integers(0, 256, size, dtype=np.uint8)
        want.append(xxhash.xxh3_64_intdigest(data.tobytes()))
        cuts = np.unique(rng.integers(1, size, min(size - 1, 40))) if size > 1 else []
        for piece in np.split(data, cuts):
            bufs.append(piece.copy())
            regions.append(r)
        bufs.append(np.full(13, 0xEE, dtype=np.uint8))  # an unsummed gap between regions
        regions.append(-1)
    fd = os.open(tmp_path / "pio.bin", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        rc, wrote = _pio(lib, fd, True, bufs, regions, nth=4)
        assert rc == 0 and wrote.tolist() == want
        back = [np.zeros_like(b) for b in bufs]
        rc, read = _pio(lib, fd, False, back, regions, nth=4)
        assert rc == 0 and read.tolist() == want
    finally:
        os.close(fd)
    assert all(np.array_equal(a, b) for a, b in zip(back, bufs, strict=True))


def test_kv_pio_runs_only_with_verified_xxh3_functions(tmp_path, io_path):
    """A fresh copy of the library (its own, unset function pointers) refuses I/O with
    ENOSYS until the xxhash package's functions are installed; functions missing from
    the given object, or values that disagree with the package, leave it refusing."""
    import ctypes
    import ctypes.util
    import shutil

    import xxhash

    if io_path != "native":
        pytest.skip("native I/O only")
    copy = tmp_path / "copy.so"
    shutil.copyfile(_native._library_path(), copy)
    lib = ctypes.CDLL(str(copy))
    for name, (argtypes, restype) in _native._SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    data = np.arange(300, dtype=np.uint8)
    fd = os.open(tmp_path / "pio.bin", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert _pio(lib, fd, True, [data], [0])[0] == -errno.ENOSYS
        libc = ctypes.util.find_library("c") or "libc.so.6"
        assert "cannot take the XXH3 functions" in _native._bind_xxh3(lib, libc)
        xxh = ctypes.CDLL(_native._xxh3_library())
        addrs = [
            ctypes.cast(getattr(xxh, n), ctypes.c_void_p).value for n in _native._XXH3_FUNCTIONS
        ]
        right = xxhash.xxh3_64_intdigest(data.tobytes())
        empty = xxhash.xxh3_64_intdigest(b"")
        assert lib.kv_pio_set_xxh3(*addrs, data.ctypes.data, 300, right ^ 1, empty) == -1
        assert lib.kv_pio_set_xxh3(*addrs, data.ctypes.data, 300, right, empty ^ 1) == -1
        assert lib.kv_pio_set_xxh3(*addrs[:5], None, data.ctypes.data, 300, right, empty) == -1
        assert _pio(lib, fd, True, [data], [0])[0] == -errno.ENOSYS
        assert _native._bind_xxh3(lib, _native._xxh3_library()) is None
        rc, sums = _pio(lib, fd, True, [data[:100], data[100:]], [0, 0])
        assert rc == 0 and sums.tolist() == [right]
    finally:
        os.close(fd)


_NO_XXH3_CHILD = textwrap.dedent(
    """
    import ctypes.util, sys, warnings
    from kvstrata.platform import native as _native
    _native._xxh3_library = lambda: ctypes.util.find_library("c") or "libc.so.6"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lib = _native.load()
    assert lib is not None and _native.available()  # codecs and attention stay native
    assert _native.load_pio() is None  # the disk tier stages its I/O instead
    assert [str(w.message) for w in caught if "disk I/O" in str(w.message)], caught
    """
)


def test_library_without_usable_xxhash_disables_only_the_disk_io(io_path):
    """An xxhash extension without the XXH3 exports: a warning, the codec and
    attention kernels still load, the disk I/O is off (never a wrong checksum)."""
    if io_path != "native":
        pytest.skip("native library only")
    subprocess.run([sys.executable, "-c", _NO_XXH3_CHILD], check=True)


def test_parents_are_kept_across_a_reopen_and_an_old_index_gains_the_column(tmp_path):
    """The index keeps each keyed block's parent hash (a restarted store announces its
    chains in order); an index from before parents were kept opens, its blocks with no
    parent, and keeps the parents given from then on."""
    tier = DiskTier(LAYOUT, 4, tmp_path)
    k, v = _blocks(LAYOUT, 3)
    tier.write_blocks([0, 1, 2], k, v)
    tier.put_keys([(0, b"a", [1]), (1, b"b", [2])], [None, b"a"])
    tier.put_keys([(2, b"c", [3])])  # no parents given: none kept
    assert (tier.parent_of(b"a"), tier.parent_of(b"b"), tier.parent_of(b"c")) == (None, b"a", None)
    tier.close()
    tier = DiskTier(LAYOUT, 4, tmp_path)
    assert tier.parent_of(b"b") == b"a" and tier.lookup(b"b") == (1, [2])
    tier.close()
    db = sqlite3.connect(tmp_path / "index.sqlite")
    db.execute("ALTER TABLE blocks DROP COLUMN parent")  # the index as it was before
    db.commit()
    db.close()
    tier = DiskTier(LAYOUT, 4, tmp_path)
    assert tier.lookup(b"b") == (1, [2]) and tier.parent_of(b"b") is None
    tier.put_keys([(1, b"b", [2])], [b"a"])
    tier.close()
    tier = DiskTier(LAYOUT, 4, tmp_path)
    assert tier.parent_of(b"b") == b"a"
    tier.close()
