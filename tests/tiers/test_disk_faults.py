"""Fault injection on the disk tier: zero wrong outputs, nothing committed lost.

Every read either equals what was written or raises a typed kvstrata error (the
TierIOError family); blocks the fault did not touch stay readable, also after a
reopen. Faults: bit flips (single, paired, bursts) anywhere in blocks.bin, truncation,
deletion or replacement of the arena or the index (while open and between runs), a
full filesystem (ENOSPC on the arena, a full index via max_page_count, RLIMIT_FSIZE in
a subprocess), kill -9 of a writer at random points, two processes on one directory,
and 1,000 open/use/close cycles (descriptors, memory, files). docs/design.md's
"Durability contract" states what these tests hold the disk tier to.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import os
import random
import resource
import select
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockstore_harness import held_deleted_files
from kvstrata.codecs.registry import get_codec
from kvstrata.core.errors import (
    BlockCorruptError,
    BlockMissingError,
    ConfigError,
    KvstrataError,
    TierFullError,
    TierIOError,
)
from kvstrata.core.layout import BlockLayout
from kvstrata.platform import native as _native
from kvstrata.tiers import disk as disk_mod
from kvstrata.tiers.disk import ARENA_FILE, INDEX_FILE, LOCK_FILE, DiskTier

LAYOUT = BlockLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4)
N_SLOTS = 6
HAS_NATIVE = _native.available()
ROOT = Path(__file__).resolve().parents[2]

# (native kernels, checksum, compress, codec): the I/O paths flips are tried on
VARIANTS = {
    "native-xxh3": (True, "xxh3-64", False, "none"),
    "staged-xxh3": (False, "xxh3-64", False, "none"),
    "staged-crc32": (False, "crc32", False, "none"),
    "native-int8": (True, "xxh3-64", False, "int8"),
    "compressed": (True, "xxh3-64", True, "none"),
}


def _blocks(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(LAYOUT.raw_shape("k", n), generator=g),
        torch.randn(LAYOUT.raw_shape("v", n), generator=g),
    )


def _block(k: torch.Tensor, v: torch.Tensor, j: int) -> tuple[torch.Tensor, torch.Tensor]:
    bs = LAYOUT.block_size
    return k[:, :, j * bs : (j + 1) * bs], v[:, :, j * bs : (j + 1) * bs]


@contextlib.contextmanager
def _native_off(off: bool):
    if off:
        with mock.patch.object(disk_mod, "load_native", lambda: None):
            yield
    else:
        yield


def _open(directory, variant: str = "native-xxh3", n: int = N_SLOTS, **kw) -> DiskTier:
    native, checksum, compress, codec = VARIANTS[variant]
    with _native_off(not native):
        return DiskTier(
            LAYOUT, n, directory, codec=get_codec(codec), checksum=checksum, compress=compress, **kw
        )


def _needs(variant: str) -> None:
    if VARIANTS[variant][0] and not HAS_NATIVE:
        pytest.skip("native kernels unavailable")
    if VARIANTS[variant][2]:
        pytest.importorskip("zstandard")


def _typed(exc: BaseException) -> bool:
    """A typed kvstrata storage error with a one-line message."""
    return isinstance(exc, TierIOError) and "\n" not in str(exc)


def _read(tier: DiskTier, slot: int) -> tuple[torch.Tensor, torch.Tensor] | TierIOError:
    """Block `slot` as read back, or the typed error the read raised (anything
    else fails the test)."""
    k = torch.full((LAYOUT.num_layers, 2, LAYOUT.block_size, 8), 7.0)
    v = torch.full_like(k, 7.0)
    try:
        tier.read_blocks([slot], k, v)
    except TierIOError as exc:
        assert _typed(exc), exc
        return exc
    return k, v


def _check(tier: DiskTier, want: dict[int, tuple], touched: set[int]) -> None:
    """Zero wrong outputs: every block of `want` reads back exactly, except the
    `touched` ones, which raise a typed error (or read back exactly). Also by layer,
    and all at once."""
    for slot, (k, v) in want.items():
        got = _read(tier, slot)
        if isinstance(got, TierIOError):
            assert slot in touched, f"untouched slot {slot}: {got}"
            assert slot in got.slots
        else:
            assert torch.equal(got[0], k) and torch.equal(got[1], v), f"wrong data, slot {slot}"
        for layer in range(LAYOUT.num_layers):
            kl = torch.full((2, LAYOUT.block_size, 8), 7.0)
            vl = torch.full_like(kl, 7.0)
            try:
                tier.read_layer(layer, [slot], kl, vl)
            except TierIOError as exc:
                assert _typed(exc) and slot in touched, exc
                continue
            assert torch.equal(kl, k[layer]) and torch.equal(vl, v[layer]), (slot, layer)
    slots = sorted(want)
    k_all = torch.empty(LAYOUT.raw_shape("k", len(slots)))
    v_all = torch.empty_like(k_all)
    try:
        tier.read_blocks(slots, k_all, v_all)
    except TierIOError as exc:
        assert _typed(exc) and set(exc.slots) <= touched and exc.slots, exc
    else:
        for j, slot in enumerate(slots):
            kb, vb = _block(k_all, v_all, j)
            assert torch.equal(kb, want[slot][0]) and torch.equal(vb, want[slot][1])


def _fill(tier: DiskTier, seed: int = 0) -> dict[int, tuple]:
    """Write and key a block in every slot; returns slot -> (k, v) as read back
    (for a lossy codec: its decoded values)."""
    k, v = _blocks(N_SLOTS, seed)
    slots = tier.allocate(N_SLOTS)
    assert slots == list(range(N_SLOTS))
    tier.write_blocks(slots, k, v)
    tier.put_keys([(s, b"key-%d" % s, [s, seed]) for s in slots])
    want = {}
    for s in slots:
        got = _read(tier, s)
        assert not isinstance(got, TierIOError)
        want[s] = got
    return want


def _extents(tier: DiskTier) -> dict[int, tuple[int, int]]:
    """slot -> [a, b) file bytes its checksums cover (the tail padding is not data)."""
    return {
        s: (s * tier.slot_bytes, s * tier.slot_bytes + int(tier._lens[s].sum()))
        for s in range(N_SLOTS)
        if tier._index.written[s]
    }


def _flip(path: Path, edits: dict[int, int]) -> None:
    with open(path, "r+b") as f:
        for pos, mask in edits.items():
            f.seek(pos)
            byte = f.read(1)[0]
            f.seek(pos)
            f.write(bytes([byte ^ mask]))


FILE_BYTES = N_SLOTS * 4096  # LAYOUT: one 4 KiB slot per block


@st.composite
def flips(draw) -> dict[int, int]:
    """{file position: xor mask != 0}: one bit, a pair of bits (anywhere, or the
    paired sign bits 8 bytes apart that a linear hash cancels), or a burst."""
    kind = draw(st.sampled_from(["single", "paired", "sign-pair", "burst"]))
    if kind == "single":
        pos = draw(st.integers(0, FILE_BYTES - 1))
        return {pos: 1 << draw(st.integers(0, 7))}
    if kind == "paired":
        a, b = draw(st.lists(st.integers(0, FILE_BYTES - 1), min_size=2, max_size=2, unique=True))
        return {a: 1 << draw(st.integers(0, 7)), b: 1 << draw(st.integers(0, 7))}
    if kind == "sign-pair":
        base = draw(st.integers(0, FILE_BYTES // 16 - 1)) * 16
        return {base + 7: 0x80, base + 15: 0x80}
    start = draw(st.integers(0, FILE_BYTES - 64))
    masks = draw(st.lists(st.integers(1, 255), min_size=2, max_size=64))
    return {start + i: m for i, m in enumerate(masks)}


@pytest.mark.parametrize("variant", list(VARIANTS))
@settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(edits=flips(), reopen=st.booleans())
def test_bit_flips_are_detected_never_served(variant, edits, reopen):
    """Contract: a corrupt block is never served; untouched blocks are."""
    _needs(variant)
    with tempfile.TemporaryDirectory() as d:
        tier = _open(d, variant)
        want = _fill(tier)
        extents = _extents(tier)
        touched = {s for s, (a, b) in extents.items() if any(a <= p < b for p in edits)}
        _flip(tier.path, edits)
        if reopen:
            tier.close()
            tier = _open(d, variant)
            assert sorted(tier.keyed_slots()) == list(range(N_SLOTS))
        _check(tier, want, touched)
        for s in touched:  # the checksums must catch every flip inside a block
            assert isinstance(_read(tier, s), BlockCorruptError), (s, edits)
        if touched:  # rewriting heals
            k, v = _blocks(len(touched), seed=1)
            tier.write_blocks(sorted(touched), k, v)
            for j, s in enumerate(sorted(touched)):
                got = _read(tier, s)
                assert not isinstance(got, TierIOError), got
                if VARIANTS[variant][3] == "none":  # lossless: bit-exact
                    assert torch.equal(got[0], _block(k, v, j)[0])
        tier.close()


def test_paired_sign_bit_flips_regression(tmp_path):
    """xor 0x80 into bytes 7 and 15 of a block: the old linear hash cancelled them."""
    tier = _open(tmp_path, "native-xxh3" if HAS_NATIVE else "staged-xxh3")
    want = _fill(tier)
    _flip(tier.path, {7: 0x80, 15: 0x80})
    assert isinstance(_read(tier, 0), BlockCorruptError)
    _check(tier, want, {0})
    tier.close()


@settings(max_examples=20, deadline=None, derandomize=True)
@given(cut=st.integers(0, FILE_BYTES - 1))
def test_truncated_arena_is_missing_then_dropped(cut):
    """Contract: a truncated block is missing (never served); after a reopen it is
    dropped (with a warning) and the blocks before the cut are intact."""
    with tempfile.TemporaryDirectory() as d:
        tier = _open(d, "native-xxh3" if HAS_NATIVE else "staged-xxh3")
        want = _fill(tier)
        os.truncate(tier.path, cut)
        lost = {s for s in want if (s + 1) * tier.slot_bytes > cut}  # a slot is the unit
        _check(tier, want, lost)
        tier.close()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            tier = _open(d)
        assert bool(lost) == any("truncated" in str(w.message) for w in seen)
        assert set(tier.keyed_slots()) == set(want) - lost
        _check(tier, {s: w for s, w in want.items() if s not in lost}, set())
        for s in lost:
            assert isinstance(_read(tier, s), BlockMissingError)
        tier.close()


# -- deletion and replacement -------------------------------------------------------------
def test_arena_deleted_while_open_every_path_is_typed(tmp_path):
    tier = _open(tmp_path)
    want = _fill(tier)
    os.unlink(tier.path)
    _check(tier, want, set(want))
    for slot in want:
        assert isinstance(_read(tier, slot), BlockMissingError)
    k, v = _blocks(1)
    with pytest.raises(TierIOError, match="deleted or replaced") as info:
        tier.write_blocks([0], k, v)
    assert _typed(info.value)
    with pytest.raises(TierIOError):
        tier.put_key(1, b"x", [1])
    tier.close()
    tier.close()
    with pytest.warns(RuntimeWarning, match="was missing"):
        tier = _open(tmp_path)
    assert tier.keyed_slots() == {} and tier.num_used == 0
    want = _fill(tier, seed=3)  # the new arena works
    tier.close()
    tier = _open(tmp_path)
    _check(tier, want, set())
    tier.close()


def test_arena_deleted_between_runs_starts_empty(tmp_path):
    tier = _open(tmp_path)
    _fill(tier)
    tier.close()
    os.unlink(tmp_path / ARENA_FILE)
    with pytest.warns(RuntimeWarning, match="blocks.bin .* was missing"):
        tier = _open(tmp_path)
    assert tier.keyed_slots() == {}
    for slot in range(N_SLOTS):
        assert isinstance(_read(tier, slot), BlockMissingError)
    tier.close()


def test_arena_replaced_while_open_is_typed(tmp_path):
    tier = _open(tmp_path)
    want = _fill(tier)
    other = tmp_path / "other.bin"
    shutil.copy(tier.path, other)
    os.replace(other, tier.path)  # same bytes, another file: ours is unlinked
    for slot in want:
        assert isinstance(_read(tier, slot), BlockMissingError)
    tier.close()


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_index_lost_while_open_is_rebuilt_from_memory(tmp_path, how):
    """Contract: a deleted or replaced index is noticed at the next commit and
    rebuilt from memory (with a warning): nothing committed is lost."""
    tier = _open(tmp_path)
    want = _fill(tier)
    index = tmp_path / INDEX_FILE
    if how == "deleted":
        os.unlink(index)
    else:
        garbage = tmp_path / "garbage"
        garbage.write_bytes(os.urandom(5000))
        os.replace(garbage, index)
    _check(tier, want, set())  # reads use the in-memory mirror
    k, v = _blocks(1, seed=9)
    with pytest.warns(RuntimeWarning, match=f"was {how} while open; rebuilt"):
        tier.write_blocks([5], k, v)
    tier.put_key(5, b"new", [9])
    want[5] = (k, v)
    tier.close()
    tier = _open(tmp_path)
    assert tier.lookup(b"new") == (5, [9])
    assert tier.lookup(b"key-0") == (0, [0, 0])
    _check(tier, want, set())
    tier.close()


def test_index_lost_at_close_is_rebuilt(tmp_path):
    tier = _open(tmp_path)
    want = _fill(tier)
    os.unlink(tmp_path / INDEX_FILE)
    with pytest.warns(RuntimeWarning, match="rebuilt"):
        tier.close()
    tier = _open(tmp_path)
    _check(tier, want, set())
    tier.close()


def test_index_deleted_between_runs_starts_empty_and_says_so(tmp_path):
    tier = _open(tmp_path)
    _fill(tier)
    tier.close()
    for suffix in ("", "-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_path / (INDEX_FILE + suffix))
    with pytest.warns(RuntimeWarning, match="index.sqlite .* was missing"):
        tier = _open(tmp_path)
    assert tier.keyed_slots() == {}
    for slot in range(N_SLOTS):
        assert isinstance(_read(tier, slot), BlockMissingError)  # never the stale bytes
    tier.close()


def test_index_deleted_with_its_wal_left_behind_starts_clean(tmp_path):
    """A crashed run leaves index.sqlite-wal; if index.sqlite is then deleted, that
    stale -wal must not be replayed into the new index."""
    tier = _open(tmp_path)
    _fill(tier)
    wal = tmp_path / (INDEX_FILE + "-wal")
    assert wal.exists() and wal.stat().st_size > 0
    stale = wal.read_bytes()  # what a kill -9 would leave
    tier.close()
    wal.write_bytes(stale)
    os.unlink(tmp_path / INDEX_FILE)
    with pytest.warns(RuntimeWarning, match="was missing"):
        tier = _open(tmp_path)
    assert tier.keyed_slots() == {}
    for slot in range(N_SLOTS):
        assert isinstance(_read(tier, slot), BlockMissingError)
    tier.close()


@pytest.mark.parametrize("damage", ["garbage", "half", "zeros-in-place"])
def test_damaged_index_between_runs_is_typed_not_raw_sqlite(tmp_path, damage):
    tier = _open(tmp_path)
    want = _fill(tier)
    tier.close()
    index = tmp_path / INDEX_FILE
    data = index.read_bytes()
    if damage == "garbage":
        index.write_bytes(b"this is not a database" * 100)
    elif damage == "half":
        index.write_bytes(data[: len(data) // 2])
    else:
        with open(index, "r+b") as f:
            f.seek(len(data) // 3)
            f.write(b"\0" * 4096)
    fds = len(os.listdir("/proc/self/fd"))
    try:
        tier = _open(tmp_path)
    except TierIOError as exc:
        assert _typed(exc) and INDEX_FILE in str(exc) and "delete" in str(exc), exc
        assert len(os.listdir("/proc/self/fd")) == fds  # nothing leaked
        tier = None
    except KvstrataError as exc:
        pytest.fail(f"untyped: {exc!r}")
    if tier is not None:  # sqlite read past the damage: rows are still verified
        _check(tier, {s: w for s, w in want.items() if s in tier.keyed_slots()}, set(want))
        tier.close()
    os.unlink(index)
    with pytest.warns(RuntimeWarning):
        tier = _open(tmp_path)
    tier.close()


def test_index_overwritten_in_place_while_open_is_typed(tmp_path):
    tier = _open(tmp_path)
    want = _fill(tier)
    with open(tmp_path / INDEX_FILE, "r+b") as f:
        f.write(os.urandom(8192))
    k, v = _blocks(1, seed=4)
    for op in (
        lambda: tier.write_blocks([2], k, v),
        lambda: tier.put_key(2, b"k2", [2]),
        lambda: tier.free([3]),
    ):
        try:
            op()
        except TierIOError as exc:
            assert _typed(exc), exc
    _check(tier, {s: w for s, w in want.items() if s not in (2, 3)}, set())
    with contextlib.suppress(TierIOError):
        tier.close()
    try:
        tier = _open(tmp_path)
    except TierIOError as exc:
        assert _typed(exc)
        return
    by_key = {b"key-%d" % s: w for s, w in want.items()}
    by_key[b"k2"] = (k, v)
    keyed = tier.keyed_slots()
    _check(tier, {s: by_key[h] for s, h in keyed.items()}, set(keyed))
    tier.close()


def test_retired_checksum_directory_is_refused_in_one_line(tmp_path):
    tier = _open(tmp_path)
    _fill(tier)
    tier.close()
    db = sqlite3.connect(tmp_path / INDEX_FILE)
    meta = json.loads(db.execute("SELECT value FROM meta").fetchone()[0])
    meta["checksum"] = "mlh64"
    with db:
        db.execute("UPDATE meta SET value=?", (json.dumps(meta),))
    db.close()
    with pytest.raises(ConfigError, match="mlh64.*delete that directory") as info:
        _open(tmp_path)
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="retired"):
        DiskTier(LAYOUT, 4, tmp_path / "x", checksum="mlh64")


# -- full filesystem ----------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["native-xxh3", "staged-xxh3"])
def test_enospc_on_arena_write_keeps_committed_blocks(tmp_path, variant):
    _needs(variant)
    tier = _open(tmp_path, variant)
    want = _fill(tier)
    k, v = _blocks(2, seed=5)

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    lib = _native.load_pio() if VARIANTS[variant][0] else None
    if lib is not None:  # the native path: a descriptor whose writes fail with ENOSPC
        arena, full = tier._fd, os.open("/dev/full", os.O_WRONLY)
        tier._fd = full
        try:
            with pytest.raises(TierFullError) as info:
                tier.write_blocks([1, 4], k, v)
        finally:
            tier._fd = arena
            os.close(full)
    else:
        with (
            mock.patch.object(os, "pwrite", no_space),
            mock.patch.object(os, "pwritev", no_space),
            pytest.raises(TierFullError) as info,
        ):
            tier.write_blocks([1, 4], k, v)
    assert _typed(info.value) and "free space" in str(info.value)
    assert info.value.slots == [1, 4]
    lost = {1, 4}  # their rows were dropped before the failed rewrite
    for s in lost:
        assert isinstance(_read(tier, s), BlockMissingError)
    _check(tier, {s: w for s, w in want.items() if s not in lost}, set())
    tier.close()
    tier = _open(tmp_path, variant)
    assert set(tier.keyed_slots()) == set(want) - lost
    tier.close()


def test_full_index_is_tier_full_and_consistent(tmp_path):
    """sqlite runs out of pages (PRAGMA max_page_count): TierFullError, never a raw
    sqlite3 error; the failed blocks are missing, everything committed stays."""
    tier = _open(tmp_path, n=64)
    k, v = _blocks(1)
    db = tier._index.db
    pages = db.execute("PRAGMA page_count").fetchone()[0]
    db.execute(f"PRAGMA max_page_count={pages + 1}")
    done: dict[int, tuple] = {}
    failure = None
    for slot in range(64):
        try:
            tier.write_blocks([slot], k, v)
            tier.put_key(slot, b"h%d" % slot + b"x" * 400, list(range(200)))
        except TierIOError as exc:
            failure = exc
            break
        done[slot] = (k, v)
    assert isinstance(failure, TierFullError), failure
    assert _typed(failure) and INDEX_FILE in str(failure) and "free space" in str(failure)
    for slot in range(64):
        got = _read(tier, slot)
        if slot in done and tier._index.written[slot]:
            assert not isinstance(got, TierIOError) and torch.equal(got[0], k)
        elif not isinstance(got, TierIOError):
            assert torch.equal(got[0], k)  # a block written before its key failed
    keyed = tier.keyed_slots()
    tier._index.db.execute("PRAGMA max_page_count=1073741823")
    tier.close()
    tier = _open(tmp_path, n=64)
    assert tier.keyed_slots() == keyed
    _check(tier, {s: (k, v) for s in keyed}, set())
    tier.close()


_FSIZE_CHILD = textwrap.dedent(
    """
    import json, os, resource, signal, sys, torch
    from kvstrata.core.errors import TierIOError
    from kvstrata.core.layout import BlockLayout
    from kvstrata.tiers.disk import DiskTier
    root = sys.argv[1]
    layout = BlockLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4)
    tier = DiskTier(layout, 16, os.path.join(root, "a"))  # before the limit
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (120_000, resource.RLIM_INFINITY))
    out = {}
    try:
        DiskTier(layout, 1000, os.path.join(root, "b"))  # a 4 MiB arena
    except TierIOError as exc:
        out["create"] = [type(exc).__name__, str(exc)]
    g = torch.Generator().manual_seed(0)
    k = torch.randn(layout.raw_shape("k", 1), generator=g)
    v = torch.randn(layout.raw_shape("v", 1), generator=g)
    keyed = []
    for i in range(5000):
        slot = i % 16
        try:
            tier.write_blocks([slot], k, v)
            tier.put_key(slot, b"%d-" % i + b"z" * 1000, list(range(500)))
        except TierIOError as exc:
            out["write"] = [type(exc).__name__, str(exc)]
            break
        keyed.append(slot)
    out["keyed"] = sorted(tier.keyed_slots())
    try:
        tier.close()
    except TierIOError as exc:
        out["close"] = [type(exc).__name__, str(exc)]
    resource.setrlimit(resource.RLIMIT_FSIZE, (1000, resource.RLIM_INFINITY))
    try:  # the index cannot even be created
        DiskTier(layout, 4, os.path.join(root, "c"))
    except TierIOError as exc:
        out["open"] = [type(exc).__name__, str(exc)]
    print(json.dumps(out))
    """
)


def test_size_limited_filesystem_subprocess(tmp_path):
    """RLIMIT_FSIZE: arena creation and index growth past the limit are typed errors;
    the blocks keyed before are intact after a reopen."""
    out = json.loads(_run_child(_FSIZE_CHILD, tmp_path).strip().splitlines()[-1])
    assert out["create"][0] == "TierFullError", out
    assert out["write"][0] in ("TierFullError", "TierIOError"), out
    assert out["open"][0] in ("TierFullError", "TierIOError"), out
    for _, msg in (out["create"], out["write"], out["open"]):
        assert "\n" not in msg and str(tmp_path) in msg and "sqlite3." not in msg
    tier = DiskTier(LAYOUT, 16, tmp_path / "a")
    k, v = _blocks(1)
    keyed = set(tier.keyed_slots())
    assert keyed <= set(out["keyed"]) or "close" in out
    _check(tier, {s: (k, v) for s in keyed}, set())
    tier.close()


def test_an_arena_larger_than_the_free_space_is_refused_before_allocating(tmp_path, monkeypatch):
    """A disk budget past the free space: TierFullError before anything is allocated,
    and no arena file is left behind (a failed fallocate keeps what it allocated: one
    left 67 GB behind on this machine before the check)."""
    from kvstrata.tiers import disk_io

    real = os.statvfs

    def little_free(path):  # 64 KiB free, whatever the machine has
        st = real(path)
        return os.statvfs_result((*st[:4], 65536 // st.f_frsize, *st[5:]))

    monkeypatch.setattr(disk_io.os, "statvfs", little_free)
    with pytest.raises(TierFullError, match="does not fit in the 65536 bytes free") as info:
        DiskTier(LAYOUT, 1000, tmp_path / "big")  # 1000 blocks of 1.5 KiB
    assert "\n" not in str(info.value)
    assert not (tmp_path / "big" / "blocks.bin").exists()
    # an arena that is there already at its size needs no free space to reopen (a
    # sparse one on a filesystem without fallocate included)
    monkeypatch.undo()
    DiskTier(LAYOUT, 1000, tmp_path / "sparse").close()
    arena = tmp_path / "sparse" / "blocks.bin"
    size = arena.stat().st_size
    os.truncate(arena, 0)
    os.truncate(arena, size)  # all holes
    monkeypatch.setattr(disk_io.os, "statvfs", little_free)
    DiskTier(LAYOUT, 1000, tmp_path / "sparse").close()


def test_a_fallocate_that_fails_midway_gives_back_what_it_allocated(tmp_path, monkeypatch):
    """posix_fallocate that allocates part of the arena and then fails (ENOSPC after
    the free-space check, e.g. another writer): a new arena is removed, an existing one
    is cut back to its old size."""
    from kvstrata.tiers import disk_io

    def partial(fd, offset, size):
        os.ftruncate(fd, size // 2)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_io.os, "posix_fallocate", partial)
    with pytest.raises(TierFullError):
        DiskTier(LAYOUT, 64, tmp_path / "new")
    assert not (tmp_path / "new" / "blocks.bin").exists()
    monkeypatch.undo()
    tier = DiskTier(LAYOUT, 8, tmp_path / "old")
    k, v = _blocks(1)
    tier.write_blocks([3], k, v)
    tier.put_key(3, b"h" * 16, [1, 2])  # keyed: kept across a reopen
    tier.close()
    size = (tmp_path / "old" / "blocks.bin").stat().st_size
    monkeypatch.setattr(disk_io.os, "posix_fallocate", partial)
    with pytest.raises(TierFullError):
        DiskTier(LAYOUT, 64, tmp_path / "old")  # a larger budget over the same directory
    assert (tmp_path / "old" / "blocks.bin").stat().st_size == size
    monkeypatch.undo()
    tier = DiskTier(LAYOUT, 8, tmp_path / "old")  # the old blocks are still there
    _check(tier, {3: (k, v)}, set())
    tier.close()


# -- processes ----------------------------------------------------------------------------
def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT / "src"), PYTHONHASHSEED="0")


def _run_child(code: str, *args) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


_HOLDER = textwrap.dedent(
    """
    import sys
    from kvstrata.core.errors import TierIOError
    from kvstrata.core.layout import BlockLayout
    from kvstrata.tiers.disk import DiskTier
    layout = BlockLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4)
    print("imported", flush=True)
    sys.stdin.readline()  # "go"
    try:
        tier = DiskTier(layout, 6, sys.argv[1])
    except TierIOError as exc:
        print("refused", exc, flush=True)
    else:
        print("holding", flush=True)
    sys.stdin.readline()  # "exit", or killed
    """
)


def _spawn(code: str, *args) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code, *map(str, args)],
        env=_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_two_processes_one_directory_second_is_refused(tmp_path):
    """Contract: one owner per directory. Two processes race for it: exactly one
    gets it, the other (and this process) is refused with the holder's pid and host;
    after the holder is killed (-9) the stale lock file does not block."""
    procs = [_spawn(_HOLDER, tmp_path) for _ in range(2)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "imported", p.stderr.read()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        answers = [p.stdout.readline().strip() for p in procs]
        holders = [p for p, a in zip(procs, answers, strict=True) if a == "holding"]
        assert len(holders) == 1, answers
        holder = holders[0]
        for a in answers:
            if a != "holding":
                assert a.startswith("refused") and f"process {holder.pid}" in a, a
        with pytest.raises(TierIOError) as info:
            DiskTier(LAYOUT, 6, tmp_path)
        msg = str(info.value)
        assert _typed(info.value)
        assert f"process {holder.pid} on host {socket.gethostname()}" in msg, msg
        assert "use another disk_dir" in msg and LOCK_FILE in msg
        holder.kill()  # SIGKILL: the kernel drops its lock
        holder.wait(timeout=30)
        assert (tmp_path / LOCK_FILE).exists()
        tier = DiskTier(LAYOUT, 6, tmp_path)
        tier.close()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
            for f in (p.stdin, p.stdout, p.stderr):
                f.close()


def test_second_tier_in_one_process_is_refused_until_closed(tmp_path):
    tier = _open(tmp_path)
    with pytest.raises(TierIOError, match="in use by this process") as info:
        _open(tmp_path)
    assert _typed(info.value)
    tier.close()
    tier = _open(tmp_path)
    tier.close()


def test_forked_child_neither_holds_the_lock_nor_uses_the_tier(tmp_path):
    """A fork of the owner (a multiprocessing worker, say): the owner keeps the lock,
    the child cannot use the inherited tier nor open the directory, and once the owner
    closes, the directory is free even though the child is still alive."""
    tier = _open(tmp_path)
    want = _fill(tier)
    k, v = _blocks(1)
    go_r, go_w = os.pipe()
    res_r, res_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then wait until told to exit
        code = 0
        try:
            try:
                tier.read_blocks([0], k, v)
                code |= 1
            except TierIOError as exc:
                code |= 0 if "after a fork" in str(exc) else 2
            try:
                DiskTier(LAYOUT, N_SLOTS, tmp_path)
                code |= 4
            except TierIOError as exc:
                code |= 0 if f"process {os.getppid()}" in str(exc) else 8
            tier.close()  # a no-op in the child: the files are the owner's
            os.write(res_w, bytes([code]))
            os.read(go_r, 1)
        finally:
            os._exit(0)
    try:
        assert os.read(res_r, 1) == b"\0"
        _check(tier, want, set())  # the owner's tier is untouched
        with pytest.raises(TierIOError, match="in use"):
            _open(tmp_path)
        tier.close()
        tier = _open(tmp_path)  # the child is alive and holds nothing
        _check(tier, want, set())
        tier.close()
    finally:
        os.write(go_w, b"x")
        os.waitpid(pid, 0)
        for fd in (go_r, go_w, res_r, res_w):
            os.close(fd)


def test_tier_dropped_without_close_releases_everything(tmp_path):
    fds = len(os.listdir("/proc/self/fd"))
    tier = _open(tmp_path)
    tier.cycle = tier  # a reference cycle: only the garbage collector frees it
    _fill(tier)
    del tier
    tier = _open(tmp_path)  # the lock of the unreachable tier is collected
    tier.close()
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == fds


_KILL_LAUNCHER = textwrap.dedent(
    """
    import os, random, signal, sys, time
    import torch
    from kvstrata.core.layout import BlockLayout
    from kvstrata.tiers.disk import DiskTier
    layout = BlockLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4)
    n = 12

    def say(*words):  # one write(2) of < PIPE_BUF bytes: a kill never cuts a line
        os.write(1, (" ".join(map(str, words)) + "\\n").encode())

    def write_forever(seed):
        tier = DiskTier(layout, n, sys.argv[1])
        rng = random.Random(seed)
        say("ready")
        gen = seed * 100000
        while True:
            gen += 1
            slots = rng.sample(range(n), rng.randint(1, 5))
            g = torch.Generator().manual_seed(gen)
            k = torch.randn(layout.raw_shape("k", len(slots)), generator=g)
            v = torch.randn(layout.raw_shape("v", len(slots)), generator=g)
            say("begin", gen, *slots)
            tier.write_blocks(slots, k, v)
            keys = [(s, b"%d:%d" % (gen, j), [gen, len(slots), j]) for j, s in enumerate(slots)]
            tier.put_keys(keys)
            say("done", gen, *slots)

    # one import of torch; each round forks a writer (no threads exist before the fork)
    for line in sys.stdin:
        seed, delay = int(line.split()[0]), float(line.split()[1])
        pid = os.fork()
        if pid == 0:
            try:
                if seed % 2:
                    os.environ["KVSTRATA_NATIVE"] = "0"  # the staged path, same format
                write_forever(seed)
            finally:
                os._exit(1)
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        say("killed")
    """
)


def _expected(gen: int, n: int, j: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(gen)
    k = torch.randn(LAYOUT.raw_shape("k", n), generator=g)
    v = torch.randn(LAYOUT.raw_shape("v", n), generator=g)
    return _block(k, v, j)


def _lines_until_killed(proc: subprocess.Popen, timeout: float = 60.0) -> list[str]:
    """The lines the launcher's writer printed in this round, up to "killed"."""
    fd, buf = proc.stdout.fileno(), b""
    deadline = time.monotonic() + timeout
    while not (buf == b"killed\n" or buf.endswith(b"\nkilled\n")):
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, f"the launcher is stuck after {buf[-200:]!r}"
        chunk = os.read(fd, 1 << 16)
        assert chunk, proc.stderr.read()
        buf += chunk
    return buf.decode().split("\n")[:-2]


def test_kill_9_writer_at_random_points_then_reopen(tmp_path):
    """Contract: after a crash every keyed block reads back exactly, and every block
    whose commit was reported survives unless the writer had begun rewriting it."""
    rng = random.Random(1234)
    last: dict[int, int] = {}  # slot -> gen of its last reported commit
    launcher = _spawn(_KILL_LAUNCHER, tmp_path)
    try:
        for round_ in range(8):
            launcher.stdin.write(f"{round_ + 1} {rng.uniform(0.0, 0.25)}\n")
            launcher.stdin.flush()
            in_flight: set[int] = set()
            for line in _lines_until_killed(launcher):
                if line == "ready":
                    continue
                word, gen, *slots = line.split()
                if word == "begin":
                    in_flight = set(map(int, slots))
                else:
                    for s in map(int, slots):
                        last[s] = int(gen)
                    in_flight = set()
            tier = DiskTier(LAYOUT, 12, tmp_path)
            keyed = tier.keyed_slots()
            for slot in keyed:
                (_, ids) = tier.lookup(keyed[slot])
                want = _expected(*ids)
                got = _read(tier, slot)
                assert not isinstance(got, TierIOError), got
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            for slot, gen in last.items():
                if slot in in_flight:
                    continue
                assert slot in keyed, (round_, slot, gen)
                assert tier.lookup(keyed[slot])[1][0] == gen
            for slot in in_flight:  # being rewritten: the old block, the new one, or none
                if slot in keyed:
                    last[slot] = tier.lookup(keyed[slot])[1][0]
                else:
                    last.pop(slot, None)
            tier.close()
        assert last, "the writers never committed anything"
    finally:
        launcher.stdin.close()
        launcher.wait(timeout=60)
        launcher.stdout.close()
        launcher.stderr.close()


# -- resources ----------------------------------------------------------------------------
def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def test_thousand_open_use_close_cycles_leak_nothing(tmp_path):
    """Contract: close() releases the arena, the index and the lock; nothing is left
    after close + rmtree; descriptors and RSS stay flat (failed opens included).
    On tmpfs when there is one: this is about leaks, not about fsync latency."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        tmp_path = Path(tempfile.mkdtemp(dir=shm))
    try:
        _cycles(tmp_path)
    finally:
        if tmp_path.parent == shm:
            shutil.rmtree(tmp_path, ignore_errors=True)


def _cycles(tmp_path: Path) -> None:
    k, v = _blocks(2)
    ko, vo = torch.empty_like(k), torch.empty_like(v)

    def cycle(i: int) -> None:
        d = tmp_path / f"c{i % 3}"
        tier = DiskTier(LAYOUT, 4, d)
        tier.write_blocks([1, 2], k, v)
        tier.put_key(1, b"k", [1])
        tier.read_blocks([1, 2], ko, vo)
        if i % 50 == 0:  # failed opens release what they took
            with pytest.raises(TierIOError):
                DiskTier(LAYOUT, 4, d)
        if i % 50 == 25:
            tier.close()
            with pytest.raises(ConfigError, match="layout"):
                DiskTier(BlockLayout(3, 2, 8, 8), 4, d)
        tier.close()
        tier.close()
        if i % 100 == 1:
            (d / INDEX_FILE).write_bytes(b"garbage" * 600)
            with pytest.raises(TierIOError):
                DiskTier(LAYOUT, 4, d)
        shutil.rmtree(d)

    for i in range(100):  # warm up allocators and caches
        cycle(i)
    gc.collect()
    fds, rss = len(os.listdir("/proc/self/fd")), _rss()
    for i in range(1000):
        cycle(i)
        if i % 250 == 0:
            assert len(os.listdir("/proc/self/fd")) == fds, i
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == fds
    assert _rss() <= rss * 1.05, (rss, _rss())
    # nothing stays allocated after rmtree: no descriptor or mapping of a deleted file
    assert not held_deleted_files(tmp_path)


# -- misc typed errors --------------------------------------------------------------------
def test_read_side_os_error_is_typed(tmp_path):
    tier = _open(tmp_path)
    want = _fill(tier)
    wronly = os.open(tmp_path / "wo", os.O_WRONLY | os.O_CREAT, 0o644)
    arena = tier._fd
    tier._fd = tier._file.dfd = wronly  # reads fail with EBADF
    try:
        with pytest.raises(TierIOError, match="I/O error while reading") as info:
            _read_raw(tier, 0)
        assert _typed(info.value)
    finally:
        tier._fd = tier._file.dfd = arena
        os.close(wronly)
    _check(tier, want, set())
    tier.close()


def _read_raw(tier: DiskTier, slot: int) -> None:
    k = torch.empty(LAYOUT.raw_shape("k", 1))
    tier.read_blocks([slot], k, torch.empty_like(k))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"io_threads": True}, "io_threads=True"),
        ({"io_threads": 0}, "io_threads=0"),
        ({"checksum": "md5"}, "checksum='md5'"),
    ],
)
def test_bad_arguments_are_config_errors(tmp_path, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        DiskTier(LAYOUT, 4, tmp_path, **kwargs)
    assert not (tmp_path / LOCK_FILE).exists()  # refused before touching the disk


@pytest.mark.parametrize("directory", ["", 123, None])
def test_bad_directory_is_a_config_error(directory):
    with pytest.raises(ConfigError, match="disk_dir"):
        DiskTier(LAYOUT, 4, directory)


def test_closed_tier_is_typed(tmp_path):
    tier = _open(tmp_path)
    _fill(tier)
    tier.close()
    k, v = _blocks(1)
    for op in (
        lambda: tier.read_blocks([0], k, v),
        lambda: tier.write_blocks([0], k, v),
        lambda: tier.put_key(0, b"z", [0]),
        lambda: tier.free([0]),
    ):
        with pytest.raises(TierIOError, match="closed"):
            op()
    assert np.all(tier._index.written[:N_SLOTS])  # nothing changed
