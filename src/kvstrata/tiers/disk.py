"""DiskTier: a durable file arena of block slots, with an index and per-layer checksums.

Files in `directory`:

    blocks.bin     the arena, preallocated at creation: num_slots * slot_bytes
    index.sqlite   meta (layout, codec, checksum) + one row per written slot:
                   (slot, checksum per layer, stored bytes per layer, key, token ids)

Slot layout (one block = one contiguous extent, so a whole-block move is one pread
or pwrite per run of consecutive slots, and one layer of one block is one pread):

    slot s at s*slot_bytes:
      | layer 0                             | layer 1 | ... | pad to 4 KiB |
      | k.f0 [Hkv,rows,cols] | k.f1 | v.f0 |
        each field region padded to 16 bytes (so it can be viewed as its dtype)

With `compress=True` each (block, layer) slice is compressed on its own and the
layers are packed from the start of the slot (layer l at the sum of the stored
lengths before it). The slot size stays the uncompressed size: compression saves
bandwidth (bytes read and written), not disk space.

Crash safety: a rewritten slot loses its index row before its new data is written,
and the new row is committed only after the data. So a crash leaves either no row
(the slot is free on reopen) or a row whose checksums cover what was written; a
torn write fails its checksum. Reads verify every layer they return and raise
BlockCorruptError / BlockMissingError (TierIOError, with `.slots` and `.filename`)
instead of returning wrong data; ENOSPC raises TierFullError. On reopen, keyed slots
(`put_key`) are found again and marked used; unkeyed slots are free.
"""

from __future__ import annotations

import errno
import json
import os
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from kvstrata._native import load as load_native
from kvstrata.codecs.base import Codec, NoneCodec
from kvstrata.errors import (
    BlockCorruptError,
    BlockMissingError,
    ConfigError,
    TierFullError,
    TierIOError,
)
from kvstrata.layout import KINDS, BlockLayout
from kvstrata.tiers.base import Encoded, Tier
from kvstrata.tiers.disk_format import (
    CHECKSUMS,
    Checksum,
    Template,
    aligned_empty,
    build_template,
    direct_view,
    iovecs,
    load_compressor,
    native_io,
    round_up,
    vector_io,
)

__all__ = ["ARENA_FILE", "CHECKSUMS", "DiskTier", "FORMAT_VERSION", "INDEX_FILE"]

FORMAT_VERSION = 1  # bump when the slot layout or the index schema changes
ARENA_FILE = "blocks.bin"
INDEX_FILE = "index.sqlite"
# I/O per chunk: amortizes Python overhead; small enough that a chunk just read is
# still in L2/L3 when its checksum is computed.
CHUNK_BYTES = 8 << 20
# The native path batches and checksums inside one call: chunks only bound the
# staging buffer and the per-call planning arrays.
NATIVE_CHUNK_BYTES = 64 << 20
_FIELD_ALIGN = 16
_SLOT_ALIGN = 4096
_load_compressor = load_compressor  # module attribute: tests substitute a stand-in


class DiskTier(Tier):
    """A tier whose slots live in one preallocated file, indexed in sqlite.

    Args:
        layout: the block layout.
        num_slots: slots in the arena.
        directory: where blocks.bin and index.sqlite live (created if needed).
        codec: stored format (default `none`).
        compress: compress each (block, layer) slice losslessly (saves bandwidth).
        fsync: fdatasync data before committing index rows (power-loss durability).
        max_file_bytes: refuse (TierFullError) an arena larger than this.
        checksum: "mlh64" (fast, default) or "crc32".
        io_threads: threads that copy and checksum one large read or write (native
            kernels, mlh64, uncompressed); default min(4, CPU count).
        o_direct: move block data with O_DIRECT (bypass the page cache: reads really
            come from the device, and a big spill does not evict the page cache of
            everything else). Data goes through a 4 KiB-aligned staging buffer;
            one layer is read as the aligned 4 KiB pages around it. Not with compress.

    Raises:
        ConfigError: the directory holds a tier with another layout/codec/checksum.
        TierFullError: the arena does not fit (max_file_bytes or ENOSPC).
    """

    def __init__(
        self,
        layout: BlockLayout,
        num_slots: int,
        directory: str | os.PathLike,
        codec: Codec | None = None,
        compress: bool = False,
        fsync: bool = False,
        max_file_bytes: int | None = None,
        checksum: str = "mlh64",
        io_threads: int | None = None,
        o_direct: bool = False,
    ) -> None:
        codec = codec or NoneCodec()
        super().__init__("disk", layout, num_slots, codec)
        self.directory = Path(directory)
        self.path = self.directory / ARENA_FILE
        self.fsync = fsync
        self.zero_copy = isinstance(codec, NoneCodec)
        self._compressor = _load_compressor() if compress else None
        self._init_format()
        self._checksum = Checksum(checksum, self.layer_bytes)
        if io_threads is not None and (not isinstance(io_threads, int) or io_threads < 1):
            raise ConfigError.field("io_threads", io_threads, "a positive integer")
        self.io_threads = io_threads or min(4, os.cpu_count() or 1)
        self._native = load_native() if self._checksum.linear else None
        if o_direct and compress:
            raise ConfigError.field(
                "o_direct", True, "O_DIRECT cannot be combined with compress=True; drop one"
            )
        if o_direct and not hasattr(os, "O_DIRECT"):
            raise ConfigError.field("o_direct", True, "no O_DIRECT on this OS; use False")
        self.o_direct = o_direct
        self._templates: dict[tuple, Template] = {}
        self._lock = threading.RLock()
        self._pending: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor, set[int]]] = {}
        self._local = threading.local()
        L = layout.num_layers
        self._sums = np.zeros((num_slots, L), dtype=np.uint64)
        self._lens = np.zeros((num_slots, L), dtype=np.int64)
        self._written = np.zeros(num_slots, dtype=bool)
        self._missing = np.zeros(num_slots, dtype=bool)
        self._hash_of: dict[int, bytes] = {}
        self._keys: dict[bytes, tuple[int, list[int]]] = {}
        if max_file_bytes is not None and self.file_bytes > max_file_bytes:
            raise self._error(
                TierFullError,
                f"arena of {num_slots} slots needs {self.file_bytes} bytes, "
                f"over max_file_bytes={max_file_bytes}",
            )
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError.field(
                "disk_dir", str(self.directory), f"cannot create it ({exc.strerror})"
            ) from exc
        self._db = sqlite3.connect(self.directory / INDEX_FILE, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(f"PRAGMA synchronous={'FULL' if fsync else 'NORMAL'}")
        self._db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS blocks (slot INTEGER PRIMARY KEY, sums BLOB NOT NULL,"
            " lens BLOB NOT NULL, hash BLOB UNIQUE, token_ids BLOB)"
        )
        self._check_meta()
        existed = self.path.exists()
        old_size = self.path.stat().st_size if existed else 0
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        self._dfd = self._fd  # the descriptor block data moves through
        try:
            self._allocate_file(old_size)
            if o_direct:
                self._dfd = self._open_direct()
        except BaseException:
            self.close()
            raise
        self._load_index(old_size)

    # -- format -----------------------------------------------------------------------
    def _init_format(self) -> None:
        """Field regions inside one layer of a slot: key -> (offset, nbytes, spec)."""
        lay = self.layout
        self.field_specs = {kind: self.codec.fields(kind, lay) for kind in KINDS}
        self.regions: dict[str, tuple[int, int]] = {}
        self._spec_of: dict[str, object] = {}
        off = 0
        for kind in KINDS:
            for fname, spec in self.field_specs[kind].items():
                nbytes = lay.num_kv_heads * spec.nbytes
                self.regions[f"{kind}.{fname}"] = (off, nbytes)
                self._spec_of[f"{kind}.{fname}"] = spec
                off += round_up(nbytes, _FIELD_ALIGN)
        self.layer_bytes = off
        self.slot_bytes = round_up(lay.num_layers * off, _SLOT_ALIGN)
        biggest = max(
            (s for specs in self.field_specs.values() for s in specs.values()),
            key=lambda s: s.nbytes,
        )
        self._elem_size = torch.empty((), dtype=biggest.dtype).element_size()

    @property
    def file_bytes(self) -> int:
        """Size of the arena file."""
        return self.num_slots * self.slot_bytes

    def _meta(self) -> dict[str, object]:
        lay = self.layout
        return {
            "format": FORMAT_VERSION,
            "layout": [lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.dim_v, lay.block_size],
            "dtype": str(lay.dtype).removeprefix("torch."),
            "codec": self.codec.name,
            "fields": {
                k: [s.rows, s.cols, str(s.dtype).removeprefix("torch.")]
                for kind in KINDS
                for k, s in self._prefixed(kind)
            },
            "checksum": self._checksum.name,
        }

    def _prefixed(self, kind: str) -> Iterator[tuple[str, object]]:
        for fname, spec in self.field_specs[kind].items():
            yield f"{kind}.{fname}", spec

    def _check_meta(self) -> None:
        want = self._meta()
        row = self._db.execute("SELECT value FROM meta WHERE key='config'").fetchone()
        if row is not None:
            have = json.loads(row[0])
            for key, value in want.items():
                if have.get(key) != value:
                    raise ConfigError(
                        f"disk tier directory {str(self.directory)!r} holds {key}="
                        f"{have.get(key)!r}, this tier has {key}={value!r}: use another "
                        "directory or delete that one"
                    )
        with self._db:
            self._db.execute(
                "INSERT OR REPLACE INTO meta VALUES ('config', ?)", (json.dumps(want),)
            )

    def _allocate_file(self, old_size: int) -> None:
        size = self.file_bytes
        try:
            if old_size > size:
                os.ftruncate(self._fd, size)
            elif hasattr(os, "posix_fallocate"):
                try:
                    os.posix_fallocate(self._fd, 0, size)
                except OSError as exc:
                    if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                        raise
                    self._truncate_checked(size)
            else:
                self._truncate_checked(size)
        except OSError as exc:
            raise self._io_error(exc, [], f"creating a {size}-byte arena") from exc

    def _open_direct(self) -> int:
        try:
            return os.open(self.path, os.O_RDWR | os.O_DIRECT)
        except OSError as exc:
            raise ConfigError.field(
                "o_direct",
                True,
                f"the filesystem of {str(self.directory)!r} refuses O_DIRECT ({exc.strerror}); "
                "use another directory (tmpfs has no O_DIRECT) or o_direct=False",
            ) from exc

    def _truncate_checked(self, size: int) -> None:
        # No fallocate on this filesystem: a sparse file, with a free-space check.
        st = os.statvfs(self.directory)
        if st.f_bavail * st.f_frsize < size - os.fstat(self._fd).st_size:
            raise OSError(errno.ENOSPC, "not enough free space")
        os.ftruncate(self._fd, size)

    def _load_index(self, old_size: int) -> None:
        L = self.layout.num_layers
        with self._db:
            self._db.execute(
                "DELETE FROM blocks WHERE hash IS NULL OR slot >= ?", (self.num_slots,)
            )
        taken = []
        for slot, sums, lens, key, tokens in self._db.execute("SELECT * FROM blocks"):
            self._sums[slot] = np.frombuffer(sums, dtype="<u8", count=L)
            self._lens[slot] = np.frombuffer(lens, dtype="<i8", count=L)
            self._written[slot] = True
            # The file was deleted or truncated under the index: the block is gone.
            self._missing[slot] = (slot + 1) * self.slot_bytes > old_size
            ids = np.frombuffer(tokens, dtype="<i8").tolist()
            self._hash_of[slot] = key
            self._keys[key] = (slot, ids)
            taken.append(slot)
        self.allocator.take(taken)
        self.stats.peak_used_slots = self.num_used

    # -- errors -----------------------------------------------------------------------
    def _error(self, cls: type[TierIOError], msg: str, slots: list[int] | None = None):
        # Not OSError.filename: setting it changes str(exc) to "[Errno None] ...".
        exc = cls(f"{msg} (file {str(self.path)!r})")
        exc.path = str(self.path)
        exc.slots = list(slots or [])
        return exc

    def _io_error(self, exc: OSError, slots: list[int], what: str) -> TierIOError:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            return self._error(TierFullError, f"disk full while {what}: {exc}", slots)
        return self._error(TierIOError, f"I/O error while {what}: {exc}", slots)

    def _check_file(self, slots: list[int]) -> None:
        # An unlinked arena still reads back through our fd, but it is no longer
        # durable: report it instead of silently serving from a ghost file.
        if os.fstat(self._fd).st_nlink == 0:
            raise self._error(BlockMissingError, "arena file was deleted", slots)

    # -- keys -------------------------------------------------------------------------
    def put_key(self, slot: int, block_hash: bytes, token_ids: list[int]) -> None:
        """Record that `slot` holds the full block `block_hash` (durable across restarts).

        Args:
            slot: a written slot.
            block_hash: the block's chained hash (kvstrata.hashing.block_hash).
            token_ids: the block's tokens, returned by `lookup` to verify a hit.
        """
        if not self._written[slot]:
            raise self._error(BlockMissingError, f"put_key on unwritten slot {slot}", [slot])
        blob = np.asarray(token_ids, dtype="<i8").tobytes()
        with self._lock, self._db:
            old = self._keys.get(block_hash)
            if old is not None and old[0] != slot:  # the key moves to the new copy
                self._db.execute("UPDATE blocks SET hash=NULL WHERE slot=?", (old[0],))
                self._hash_of.pop(old[0], None)
            prev = self._hash_of.pop(slot, None)
            if prev is not None:
                self._keys.pop(prev, None)
            self._db.execute(
                "UPDATE blocks SET hash=?, token_ids=? WHERE slot=?", (block_hash, blob, slot)
            )
            self._hash_of[slot] = block_hash
            self._keys[block_hash] = (slot, list(token_ids))

    def lookup(self, block_hash: bytes) -> tuple[int, list[int]] | None:
        """(slot, token_ids) of the block stored under `block_hash`, or None."""
        hit = self._keys.get(block_hash)
        return None if hit is None else (hit[0], list(hit[1]))

    def keyed_slots(self) -> dict[int, bytes]:
        """slot -> block hash, for every keyed slot."""
        return dict(self._hash_of)

    def free(self, slots: list[int]) -> None:
        """Release slots; their index rows and keys are dropped."""
        self._drop_rows(slots)
        super().free(slots)

    def _drop_rows(self, slots: list[int]) -> None:
        idx = np.asarray(slots, dtype=np.int64)
        stale = idx[self._written[idx]].tolist()  # no Python loop per block
        if not stale:
            return
        with self._lock, self._db:
            self._db.executemany("DELETE FROM blocks WHERE slot=?", [(s,) for s in stale])
            for s in stale:
                self._written[s] = self._missing[s] = False
                key = self._hash_of.pop(s, None)
                if key is not None:
                    self._keys.pop(key, None)

    # -- staging ----------------------------------------------------------------------
    def _staging(self, nbytes: int) -> np.ndarray:
        """A per-thread reusable uint8 buffer (fresh buffers cost page faults),
        4 KiB-aligned (O_DIRECT needs aligned memory)."""
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.size < nbytes:
            buf = aligned_empty(max(nbytes, CHUNK_BYTES + self.slot_bytes), _SLOT_ALIGN)
            self._local.buf = buf
        return buf[:nbytes]

    def _chunks(self, n: int, item_bytes: int) -> Iterator[tuple[int, int]]:
        direct = self._native is not None and self._compressor is None and not self.o_direct
        step = max(1, (NATIVE_CHUNK_BYTES if direct else CHUNK_BYTES) // item_bytes)
        for i0 in range(0, n, step):
            yield i0, min(n, i0 + step)

    def _field_bytes(self, stag: np.ndarray, key: str) -> np.ndarray:
        """Staging [c, (nl,) layer_bytes] -> field `key`'s bytes as a view
        [(nl,) Hkv, c, rows, cols * element_size], the order of a tier tensor's slots."""
        off, nbytes = self.regions[key]
        kind, fname = key.split(".", 1)
        spec = self.field_specs[kind][fname]
        row_bytes = spec.nbytes // spec.rows
        view = stag[..., off : off + nbytes]
        view = view.reshape(view.shape[:-1] + (self.layout.num_kv_heads, spec.rows, row_bytes))
        return np.moveaxis(view, 0, -3)

    @staticmethod
    def _exchange(staged: np.ndarray, part: torch.Tensor, to_staging: bool) -> None:
        """Copy between staged field bytes [..., c, rows, row_bytes] and a tensor
        `part` [..., c*rows, cols]. Byte copies with numpy on the CPU: no dtype
        dispatch, and no OpenMP team to wait for on a busy machine (a 1 MiB torch
        copy_ took 15 ms instead of 25 us with 2 threads on 2 loaded cores)."""
        c, rows = staged.shape[-3], staged.shape[-2]
        if part.stride(-1) != 1 or part.dtype == torch.bool:
            tmp = part.contiguous() if to_staging else torch.empty(part.shape, dtype=part.dtype)
            DiskTier._exchange(staged, tmp, to_staging)
            if not to_staging:
                part.copy_(tmp)
            return
        pb = part.detach().view(torch.uint8).unflatten(-2, (c, rows))
        if pb.device.type == "cpu":
            arr = pb.numpy()
            np.copyto(staged, arr) if to_staging else np.copyto(arr, staged)
        elif to_staging:
            torch.from_numpy(staged).copy_(pb)
        else:
            pb.copy_(torch.from_numpy(staged))

    # -- low-level I/O ----------------------------------------------------------------
    def _pwrite(self, data: np.ndarray, offset: int, slots: list[int]) -> None:
        view = memoryview(data).cast("B")
        done = 0
        try:
            while done < len(view):
                done += os.pwrite(self._dfd, view[done:], offset + done)
        except OSError as exc:
            raise self._io_error(exc, slots, f"writing slots {slots}") from exc

    def _pread(self, out: np.ndarray, offset: int) -> bool:
        """Fill `out` from `offset`; False when the file ends first (truncated).
        With O_DIRECT, an unaligned range is read as the aligned pages around it."""
        if self.o_direct and (offset % _SLOT_ALIGN or out.nbytes % _SLOT_ALIGN):
            a = offset - offset % _SLOT_ALIGN
            b = round_up(offset + out.nbytes, _SLOT_ALIGN)
            pages = aligned_empty(b - a, _SLOT_ALIGN)
            if not self._pread(pages, a):
                return False
            out.reshape(-1)[:] = pages[offset - a : offset - a + out.nbytes]
            return True
        view = memoryview(out).cast("B")
        done = 0
        while done < len(view):
            got = os.preadv(self._dfd, [view[done:]], offset + done)
            if got == 0:
                return False
            done += got
        return True

    def _runs(self, slots: list[int]) -> Iterator[tuple[int, int, int]]:
        """(index in slots, first slot, count) of each run of consecutive slots."""
        i = 0
        while i < len(slots):
            j = i + 1
            while j < len(slots) and slots[j] == slots[j - 1] + 1:
                j += 1
            yield i, slots[i], j - i
            i = j

    # -- write ------------------------------------------------------------------------
    def write_blocks(self, slots: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        raw = {"k": k, "v": v}
        if self.zero_copy:
            bs = self.layout.block_size
            self._write(slots, lambda key, i0, i1: self._narrow(raw[key[0]], bs, i0, i1, 2))
            return
        encoded: dict[tuple[str, int], dict[str, torch.Tensor]] = {}

        def fields(key: str, i0: int, i1: int) -> torch.Tensor:
            kind, fname = key.split(".", 1)
            if (kind, i0) not in encoded:  # encode each kind of a chunk once
                encoded.clear()
                chunk = self._narrow(raw[kind], self.layout.block_size, i0, i1, 2)
                enc = self._alloc_encoded(kind, i1 - i0, chunk.device)
                self.codec.encode(kind, chunk, enc)
                encoded[(kind, i0)] = enc
            return encoded[(kind, i0)][fname]

        self._write(slots, fields)

    def write_layer(self, layer: int, slots: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Collect one layer of new full blocks; the blocks are encoded, checksummed and
        written once their last layer arrives (a block on disk is always whole).

        Used when a long prefill overflows the faster tiers: the pending layers sit in
        host memory for the duration of one forward pass."""
        key = tuple(slots)
        pending = self._pending.get(key)
        if pending is None:
            n = len(slots)
            pending = (
                torch.empty(self.layout.raw_shape("k", n), dtype=self.layout.dtype),
                torch.empty(self.layout.raw_shape("v", n), dtype=self.layout.dtype),
                set(),
            )
            self._pending[key] = pending
        pending[0][layer].copy_(k)
        pending[1][layer].copy_(v)
        pending[2].add(layer)
        if len(pending[2]) == self.layout.num_layers:
            del self._pending[key]
            self.write_blocks(slots, pending[0], pending[1])

    def write_encoded(self, slots: list[int], data: Encoded) -> None:
        rows = {key: s.rows for kind in KINDS for key, s in self._prefixed(kind)}
        self._write(slots, lambda key, i0, i1: self._narrow(data[key], rows[key], i0, i1, 2))

    @staticmethod
    def _narrow(t: torch.Tensor, rows: int, i0: int, i1: int, dim: int) -> torch.Tensor:
        return t.narrow(dim, i0 * rows, (i1 - i0) * rows)

    def _alloc_encoded(self, kind: str, n: int, device: torch.device) -> dict[str, torch.Tensor]:
        lay = self.layout
        return {
            f: torch.empty(
                (lay.num_layers, lay.num_kv_heads, n * s.rows, s.cols), dtype=s.dtype, device=device
            )
            for f, s in self.field_specs[kind].items()
        }

    def _write(self, slots: list[int], fields) -> None:
        """Stage, checksum and write blocks; `fields(key, i0, i1)` gives the chunk's
        encoded field `key` as [L, Hkv, (i1-i0)*rows, cols]."""
        n = len(slots)
        if n == 0:
            return
        if os.fstat(self._fd).st_nlink == 0:
            raise self._error(TierIOError, "arena file was deleted", slots)
        L, lb = self.layout.num_layers, self.layer_bytes
        self._drop_rows(slots)  # a crash from here on leaves these slots free
        sums = np.empty((n, L), dtype=np.uint64)
        lens = np.full((n, L), lb, dtype=np.int64)
        for i0, i1 in self._chunks(n, self.slot_bytes):
            c, chunk = i1 - i0, slots[i0:i1]
            full = self._staging(c * self.slot_bytes).reshape(c, self.slot_bytes)
            stag_np = full[:, : L * lb].reshape(c, L, lb)
            if self._compressor is None and self._checksum.linear and not self.o_direct:
                src = {key: fields(key, i0, i1) for key in self.regions}
                sums[i0:i1] = self._direct_write(chunk, src, full, stag_np)
                continue
            full[:] = 0  # padding is written as zeros, as on the direct path
            for key in self.regions:
                self._exchange(self._field_bytes(stag_np, key), fields(key, i0, i1), True)
            if self._compressor is None:
                sums[i0:i1] = self._checksum.rows(stag_np)
                for j, first, count in self._runs(chunk):
                    self._pwrite(full[j : j + count], first * self.slot_bytes, chunk)
            else:
                for j, slot in enumerate(chunk):
                    sums[i0 + j], lens[i0 + j] = self._write_compressed(slot, full[j])
        if self.fsync:
            os.fdatasync(self._fd)
        self._commit_rows(slots, sums, lens)
        self.stats.blocks_written += n
        self.stats.bytes_written += int(lens.sum())

    def _write_compressed(self, slot: int, stag_slot: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        compress, _ = self._compressor
        L, lb = self.layout.num_layers, self.layer_bytes
        parts, sums, lens = [], np.empty(L, dtype=np.uint64), np.empty(L, dtype=np.int64)
        for layer in range(L):
            raw = stag_slot[layer * lb : (layer + 1) * lb]
            packed = np.frombuffer(compress(raw, self._elem_size), dtype=np.uint8)
            part = packed if len(packed) < lb else raw  # incompressible: store as is
            parts.append(part)
            sums[layer], lens[layer] = self._checksum.one(part), len(part)
        self._pwrite(np.concatenate(parts), slot * self.slot_bytes, [slot])
        return sums, lens

    def _commit_rows(self, slots: list[int], sums: np.ndarray, lens: np.ndarray) -> None:
        rows = [
            (s, sums[i].astype("<u8").tobytes(), lens[i].astype("<i8").tobytes())
            for i, s in enumerate(slots)
        ]
        with self._lock, self._db:
            self._db.executemany("INSERT OR REPLACE INTO blocks VALUES (?, ?, ?, NULL, NULL)", rows)
            idx = np.asarray(slots)
            self._sums[idx], self._lens[idx] = sums, lens
            self._written[idx], self._missing[idx] = True, False

    # -- read -------------------------------------------------------------------------
    def read_blocks(self, slots: list[int], k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        self._read(slots, None, {"k": k_out, "v": v_out})

    def read_layer(
        self, layer: int, slots: list[int], k_out: torch.Tensor, v_out: torch.Tensor
    ) -> None:
        self._read(slots, layer, {"k": k_out, "v": v_out})

    def read_encoded(self, slots: list[int]) -> Encoded:
        lay, n = self.layout, len(slots)
        out = {
            key: torch.empty((lay.num_layers, lay.num_kv_heads, n * s.rows, s.cols), dtype=s.dtype)
            for kind in KINDS
            for key, s in self._prefixed(kind)
        }
        self._read(slots, None, out, encoded=True)
        return out

    def _read(
        self,
        slots: list[int],
        layer: int | None,
        outs: dict[str, torch.Tensor],
        encoded: bool = False,
    ) -> None:
        n = len(slots)
        if n == 0:
            return
        self._check_file(slots)
        L, lb = self.layout.num_layers, self.layer_bytes
        nl = L if layer is None else 1
        idx = np.asarray(slots)
        unknown = idx[~self._written[idx] | self._missing[idx]].tolist()
        if unknown:
            self.stats.read_errors += 1
            raise self._error(BlockMissingError, f"no stored block in slots {unknown}", unknown)
        missing: list[int] = []
        corrupt: list[int] = []
        item_bytes = self.slot_bytes if layer is None else lb
        for i0, i1 in self._chunks(n, item_bytes):
            c = i1 - i0
            full = self._staging(c * item_bytes).reshape(c, item_bytes)
            stag_np = full[:, : nl * lb].reshape(c, nl, lb)
            chunk = slots[i0:i1]
            if (
                self._checksum.linear
                and not self.o_direct
                and not (self._lens[idx[i0:i1]] < lb).any()
            ):
                dest, finish = self._read_targets(outs, i0, i1, layer, encoded)
                if self._direct_read(chunk, layer, dest, full, stag_np, missing, corrupt):
                    finish()
                continue
            if not self._read_chunk(chunk, layer, full, stag_np, missing, corrupt):
                continue
            self._unstage(stag_np if layer is None else stag_np[:, 0], outs, i0, i1, layer, encoded)
        if missing or corrupt:
            self.stats.read_errors += 1
            cls = BlockCorruptError if corrupt else BlockMissingError
            what = []
            if corrupt:
                what.append(f"checksum mismatch in slots {corrupt}")
            if missing:
                what.append(f"file too short for slots {missing}")
            raise self._error(cls, "; ".join(what), corrupt + missing)
        self.stats.blocks_read += n
        lens = self._lens[idx] if layer is None else self._lens[idx, layer]
        self.stats.bytes_read += int(lens.sum())

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
        lb, sb = self.layer_bytes, self.slot_bytes
        bad_before = len(missing) + len(corrupt)
        idx = np.asarray(chunk)
        packed = (self._lens[idx] < lb).any(axis=1)
        if layer is None:  # whole blocks: one pread per run of consecutive slots
            for j, first, count in self._runs(chunk):
                if packed[j : j + count].any():
                    continue  # runs with a compressed slot are read slot by slot below
                if not self._pread(full[j : j + count], first * sb):
                    missing.extend(chunk[j : j + count])
        else:
            for j in np.flatnonzero(~packed):
                if not self._pread(full[j], chunk[j] * sb + layer * lb):
                    missing.append(chunk[j])
        for j in np.flatnonzero(packed):
            self._read_packed(chunk[j], layer, stag_np[j], missing, corrupt)
        plain = np.flatnonzero(~packed)
        if len(plain):
            layers = slice(None) if layer is None else slice(layer, layer + 1)
            got = self._checksum.rows(stag_np if len(plain) == len(chunk) else stag_np[plain])
            want = self._sums[idx[plain]][:, layers]
            bad = {chunk[plain[j]] for j in np.flatnonzero((got != want).any(axis=1))}
            corrupt.extend(s for s in chunk if s in bad and s not in missing)
        return len(missing) + len(corrupt) == bad_before

    def _read_packed(
        self, slot: int, layer: int | None, out: np.ndarray, missing: list, corrupt: list
    ) -> None:
        _, decompress = self._compressor or _load_compressor()
        lens, lb = self._lens[slot], self.layer_bytes
        offs = np.concatenate([[0], np.cumsum(lens)])
        layers = range(len(lens)) if layer is None else [layer]
        lo, hi = offs[layers[0]], offs[layers[-1] + 1]
        raw = np.empty(hi - lo, dtype=np.uint8)
        if not self._pread(raw, slot * self.slot_bytes + int(lo)):
            missing.append(slot)
            return
        for i, layer_i in enumerate(layers):
            part = raw[offs[layer_i] - lo : offs[layer_i + 1] - lo]
            if self._checksum.one(part) != int(self._sums[slot, layer_i]):
                corrupt.append(slot)
                return
            if len(part) == lb:
                out[i] = part
            else:
                decompress(part, out[i])

    def _unstage(
        self,
        stag_np: np.ndarray,
        outs: dict[str, torch.Tensor],
        i0: int,
        i1: int,
        layer: int | None,
        encoded: bool,
    ) -> None:
        """Copy or decode staged blocks [c, (L,) lb] into the outputs' slots i0..i1."""
        c = i1 - i0
        dim = 2 if layer is None else 1
        for kind in KINDS:
            if encoded or self.zero_copy:
                for key, spec in self._prefixed(kind):
                    out = outs[key] if encoded else outs[kind]
                    part = self._narrow(out, spec.rows, i0, i1, dim)
                    self._exchange(self._field_bytes(stag_np, key), part, False)
                continue
            out = self._narrow(outs[kind], self.layout.block_size, i0, i1, dim)
            enc = {}
            for key, spec in self._prefixed(kind):
                shape = out.shape[:dim] + (c * spec.rows, spec.cols)
                enc[key.split(".", 1)[1]] = t = torch.empty(shape, dtype=spec.dtype)
                self._exchange(self._field_bytes(stag_np, key), t, False)
            self.codec.decode(kind, {f: t.to(out.device) for f, t in enc.items()}, out)

    # -- direct (vectored) I/O --------------------------------------------------------
    def _plan(
        self, tensors: dict[str, torch.Tensor], nl: int, item_bytes: int
    ) -> tuple[Template, list[np.ndarray]]:
        """Template and in-place views for moving `tensors` (key -> field tensor of
        the chunk); keys that cannot be viewed in place go through staging."""
        views = {}
        for key, t in tensors.items():
            spec = self._spec_of[key]
            view = direct_view(t, spec.rows, spec.nbytes)
            if view is not None:
                views[key] = view
        direct = tuple(key for key in self.regions if key in views)
        tkey = (direct, nl, item_bytes)
        tpl = self._templates.get(tkey)
        if tpl is None:
            tpl = build_template(
                self.regions, list(direct), self.layout.num_kv_heads, self.layer_bytes, nl,
                item_bytes,
            )  # fmt: skip
            self._templates[tkey] = tpl
        return tpl, [views[key] for key in direct]

    def _direct_sums(self, tpl: Template, views: list[np.ndarray], stag3: np.ndarray) -> np.ndarray:
        """Per-layer mlh64 [c, nl] of a chunk: in-place pieces plus staged gaps."""
        keys = self._checksum.keys
        sums = np.zeros(stag3.shape[:2], dtype=np.uint64)
        for key, view in zip(tpl.keys, views, strict=True):
            off, nbytes = self.regions[key]
            kw = keys[off // 8 : (off + nbytes) // 8].reshape(self.layout.num_kv_heads, -1, 1)
            part = np.matmul(view.view(np.uint64), kw)[..., 0]  # [nl, Hkv, c]
            sums += part.sum(axis=1, dtype=np.uint64).T
        for g0, g1 in tpl.gaps:
            sums += stag3[:, :, g0:g1].view(np.uint64) @ keys[g0 // 8 : g1 // 8]
        return sums

    def _direct_io(
        self,
        chunk: list[int],
        layer: int | None,
        tpl: Template,
        views: list[np.ndarray],
        full: np.ndarray,
        write: bool,
    ) -> list[int]:
        """One preadv/pwritev per run of consecutive slots (per slot for one layer).
        Returns the slots a read found past the end of the file."""
        sb, item = self.slot_bytes, full.shape[1]
        if layer is None:
            runs = [(j, count, first * sb) for j, first, count in self._runs(chunk)]
            run_of = np.repeat(np.arange(len(runs)), [r[1] for r in runs])
        else:
            base = layer * self.layer_bytes
            runs = [(j, 1, slot * sb + base) for j, slot in enumerate(chunk)]
            run_of = np.arange(len(chunk))
        iov, bounds, cum = iovecs(tpl, views, full, item, run_of)
        missing: list[int] = []
        for r, (j, count, offset) in enumerate(runs):
            b0, b1 = int(bounds[r]), int(bounds[r + 1])
            try:
                ok = vector_io(self._fd, iov[b0:b1], cum[b0 : b1 + 1] - cum[b0], offset, write)
            except OSError as exc:
                if write:
                    raise self._io_error(exc, chunk, f"writing slots {chunk}") from exc
                raise
            if not ok:
                missing.extend(chunk[j : j + count])
        return missing

    def _direct_write(
        self,
        chunk: list[int],
        src: dict[str, torch.Tensor],
        full: np.ndarray,
        stag3: np.ndarray,
    ) -> np.ndarray:
        """Checksum and write a chunk straight from the field tensors; returns sums."""
        L, lb = self.layout.num_layers, self.layer_bytes
        tpl, views = self._plan(src, L, self.slot_bytes)
        for g0, g1 in tpl.gaps:  # padding is written as zeros
            stag3[:, :, g0:g1] = 0
        full[:, L * lb :] = 0
        for key in self.regions:
            if key not in tpl.keys:
                self._exchange(self._field_bytes(stag3, key), src[key], True)
        if self._native is not None:
            base = np.asarray(chunk, dtype=np.int64) * self.slot_bytes
            try:
                sums, _ = native_io(
                    self._native, self._fd, tpl, views, full, base, L, self._checksum.keys,
                    True, self.io_threads,
                )  # fmt: skip
            except OSError as exc:
                raise self._io_error(exc, chunk, f"writing slots {chunk}") from exc
            return sums
        sums = self._direct_sums(tpl, views, stag3)  # also brings the chunk into cache
        self._direct_io(chunk, None, tpl, views, full, write=True)
        return sums

    def _direct_read(
        self,
        chunk: list[int],
        layer: int | None,
        dest: dict[str, torch.Tensor],
        full: np.ndarray,
        stag3: np.ndarray,
        missing: list[int],
        corrupt: list[int],
    ) -> bool:
        """Read a chunk straight into the field tensors `dest` and verify it while it
        is in cache. Appends bad slots to missing/corrupt and zeroes their bytes in
        `dest` (nothing unverified is left behind); False if any."""
        tpl, views = self._plan(dest, stag3.shape[1], full.shape[1])
        if self._native is not None:
            base = np.asarray(chunk, dtype=np.int64) * self.slot_bytes
            if layer is not None:
                base += layer * self.layer_bytes
            got, past_end = native_io(
                self._native, self._fd, tpl, views, full, base, stag3.shape[1],
                self._checksum.keys, False, self.io_threads,
            )  # fmt: skip
            short = [chunk[j] for j in np.flatnonzero(past_end)]
        else:
            short = self._direct_io(chunk, layer, tpl, views, full, write=False)
            got = self._direct_sums(tpl, views, stag3)
        layers = slice(None) if layer is None else slice(layer, layer + 1)
        want = self._sums[np.asarray(chunk)][:, layers]
        bad = np.flatnonzero((got != want).any(axis=1))
        if len(bad) == 0 and not short:
            for key in self.regions:
                if key not in tpl.keys:
                    self._exchange(self._field_bytes(stag3, key), dest[key], False)
            return True
        missing.extend(short)
        corrupt.extend(s for s in (chunk[j] for j in bad) if s not in short)
        for view in views:
            view[:, :, bad] = 0
        return False

    def _read_targets(
        self,
        outs: dict[str, torch.Tensor],
        i0: int,
        i1: int,
        layer: int | None,
        encoded: bool,
    ) -> tuple[dict[str, torch.Tensor], object]:
        """Field tensors to read blocks i0..i1 into, and what to run once verified:
        the outputs themselves, or (lossy codec) temporaries that are then decoded."""
        dim = 2 if layer is None else 1
        dest: dict[str, torch.Tensor] = {}
        if encoded or self.zero_copy:
            for kind in KINDS:
                for key, spec in self._prefixed(kind):
                    out = outs[key] if encoded else outs[kind]
                    dest[key] = self._narrow(out, spec.rows, i0, i1, dim)
            return dest, lambda: None
        bs = self.layout.block_size
        for kind in KINDS:
            out = self._narrow(outs[kind], bs, i0, i1, dim)
            for key, spec in self._prefixed(kind):
                shape = out.shape[:dim] + ((i1 - i0) * spec.rows, spec.cols)
                dest[key] = torch.empty(shape, dtype=spec.dtype)

        def decode() -> None:
            for kind in KINDS:
                out = self._narrow(outs[kind], bs, i0, i1, dim)
                enc = {k.split(".", 1)[1]: dest[k].to(out.device) for k, _ in self._prefixed(kind)}
                self.codec.decode(kind, enc, out)

        return dest, decode

    # -- lifecycle --------------------------------------------------------------------
    def drop_cache(self) -> None:
        """Flush the arena and ask the kernel to drop its cached pages (cold reads)."""
        os.fdatasync(self._fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        """Commit the index and close both files (idempotent)."""
        dfd, self._dfd = getattr(self, "_dfd", -1), -1
        fd, self._fd = getattr(self, "_fd", -1), -1
        if dfd >= 0 and dfd != fd:
            os.close(dfd)
        if fd >= 0:
            if self.fsync:
                os.fdatasync(fd)
            os.close(fd)
        db = getattr(self, "_db", None)
        if db is not None:
            db.commit()
            db.close()
            self._db = None

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
