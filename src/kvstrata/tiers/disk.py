"""DiskTier: a durable file arena of block slots, with an index and per-layer checksums.

Files in `directory`:

    blocks.bin     the arena, preallocated at creation: num_slots * slot_bytes
    index.sqlite   meta (layout, codec, checksum) + one row per written slot:
                   (slot, checksum per layer, stored bytes per layer, key, token ids,
                   the parent key it was chained to)
    tier.lock      an exclusive flock held while the tier is open (one owner)

The slot layout (one block = one contiguous extent; with `compress=True` the layers
of a slot are packed) is described in kvstrata.tiers.disk_format. The tier's open
files (tiers/disk_files.py) are a DirLock (tiers/disk_lock.py: one owner per
directory), a DiskIndex (tiers/disk_index.py: the sqlite index and its in-memory
mirror) and a BlockFile (tiers/disk_io.py: the arena and every read and write path).
The guarantees are stated in docs/design.md, "Durability contract".

Crash safety: a rewritten slot loses its index row before its new data is written,
and the new row is committed only after the data. So a crash leaves either no row
(the slot is free on reopen) or a row whose checksums (XXH3-64 per layer) cover what
was written; a torn write fails its checksum. Reads verify every layer they return
and raise BlockCorruptError / BlockMissingError (TierIOError, with `.slots` and
`.path`) instead of returning wrong data. Every storage error is a TierIOError
(TierFullError for a full disk) naming the file and the fix. On reopen, keyed slots
(`put_key`) are found again and marked used; unkeyed slots are free; a lost index or
arena means an empty tier (with a RuntimeWarning), never wrong data.
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from kvstrata.codecs.base import Codec, NoneCodec
from kvstrata.config import check_disk_dir
from kvstrata.core.errors import (
    BlockCorruptError,
    BlockMissingError,
    ConfigError,
    TierFullError,
    TierIOError,
)
from kvstrata.core.layout import KINDS, BlockLayout
from kvstrata.platform.native import load_pio as load_native
from kvstrata.tiers.base import Encoded, Tier
from kvstrata.tiers.disk_errors import slot_list, tier_error
from kvstrata.tiers.disk_files import ARENA_FILE, INDEX_FILE, DiskFiles
from kvstrata.tiers.disk_format import (
    CHECKSUMS,
    DEFAULT_CHECKSUM,
    Checksum,
    SlotFormat,
    load_compressor,
)
from kvstrata.tiers.disk_index import DiskIndex
from kvstrata.tiers.disk_io import BlockFile, Fields, check_free_space
from kvstrata.tiers.disk_lock import LOCK_FILE

__all__ = ["ARENA_FILE", "CHECKSUMS", "DiskTier", "FORMAT_VERSION", "INDEX_FILE", "LOCK_FILE"]

FORMAT_VERSION = 1  # bump when the slot layout or the index schema changes
# Module attributes the tier reads when it runs: tests substitute stand-ins.
_load_compressor = load_compressor


class DiskTier(Tier):
    """A tier whose slots live in one preallocated file, indexed in sqlite.

    Args:
        layout: the block layout.
        num_slots: slots in the arena.
        directory: where blocks.bin, index.sqlite and tier.lock live (created if
            needed; the path rules of CacheConfig.disk_dir, kvstrata.config's
            check_disk_dir). One open tier per directory: a second opener is refused.
        codec: stored format (default `none`).
        compress: compress each (block, layer) slice losslessly (saves bandwidth).
        fsync: fdatasync data before committing index rows (power-loss durability).
        max_file_bytes: refuse (TierFullError) an arena larger than this.
        checksum: "xxh3-64" (default: XXH3-64, computed in the native I/O kernels)
            or "crc32" (zlib, in Python on staged buffers, slower).
        io_threads: threads that copy and checksum one large read or write (native
            kernels, uncompressed); default min(4, CPU count).
        o_direct: move block data with O_DIRECT (bypass the page cache: reads really
            come from the device, and a big spill does not evict the page cache of
            everything else). Data goes through a 4 KiB-aligned staging buffer;
            one layer is read as the aligned 4 KiB pages around it. Not with compress.
        delta: with compress, delta code the key fields along tokens first (lossless;
            pays on keys, not values: kvstrata.bench.delta). Frames say whether they
            are delta coded, so any tier reads both.

    Raises:
        ConfigError: a bad argument, or the directory holds a tier with another
            layout/codec/checksum (or one written with a retired checksum).
        TierIOError: the directory is in use by another tier (names the holder), or
            its files cannot be opened or are damaged.
        TierFullError: the arena does not fit (max_file_bytes or ENOSPC).

    Warns:
        RuntimeWarning: the index or the arena was lost or truncated: the blocks it
            held are dropped (they are recomputed), nothing wrong is served.
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
        checksum: str = DEFAULT_CHECKSUM,
        io_threads: int | None = None,
        o_direct: bool = False,
        delta: bool = False,
    ) -> None:
        directory = check_disk_dir(directory)  # the path rules of CacheConfig.disk_dir
        if io_threads is not None and (
            isinstance(io_threads, bool) or not isinstance(io_threads, int) or io_threads < 1
        ):
            raise ConfigError.field("io_threads", io_threads, "a positive integer")
        if not isinstance(delta, bool):
            raise ConfigError.field("delta", delta, "True or False")
        if delta and not compress:
            raise ConfigError.field("delta", True, "delta coding needs compress=True")
        codec = codec or NoneCodec()
        try:
            Path(directory).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError.field(
                "disk_dir", os.fspath(directory), f"cannot create it ({exc.strerror})"
            ) from exc
        # before the per-slot structures (a budget far past the free space would
        # otherwise first fill RAM with them); max_file_bytes has its own error below
        file_bytes = num_slots * SlotFormat(layout, codec).slot_bytes
        if max_file_bytes is None or file_bytes <= max_file_bytes:
            check_free_space(Path(directory) / ARENA_FILE, file_bytes)
        super().__init__("disk", layout, num_slots, codec)
        self.directory = Path(directory)
        self.path = self.directory / ARENA_FILE
        self.fsync = fsync
        self.zero_copy = isinstance(codec, NoneCodec)
        compressor = _load_compressor() if compress else None
        self._format = fmt = SlotFormat(layout, codec)
        if delta:  # keys only: on values it loses (see kvstrata.codecs.delta)
            regions = fmt.delta_regions(("k",))
            compressor = (functools.partial(compressor[0], delta=regions), compressor[1])
        self.field_specs, self.regions = fmt.field_specs, fmt.regions
        self.layer_bytes, self.slot_bytes = fmt.layer_bytes, fmt.slot_bytes
        self._checksum = Checksum(checksum)
        self.io_threads = io_threads or min(4, os.cpu_count() or 1)
        native = load_native() if self._checksum.native else None
        if o_direct and compress:
            raise ConfigError.field(
                "o_direct", True, "O_DIRECT cannot be combined with compress=True; drop one"
            )
        if o_direct and not hasattr(os, "O_DIRECT"):
            raise ConfigError.field("o_direct", True, "no O_DIRECT on this OS; use False")
        self.o_direct = o_direct
        self._pending: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor, set[int]]] = {}
        if max_file_bytes is not None and self.file_bytes > max_file_bytes:
            raise self._error(
                TierFullError,
                f"arena of {num_slots} slots needs {self.file_bytes} bytes, "
                f"over max_file_bytes={max_file_bytes}: lower disk_budget or raise the cap",
            )
        self._files = files = DiskFiles()

        def make_file(index: DiskIndex) -> BlockFile:
            # _load_compressor is looked up when a compressed slot is read, as before
            return BlockFile(
                self.path,
                fmt,
                num_slots,
                index,
                self._checksum,
                native,
                compressor,
                lambda: _load_compressor(),
                self.io_threads,
                o_direct,
            )

        taken = files.open(self.directory, fmt, num_slots, fsync, self._meta(), make_file)
        self._pid = files.pid  # the owner: a forked child may not use this tier
        self._index, self._file = files.index, files.file
        self.allocator.take(taken)
        self._finalizer = weakref.finalize(self, files.release)
        self.stats.peak_used_slots = self.num_used

    @property
    def file_bytes(self) -> int:
        """Size of the arena file."""
        return self.num_slots * self.slot_bytes

    # The arena's descriptor, the stored checksums and lengths [num_slots, L]: read
    # (and `_fd` swapped) by tests and benchmarks.
    @property
    def _fd(self) -> int:
        return self._file.fd

    @_fd.setter
    def _fd(self, fd: int) -> None:
        self._file.fd = fd

    @property
    def _sums(self) -> np.ndarray:
        return self._index.sums

    @property
    def _lens(self) -> np.ndarray:
        return self._index.lens

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
                for k, s in self._format.prefixed(kind)
            },
            "checksum": self._checksum.name,
        }

    def _error(
        self, cls: type[TierIOError], msg: str, slots: list[int] | None = None
    ) -> TierIOError:
        return tier_error(cls, msg, self.path, slots)

    def _owned(self) -> None:
        """Refuse use from a forked child (it holds no lock on the directory)."""
        if os.getpid() != self._pid:
            raise self._error(
                TierIOError,
                f"this disk tier was opened by process {self._pid} and cannot be used "
                "after a fork: open a DiskTier (on another disk_dir) in this process",
            )

    # -- keys -------------------------------------------------------------------------
    def put_key(self, slot: int, block_hash: bytes, token_ids: list[int]) -> None:
        """Record that `slot` holds the full block `block_hash` (durable across restarts).

        Args:
            slot: a written slot.
            block_hash: the block's chained hash (kvstrata.core.hashing.block_hash).
            token_ids: the block's tokens, returned by `lookup` to verify a hit.
        """
        self.put_keys([(slot, block_hash, token_ids)])

    def put_keys(
        self,
        entries: list[tuple[int, bytes, list[int]]],
        parents: Sequence[bytes | None] | None = None,
    ) -> None:
        """`put_key` for many written slots in one index transaction; `parents`
        (parallel to `entries`) records each block's parent hash for `parent_of`."""
        if not entries:
            return
        self._owned()
        self._file.check_linked([e[0] for e in entries], TierIOError)
        for slot, _, _ in entries:
            if not self._index.written[slot]:
                raise self._error(BlockMissingError, f"put_key on unwritten slot {slot}", [slot])
        self._index.put_keys(entries, parents)

    def lookup(self, block_hash: bytes) -> tuple[int, list[int]] | None:
        """(slot, token_ids) of the block stored under `block_hash`, or None."""
        return self._index.lookup(block_hash)

    def parent_of(self, block_hash: bytes) -> bytes | None:
        """The parent hash a keyed block was stored with (None: a chain's first block,
        or one written before parents were kept)."""
        return self._index.parent_of(block_hash)

    def keyed_slots(self) -> dict[int, bytes]:
        """slot -> block hash, for every keyed slot."""
        return self._index.keyed_slots()

    def free(self, slots: list[int]) -> None:
        """Release slots; their index rows and keys are dropped, and layers collected
        for them by an unfinished step (`write_layer`) are discarded."""
        self._owned()
        if self._pending:
            freed = set(slots)
            for key in [k for k in self._pending if freed.intersection(k)]:
                del self._pending[key]
        self._drop_rows(slots)
        super().free(slots)

    def _drop_rows(self, slots: list[int]) -> None:
        self._index.drop_rows(slots)

    def _commit_rows(self, slots: list[int], sums: np.ndarray, lens: np.ndarray) -> None:
        self._index.commit_rows(slots, sums, lens)

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
        rows = {key: s.rows for key, s in self._format.spec_of.items()}
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

    def _write(self, slots: list[int], fields: Fields) -> None:
        """Write blocks and index them; `fields(key, i0, i1)` gives the chunk's
        encoded field `key` as [L, Hkv, (i1-i0)*rows, cols]."""
        n = len(slots)
        if n == 0:
            return
        self._owned()
        self._file.check_linked(slots, TierIOError)
        self._drop_rows(slots)  # a crash from here on leaves these slots free
        sums, lens = self._file.write(slots, fields)
        if self.fsync:
            self._file.sync()
        self._commit_rows(slots, sums, lens)
        self.stats.blocks_written += n
        self.stats.bytes_written += int(lens.sum())

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
            for key, s in self._format.spec_of.items()
        }
        self._read(slots, None, out, encoded=True)
        return out

    def read_encoded_into(self, slots: list[int], outs: Encoded) -> None:
        """`read_encoded` into the caller's field tensors [L, Hkv, n*rows, cols] (views
        of another tier's arena, say: blocks then move once). The outputs of blocks
        that fail verification are zeroed or left as they were, never half-written
        with unverified bytes."""
        self._read(slots, None, outs, encoded=True)

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
        self._owned()
        self._file.check_linked(slots, BlockMissingError)
        index, idx = self._index, np.asarray(slots)
        unknown = idx[~index.written[idx]].tolist()
        if unknown:
            self.stats.read_errors += 1
            raise self._error(
                BlockMissingError, f"no stored block in slots {slot_list(unknown)}", unknown
            )
        missing, corrupt = self._file.read(
            slots, layer, lambda i0, i1: self._read_targets(outs, i0, i1, layer, encoded)
        )
        if missing or corrupt:
            self.stats.read_errors += 1
            cls = BlockCorruptError if corrupt else BlockMissingError
            what = []
            if corrupt:
                what.append(f"checksum mismatch in slots {slot_list(corrupt)}")
            if missing:
                what.append(f"file too short for slots {slot_list(missing)}")
            what.append("not served: recompute them (free these slots and write them again)")
            raise self._error(cls, "; ".join(what), corrupt + missing)
        self.stats.blocks_read += n
        lens = index.lens[idx] if layer is None else index.lens[idx, layer]
        self.stats.bytes_read += int(lens.sum())

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
        prefixed = self._format.prefixed
        if encoded or self.zero_copy:
            for kind in KINDS:
                for key, spec in prefixed(kind):
                    out = outs[key] if encoded else outs[kind]
                    dest[key] = self._narrow(out, spec.rows, i0, i1, dim)
            return dest, lambda: None
        bs = self.layout.block_size
        for kind in KINDS:
            out = self._narrow(outs[kind], bs, i0, i1, dim)
            for key, spec in prefixed(kind):
                shape = out.shape[:dim] + ((i1 - i0) * spec.rows, spec.cols)
                dest[key] = torch.empty(shape, dtype=spec.dtype)

        def decode() -> None:
            for kind in KINDS:
                out = self._narrow(outs[kind], bs, i0, i1, dim)
                enc = {k.split(".", 1)[1]: dest[k].to(out.device) for k, _ in prefixed(kind)}
                self.codec.decode(kind, enc, out)

        return dest, decode

    # -- lifecycle --------------------------------------------------------------------
    def drop_cache(self) -> None:
        """Flush the arena and ask the kernel to drop its cached pages (cold reads)."""
        self._owned()
        self._file.drop_cache()

    def close(self) -> None:
        """Commit the index, close the arena and the index, release the directory
        lock (idempotent). Everything is released even when a step fails; the first
        failure is then raised (TierIOError)."""
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is None or not finalizer.alive:
            return
        finalizer.detach()
        self._pending.clear()
        self._files.close(self.fsync)

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
