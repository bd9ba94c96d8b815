"""DiskTier's arena file, blocks.bin: its descriptors, sizing, O_DIRECT, staging
buffers, and the block read and write paths: in place (disk_vectored), staged
(pread/pwrite per run of consecutive slots) and compressed (one packed extent per
slot). Writes return the checksums the index records; reads verify against them.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from kvstrata.core.errors import ConfigError, TierFullError, TierIOError
from kvstrata.core.slots import slot_runs
from kvstrata.tiers.disk_errors import os_error, slot_list, tier_error
from kvstrata.tiers.disk_format import (
    SLOT_ALIGN,
    Checksum,
    SlotFormat,
    aligned_empty,
    exchange,
    round_up,
)
from kvstrata.tiers.disk_index import DiskIndex
from kvstrata.tiers.disk_vectored import VectoredIO

# I/O per chunk: amortizes Python overhead; small enough that a chunk just read is
# still in L2/L3 when its checksum is computed.
CHUNK_BYTES = 8 << 20
# The native path batches and checksums inside one call: chunks only bound the
# staging buffer and the per-call planning arrays.
NATIVE_CHUNK_BYTES = 64 << 20

Fields = Callable[[str, int, int], torch.Tensor]
"""fields(key, i0, i1): encoded field `key` of blocks i0..i1 as [L, Hkv, (i1-i0)*rows, cols]."""
Targets = Callable[[int, int], tuple[dict[str, torch.Tensor], Callable[[], None]]]
"""targets(i0, i1): (field tensors to read blocks i0..i1 into, what to run once verified)."""


def free_bytes(directory: Path) -> int:
    """Bytes an unprivileged writer may still use on the filesystem of `directory`
    (its nearest existing ancestor)."""
    while not directory.exists() and directory != directory.parent:
        directory = directory.parent
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def check_free_space(path: Path, size: int) -> None:
    """TierFullError when an arena of `size` bytes at `path` (grown from the file there,
    if any) cannot fit in the free space."""
    try:
        have = path.stat().st_size
    except OSError:
        have = 0
    try:
        free = free_bytes(path.parent)
    except OSError:
        return  # no statvfs here: the allocation itself will tell
    if size - have > free:
        raise tier_error(
            TierFullError,
            f"an arena of {size} bytes does not fit in the {free} bytes free "
            f"(No space left on device): free space on that filesystem or lower disk_budget",
            path,
            [],
        )


class BlockFile:
    """The arena file of a DiskTier and every move of block bytes through it.

    Args:
        path: the arena file (opened by `open`).
        fmt: the slot format.
        num_slots: slots in the arena.
        index: the tier's index (stored checksums and lengths, read to verify).
        checksum: the tier's checksum.
        native: the native library, or None.
        compressor: (compress, decompress), or None to store layers as they are.
        load_compressor: returns (compress, decompress): reads compressed slots of a
            tier opened without `compressor`.
        io_threads: threads for one native call, and for the compressed slots of one
            read (decompression releases the GIL).
        o_direct: move block data through a second, O_DIRECT descriptor.
    """

    def __init__(
        self,
        path: Path,
        fmt: SlotFormat,
        num_slots: int,
        index: DiskIndex,
        checksum: Checksum,
        native: object | None,
        compressor: tuple | None,
        load_compressor: Callable[[], tuple],
        io_threads: int,
        o_direct: bool,
    ) -> None:
        self.path = path
        self.fmt = fmt
        self.size = num_slots * fmt.slot_bytes
        self.index = index
        self.checksum = checksum
        self.native = native
        self.compressor = compressor
        self.load_compressor = load_compressor
        self.o_direct = o_direct
        self.fd = -1  # the arena
        self.created = False  # open() created the file (a failed sizing removes it)
        self.dfd = -1  # the descriptor block data moves through (O_DIRECT or fd)
        self._local = threading.local()
        self.io_threads = io_threads
        self._pool: ThreadPoolExecutor | None = None  # for compressed reads, made on use
        self._vec = (
            None
            if native is None
            else VectoredIO(fmt, native, io_threads, index.sums, self.io_error)
        )
        # chunks move in place through the native kernels (which compute XXH3-64)
        self.direct = (
            self._vec is not None and checksum.native and compressor is None and not o_direct
        )

    # -- file -------------------------------------------------------------------------
    def open(self) -> int | None:
        """Open the arena, creating it if needed; returns its size before, or None
        when it did not exist."""
        try:
            try:
                self.fd = os.open(self.path, os.O_RDWR)
            except FileNotFoundError:
                self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                self.dfd = self.fd
                self.created = True
                return None
            self.dfd = self.fd
            return os.fstat(self.fd).st_size
        except OSError as exc:
            raise self.io_error(exc, [], "opening the arena") from exc

    def prepare(self, old_size: int) -> None:
        """Size the arena (`old_size`: its size when opened) and open the O_DIRECT
        descriptor if asked."""
        self._allocate(old_size)
        if self.o_direct:
            self.dfd = self._open_direct()

    def _allocate(self, old_size: int) -> None:
        size = self.size
        try:
            if old_size > size:
                os.ftruncate(self.fd, size)
            elif hasattr(os, "posix_fallocate"):
                # (DiskTier checked the free space before: check_free_space)
                try:
                    os.posix_fallocate(self.fd, 0, size)
                except OSError as exc:
                    if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                        raise
                    self._truncate_checked(size)
            else:
                self._truncate_checked(size)
        except OSError as exc:
            self._undo_growth(old_size)
            raise self.io_error(exc, [], f"creating a {size}-byte arena") from exc

    def _undo_growth(self, old_size: int) -> None:
        """A failed sizing gives back what it allocated: the arena as it was, and one
        this open created is removed (no half-allocated file left filling the disk)."""
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, old_size)
        if self.created:
            with contextlib.suppress(OSError):
                os.unlink(self.path)

    def _check_space(self, growth: int) -> None:
        if growth > 0 and free_bytes(self.path.parent) < growth:
            raise OSError(errno.ENOSPC, "not enough free space")

    def _open_direct(self) -> int:
        try:
            return os.open(self.path, os.O_RDWR | os.O_DIRECT)
        except OSError as exc:
            raise ConfigError.field(
                "o_direct",
                True,
                f"the filesystem of {str(self.path.parent)!r} refuses O_DIRECT "
                f"({exc.strerror}); use another directory (tmpfs has no O_DIRECT) or "
                "o_direct=False",
            ) from exc

    def _truncate_checked(self, size: int) -> None:
        # No fallocate on this filesystem: a sparse file, with a free-space check.
        self._check_space(size - os.fstat(self.fd).st_size)
        os.ftruncate(self.fd, size)

    def drop_cache(self) -> None:
        """Flush the arena and ask the kernel to drop its cached pages (cold reads)."""
        self.check_linked([], TierIOError)
        try:
            os.fdatasync(self.fd)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError as exc:
            raise self.io_error(exc, [], "flushing the arena") from exc

    def sync(self) -> None:
        """fdatasync the arena (TierIOError on failure)."""
        try:
            os.fdatasync(self.fd)
        except OSError as exc:
            raise self.io_error(exc, [], "flushing the arena") from exc

    def close(self, sync: bool) -> None:
        """Close both descriptors, after fdatasync if `sync` (idempotent). The
        descriptors are closed even when the flush fails (then TierIOError)."""
        dfd, self.dfd = self.dfd, -1
        fd, self.fd = self.fd, -1
        self._local = threading.local()  # drop the staging buffers
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        failure = None
        if fd >= 0 and sync:
            try:
                os.fdatasync(fd)
            except OSError as exc:
                failure = exc
        for f in {dfd, fd}:
            if f >= 0:
                try:
                    os.close(f)
                except OSError as exc:
                    failure = failure or exc
        if failure is not None:
            raise self.io_error(failure, [], "closing the arena") from failure

    # -- errors -----------------------------------------------------------------------
    def error(
        self, cls: type[TierIOError], msg: str, slots: list[int] | None = None
    ) -> TierIOError:
        return tier_error(cls, msg, self.path, slots)

    def io_error(self, exc: OSError, slots: list[int], what: str) -> TierIOError:
        return os_error(exc, self.path, slots, what)

    def check_linked(self, slots: list[int], cls: type[TierIOError]) -> None:
        """Raise `cls` when the arena was deleted or replaced (or the tier closed). An
        unlinked arena still reads back through our fd, but it is no longer durable:
        report it instead of silently serving from a ghost file."""
        if self.fd < 0:
            raise self.error(TierIOError, "the disk tier is closed: open a new one", slots)
        try:
            gone = os.fstat(self.fd).st_nlink == 0
        except OSError as exc:
            raise self.io_error(exc, slots, "checking the arena") from exc
        if gone:
            raise self.error(
                cls,
                "arena file was deleted or replaced while open, its blocks are gone: close "
                "this tier (a new one on the directory starts empty)",
                slots,
            )

    # -- staging ----------------------------------------------------------------------
    def _staging(self, nbytes: int) -> np.ndarray:
        """A per-thread reusable uint8 buffer (fresh buffers cost page faults),
        4 KiB-aligned (O_DIRECT needs aligned memory)."""
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.size < nbytes:
            buf = aligned_empty(max(nbytes, CHUNK_BYTES + self.fmt.slot_bytes), SLOT_ALIGN)
            self._local.buf = buf
        return buf[:nbytes]

    def _chunks(self, n: int, item_bytes: int) -> Iterator[tuple[int, int]]:
        step = max(1, (NATIVE_CHUNK_BYTES if self.direct else CHUNK_BYTES) // item_bytes)
        for i0 in range(0, n, step):
            yield i0, min(n, i0 + step)

    # -- low-level I/O ----------------------------------------------------------------
    def _pwrite(self, data: np.ndarray, offset: int, slots: list[int]) -> None:
        view = memoryview(data).cast("B")
        done = 0
        try:
            while done < len(view):
                done += os.pwrite(self.dfd, view[done:], offset + done)
        except OSError as exc:
            raise self.io_error(exc, slots, f"writing slots {slot_list(slots)}") from exc

    def _pread(self, out: np.ndarray, offset: int, slots: list[int]) -> bool:
        """Fill `out` from `offset`; False when the file ends first (truncated).
        With O_DIRECT, an unaligned range is read as the aligned pages around it."""
        try:
            return self._pread_raw(out, offset)
        except OSError as exc:
            raise self.io_error(exc, slots, f"reading slots {slot_list(slots)}") from exc

    def _pread_raw(self, out: np.ndarray, offset: int) -> bool:
        if self.o_direct and (offset % SLOT_ALIGN or out.nbytes % SLOT_ALIGN):
            a = offset - offset % SLOT_ALIGN
            b = round_up(offset + out.nbytes, SLOT_ALIGN)
            pages = aligned_empty(b - a, SLOT_ALIGN)
            if not self._pread_raw(pages, a):
                return False
            out.reshape(-1)[:] = pages[offset - a : offset - a + out.nbytes]
            return True
        view = memoryview(out).cast("B")
        done = 0
        while done < len(view):
            got = os.preadv(self.dfd, [view[done:]], offset + done)
            if got == 0:
                return False
            done += got
        return True

    # -- write ------------------------------------------------------------------------
    def write(self, slots: list[int], fields: Fields) -> tuple[np.ndarray, np.ndarray]:
        """Stage (or view in place), checksum and write blocks; `fields(key, i0, i1)`
        gives the chunk's encoded field `key` as [L, Hkv, (i1-i0)*rows, cols]. Returns
        the per-layer checksums and stored lengths [len(slots), L] for the index."""
        fmt, n = self.fmt, len(slots)
        L, lb, sb = fmt.num_layers, fmt.layer_bytes, fmt.slot_bytes
        sums = np.empty((n, L), dtype=np.uint64)
        lens = np.full((n, L), lb, dtype=np.int64)
        for i0, i1 in self._chunks(n, sb):
            c, chunk = i1 - i0, slots[i0:i1]
            full = self._staging(c * sb).reshape(c, sb)
            stag_np = full[:, : L * lb].reshape(c, L, lb)
            if self.direct:
                src = {key: fields(key, i0, i1) for key in fmt.regions}
                sums[i0:i1] = self._vec.write(self.fd, chunk, src, full, stag_np)
                continue
            full[:] = 0  # padding is written as zeros, as on the direct path
            for key in fmt.regions:
                exchange(fmt.field_bytes(stag_np, key), fields(key, i0, i1), True)
            if self.compressor is None:
                sums[i0:i1] = self.checksum.rows(stag_np)
                for j, first, count in slot_runs(chunk):
                    self._pwrite(full[j : j + count], first * sb, chunk)
            else:
                for j, slot in enumerate(chunk):
                    sums[i0 + j], lens[i0 + j] = self._write_compressed(slot, full[j])
        return sums, lens

    def _write_compressed(self, slot: int, stag_slot: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        compress, _ = self.compressor
        L, lb = self.fmt.num_layers, self.fmt.layer_bytes
        parts, sums, lens = [], np.empty(L, dtype=np.uint64), np.empty(L, dtype=np.int64)
        for layer in range(L):
            raw = stag_slot[layer * lb : (layer + 1) * lb]
            packed = np.frombuffer(compress(raw, self.fmt.elem_size), dtype=np.uint8)
            part = packed if len(packed) < lb else raw  # incompressible: store as is
            parts.append(part)
            sums[layer], lens[layer] = self.checksum.one(part), len(part)
        self._pwrite(np.concatenate(parts), slot * self.fmt.slot_bytes, [slot])
        return sums, lens

    # -- read -------------------------------------------------------------------------
    def read(
        self, slots: list[int], layer: int | None, targets: Targets
    ) -> tuple[list[int], list[int]]:
        """Read and verify blocks (one layer of them if `layer` is given) into the field
        tensors `targets(i0, i1)` gives for each chunk. Returns the slots found missing
        (file too short) and corrupt (checksum mismatch); their bytes are not served."""
        fmt, n = self.fmt, len(slots)
        lb = fmt.layer_bytes
        nl = fmt.num_layers if layer is None else 1
        idx = np.asarray(slots)
        missing: list[int] = []
        corrupt: list[int] = []
        item_bytes = fmt.slot_bytes if layer is None else lb
        for i0, i1 in self._chunks(n, item_bytes):
            c = i1 - i0
            full = self._staging(c * item_bytes).reshape(c, item_bytes)
            stag_np = full[:, : nl * lb].reshape(c, nl, lb)
            chunk = slots[i0:i1]
            if self.direct and not (self.index.lens[idx[i0:i1]] < lb).any():
                dest, finish = targets(i0, i1)
                if self._vec.read(self.fd, chunk, layer, dest, full, stag_np, missing, corrupt):
                    finish()
                continue
            if not self._read_chunk(chunk, layer, full, stag_np, missing, corrupt):
                continue
            dest, finish = targets(i0, i1)
            staged = stag_np if layer is None else stag_np[:, 0]
            for key in fmt.regions:
                exchange(fmt.field_bytes(staged, key), dest[key], False)
            finish()
        return missing, corrupt

    def _read_chunk(
        self,
        chunk: list[int],
        layer: int | None,
        full: np.ndarray,
        stag_np: np.ndarray,
        missing: list[int],
        corrupt: list[int],
    ) -> bool:
        """Read and verify `chunk` into `full` [c, slot or layer bytes], viewed as
        stag_np [c, nl, lb]. Appends bad slots to missing/corrupt; False if any."""
        lb, sb = self.fmt.layer_bytes, self.fmt.slot_bytes
        bad_before = len(missing) + len(corrupt)
        idx = np.asarray(chunk)
        packed = (self.index.lens[idx] < lb).any(axis=1)
        if layer is None:  # whole blocks: one pread per run of consecutive slots
            for j, first, count in slot_runs(chunk):
                if packed[j : j + count].any():
                    continue  # runs with a compressed slot are read slot by slot below
                if not self._pread(full[j : j + count], first * sb, chunk[j : j + count]):
                    missing.extend(chunk[j : j + count])
        else:
            for j in np.flatnonzero(~packed):
                if not self._pread(full[j], chunk[j] * sb + layer * lb, [chunk[j]]):
                    missing.append(chunk[j])
        self._read_all_packed(chunk, np.flatnonzero(packed), layer, stag_np, missing, corrupt)
        plain = np.flatnonzero(~packed)
        if len(plain):
            layers = slice(None) if layer is None else slice(layer, layer + 1)
            got = self.checksum.rows(stag_np if len(plain) == len(chunk) else stag_np[plain])
            want = self.index.sums[idx[plain]][:, layers]
            bad = {chunk[plain[j]] for j in np.flatnonzero((got != want).any(axis=1))}
            corrupt.extend(s for s in chunk if s in bad and s not in missing)
        return len(missing) + len(corrupt) == bad_before

    def _read_all_packed(
        self,
        chunk: list[int],
        picks: np.ndarray,
        layer: int | None,
        stag_np: np.ndarray,
        missing: list,
        corrupt: list,
    ) -> None:
        """`_read_packed` for the slots chunk[j], j in `picks`, split over up to
        io_threads threads (each slot has its own rows; the bad ones are appended in
        slot order, as one thread would)."""
        num_groups = min(self.io_threads, len(picks))
        if num_groups < 2:
            for j in picks:
                self._read_packed(chunk[j], layer, stag_np[j], missing, corrupt)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix="kvstrata-unzip")
        found: list[tuple[list, list]] = []

        def read(group: np.ndarray) -> None:
            bad: tuple[list, list] = ([], [])
            found.append(bad)
            for j in group:
                self._read_packed(chunk[j], layer, stag_np[j], *bad)

        list(self._pool.map(read, np.array_split(picks, num_groups)))  # re-raises a failure
        order = {slot: i for i, slot in enumerate(chunk)}
        missing.extend(sorted((s for m, _ in found for s in m), key=order.__getitem__))
        corrupt.extend(sorted((s for _, c in found for s in c), key=order.__getitem__))

    def _read_packed(
        self, slot: int, layer: int | None, out: np.ndarray, missing: list, corrupt: list
    ) -> None:
        _, decompress = self.compressor or self.load_compressor()
        lens, lb = self.index.lens[slot], self.fmt.layer_bytes
        offs = np.concatenate([[0], np.cumsum(lens)])
        layers = range(len(lens)) if layer is None else [layer]
        lo, hi = offs[layers[0]], offs[layers[-1] + 1]
        raw = np.empty(hi - lo, dtype=np.uint8)
        if not self._pread(raw, slot * self.fmt.slot_bytes + int(lo), [slot]):
            missing.append(slot)
            return
        for i, layer_i in enumerate(layers):
            part = raw[offs[layer_i] - lo : offs[layer_i + 1] - lo]
            if self.checksum.one(part) != int(self.index.sums[slot, layer_i]):
                corrupt.append(slot)
                return
            if len(part) == lb:
                out[i] = part
            else:
                decompress(part, out[i])
