"""DiskTier's on-disk format: the slot layout, per-layer checksums, vectored file I/O.

Slot layout (one block = one contiguous extent, so a whole-block move is one pread
or pwrite per run of consecutive slots, and one layer of one block is one pread):

    slot s at s*slot_bytes:
      | layer 0                             | layer 1 | ... | pad to 4 KiB |
      | k.f0 [Hkv,rows,cols] | k.f1 | v.f0 |
        each field region padded to 16 bytes (so it can be viewed as its dtype)

With `compress=True` each (block, layer) slice is compressed on its own and the
layers are packed from the start of the slot (layer l at the sum of the stored
lengths before it); with `delta=True` too, the key fields of the slice are delta
coded along tokens first (kvstrata.codecs.delta; the frame header says so). The
slot size stays the uncompressed size: compression saves bandwidth (bytes read and
written), not disk space.

Every (block, layer) region carries a checksum: XXH3-64 (default) or CRC-32 of its
stored bytes, in file order (see `Checksum` and the "Durability contract" section of
docs/design.md for what each detects).

The direct path (native kernels only) moves bytes between the arena file and the
caller's tensors, one iovec per contiguous piece: for a field stored as [Hkv, rows,
cols] per (block, layer), one piece per head of each block. One native call per chunk
(`native_io`, kvstrata/platform/csrc/pio.cpp) batches the pieces into preadv/pwritev calls,
feeds each batch to a streaming XXH3 state per region while it is in cache (right
after it is read, right before it is written) and splits the chunk over threads at
region boundaries. Field padding, the slot tail and fields that cannot be viewed
directly (a GPU tensor, a 4-byte scale) go through a small staging buffer. Without
the native kernels (or with crc32, O_DIRECT or compression) blocks are staged in a
contiguous buffer and each region is hashed there by the `xxhash` package (zlib for
crc32): the same values, bit for bit.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from kvstrata.codecs import compress as lossless
from kvstrata.codecs.base import Codec
from kvstrata.codecs.delta import DeltaRegion
from kvstrata.core.errors import ConfigError
from kvstrata.core.layout import KINDS, BlockLayout, FieldSpec

CHECKSUMS = ("xxh3-64", "crc32")
DEFAULT_CHECKSUM = "xxh3-64"
# Checksums older versions wrote, which are no longer read: why, for the message.
RETIRED_CHECKSUMS = {
    "mlh64": "a linear multiply hash that misses paired bit flips",
}
FIELD_ALIGN = 16  # each field region starts 16-byte aligned (viewable as its dtype)
SLOT_ALIGN = 4096  # slots, O_DIRECT transfers and staging buffers are 4 KiB-aligned
IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 1024
STAGE = 0  # iovec source 0 is the staging buffer; 1.. are direct field views


def round_up(x: int, align: int) -> int:
    """`x` rounded up to a multiple of `align`."""
    return -(-x // align) * align


def aligned_empty(nbytes: int, align: int) -> np.ndarray:
    """An uninitialised uint8 array whose first byte is `align`-aligned (O_DIRECT)."""
    raw = np.empty(nbytes + align, dtype=np.uint8)
    skip = -raw.ctypes.data % align
    return raw[skip : skip + nbytes]


class SlotFormat:
    """Where each encoded field of a block lives in its slot (the layout above).

    Attributes:
        field_specs: kind -> field name -> FieldSpec (the codec's fields).
        regions: key f"{kind}.{field}" -> (offset in a layer, bytes), in file order.
        spec_of: key -> FieldSpec.
        layer_bytes: bytes of one layer of a slot (fields 16-byte aligned).
        slot_bytes: bytes of one slot: every layer, padded to 4 KiB.
        elem_size: element size of the largest field (a hint for the compressor).
    """

    def __init__(self, layout: BlockLayout, codec: Codec) -> None:
        self.num_layers = layout.num_layers
        self.num_kv_heads = layout.num_kv_heads
        self.field_specs = {kind: codec.fields(kind, layout) for kind in KINDS}
        self.regions: dict[str, tuple[int, int]] = {}
        self.spec_of: dict[str, FieldSpec] = {}
        off = 0
        for kind in KINDS:
            for key, spec in self.prefixed(kind):
                nbytes = layout.num_kv_heads * spec.nbytes
                self.regions[key] = (off, nbytes)
                self.spec_of[key] = spec
                off += round_up(nbytes, FIELD_ALIGN)
        self.layer_bytes = off
        self.slot_bytes = round_up(layout.num_layers * off, SLOT_ALIGN)
        biggest = max(self.spec_of.values(), key=lambda s: s.nbytes)
        self.elem_size = torch.empty((), dtype=biggest.dtype).element_size()

    def delta_regions(self, kinds: tuple[str, ...]) -> tuple[DeltaRegion, ...]:
        """The fields of `kinds` in one layer's bytes as delta-coding regions (one
        group of `rows` token rows per kv head), for fields with more than one row."""
        out = []
        for key, (off, _) in self.regions.items():
            spec = self.spec_of[key]
            if key.split(".", 1)[0] in kinds and spec.rows > 1:
                word = torch.empty((), dtype=spec.dtype).element_size()
                row_bytes = spec.nbytes // spec.rows
                out.append(DeltaRegion(off, self.num_kv_heads, spec.rows, row_bytes, word))
        return tuple(out)

    def prefixed(self, kind: str) -> Iterator[tuple[str, FieldSpec]]:
        """(key f"{kind}.{field}", spec) of each field of `kind`, in file order."""
        for fname, spec in self.field_specs[kind].items():
            yield f"{kind}.{fname}", spec

    def field_bytes(self, stag: np.ndarray, key: str) -> np.ndarray:
        """Staging [c, (nl,) layer_bytes] -> field `key`'s bytes as a view
        [(nl,) Hkv, c, rows, cols * element_size], the order of a tier tensor's slots."""
        off, nbytes = self.regions[key]
        spec = self.spec_of[key]
        row_bytes = spec.nbytes // spec.rows
        view = stag[..., off : off + nbytes]
        view = view.reshape(view.shape[:-1] + (self.num_kv_heads, spec.rows, row_bytes))
        return np.moveaxis(view, 0, -3)


def exchange(staged: np.ndarray, part: torch.Tensor, to_staging: bool) -> None:
    """Copy between staged field bytes [..., c, rows, row_bytes] and a tensor
    `part` [..., c*rows, cols]. Byte copies with numpy on the CPU: no dtype
    dispatch, and no OpenMP team to wait for on a busy machine (there a small torch
    copy_ with 2 threads was seen to take hundreds of times as long: docs/MEASUREMENTS.md)."""
    c, rows = staged.shape[-3], staged.shape[-2]
    if part.stride(-1) != 1 or part.dtype == torch.bool:
        tmp = part.contiguous() if to_staging else torch.empty(part.shape, dtype=part.dtype)
        exchange(staged, tmp, to_staging)
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


def _xxh3_64() -> object:
    """xxhash.xxh3_64_intdigest, or ConfigError naming the fix."""
    try:
        import xxhash
    except ImportError as exc:
        raise ConfigError.field(
            "checksum", DEFAULT_CHECKSUM, "needs the xxhash package: pip install 'xxhash>=3'"
        ) from exc
    return xxhash.xxh3_64_intdigest


class Checksum:
    """Per-region checksums, one 64-bit value per (block, layer) region.

    `xxh3-64` (default): XXH3-64 (xxHash 0.8, seed 0) of the region's bytes. A
    non-linear 64-bit hash that passes SMHasher: any corruption (a bit flip, paired
    or burst flips, a zeroed, stale or torn sector) goes undetected with probability
    about 2^-64 per region. The native I/O kernels compute it while the bytes are in
    cache; elsewhere the `xxhash` package does, bit for bit the same.
    `crc32`: zlib's CRC-32 (IEEE), always in Python on staged buffers: detects every
    burst of up to 32 bits and every 1- or 2-bit error (regions below 512 MiB); other
    random corruption escapes with probability about 2^-32. Slower.
    Neither is a cryptographic MAC: they catch accidents, not an attacker.
    """

    def __init__(self, name: str) -> None:
        if not isinstance(name, str):
            raise ConfigError.field("checksum", name, f"one of {', '.join(CHECKSUMS)}")
        if name in RETIRED_CHECKSUMS:
            raise ConfigError.field(
                "checksum",
                name,
                f"{name} is retired ({RETIRED_CHECKSUMS[name]}); use one of {', '.join(CHECKSUMS)}",
            )
        if name not in CHECKSUMS:
            raise ConfigError.field("checksum", name, f"one of {', '.join(CHECKSUMS)}")
        self.name = name
        # the native I/O kernels compute this checksum (kvstrata/platform/csrc/pio.cpp)
        self.native = name == "xxh3-64"
        self._fn = _xxh3_64() if name == "xxh3-64" else zlib.crc32

    def rows(self, regions: np.ndarray) -> np.ndarray:
        """Checksums of the last axis of a [..., nbytes] uint8 array (last axis
        contiguous): one value per region, shape [...]."""
        out = np.empty(regions.shape[:-1], dtype=np.uint64)
        fn = self._fn
        for idx in np.ndindex(out.shape):
            out[idx] = fn(regions[idx])
        return out

    def one(self, data: np.ndarray) -> int:
        """Checksum of one contiguous uint8 buffer of any length."""
        return int(self._fn(data))


def load_compressor() -> tuple:
    """(compress, decompress) from kvstrata.codecs.compress. That module imports its
    optional `zstandard` (the compress extra) only when it runs: without the extra,
    compressing raises ImportError naming it."""
    return lossless.compress, lossless.decompress


def direct_view(t: torch.Tensor, rows: int, piece_bytes: int) -> np.ndarray | None:
    """Field tensor [L, Hkv, c*rows, cols] (or [Hkv, c*rows, cols] for one layer) as a
    uint8 array [nl, Hkv, c, piece_bytes] sharing its memory, or None when it cannot
    be moved in place (not on the CPU, a block's rows not contiguous, unaligned)."""
    if t.device.type != "cpu" or t.dtype == torch.bool or piece_bytes % 8:
        return None
    if t.stride(-1) != 1 or (rows > 1 and t.stride(-2) != t.shape[-1]):
        return None
    if t.dim() == 3:
        t = t.unsqueeze(0)
    es = t.element_size()
    s0, s1, s2 = (s * es for s in t.stride()[:3])
    if t.data_ptr() % 8 or s0 % 8 or s1 % 8 or (rows * s2) % 8:
        return None
    base = t.detach().view(torch.uint8).numpy()
    c = t.shape[2] // rows
    return np.lib.stride_tricks.as_strided(
        base, shape=(t.shape[0], t.shape[1], c, piece_bytes), strides=(s0, s1, rows * s2, 1)
    )


@dataclass
class Template:
    """File-order segments of one item (a slot, or one layer of a slot).

    Arrays of length P: src (STAGE or 1 + index into `keys`), layer (0..nl-1), head,
    off (byte offset in the item for staged segments), nbytes, fpos (byte offset in the
    item's file extent), summed (bool: part of its layer's checksummed region; False
    for the slot tail). `gaps`: per-layer byte ranges [a, b) not covered by direct
    fields (moved and checksummed from the staging buffer).
    """

    keys: list[str]
    src: np.ndarray
    layer: np.ndarray
    head: np.ndarray
    off: np.ndarray
    nbytes: np.ndarray
    fpos: np.ndarray
    summed: np.ndarray
    gaps: list[tuple[int, int]]


def build_template(
    regions: dict[str, tuple[int, int]],
    direct: list[str],
    num_heads: int,
    layer_bytes: int,
    nl: int,
    item_bytes: int,
) -> Template:
    """The segment template for items of `nl` layers (`item_bytes` with any tail).

    Args:
        regions: field key -> (offset in the layer, bytes), in file order.
        direct: keys moved in place (their per-head pieces become iovecs).
        num_heads: Hkv.
        layer_bytes: bytes of one layer of a slot (16-aligned).
        nl: layers per item.
        item_bytes: bytes per item (a slot with its 4 KiB padding, or one layer).
    """
    gaps, pos = [], 0
    for key, (off, nbytes) in regions.items():
        if key in direct:
            if off > pos:
                gaps.append((pos, off))
            pos = off + nbytes
    if layer_bytes > pos:
        gaps.append((pos, layer_bytes))
    segs = []
    for li in range(nl):
        for key, (off, nbytes) in regions.items():
            if key not in direct:
                continue
            for g0, g1 in gaps:  # staged bytes before this field (in file order)
                if g1 == off:
                    segs.append((STAGE, li, 0, li * layer_bytes + g0, g1 - g0, 1))
            piece = nbytes // num_heads
            src = 1 + direct.index(key)
            segs.extend((src, li, h, 0, piece, 1) for h in range(num_heads))
        if gaps and gaps[-1][1] == layer_bytes:
            g0, g1 = gaps[-1]
            segs.append((STAGE, li, 0, li * layer_bytes + g0, g1 - g0, 1))
    if item_bytes > nl * layer_bytes:
        segs.append((STAGE, 0, 0, nl * layer_bytes, item_bytes - nl * layer_bytes, 0))
    src, layer, head, off, nbytes, summed = np.array(segs, dtype=np.int64).reshape(-1, 6).T
    fpos = np.concatenate([[0], np.cumsum(nbytes)[:-1]]).astype(np.int64)
    return Template(list(direct), src, layer, head, off, nbytes, fpos, summed > 0, gaps=gaps)


def piece_offsets(tpl: Template, views: list[np.ndarray], item_bytes: int, c: int) -> np.ndarray:
    """Byte offset of every piece of c items within its source buffer ([c * P], item
    major): staging pieces from the staging buffer's start, direct pieces from their
    view's first byte."""
    strides = np.zeros((1 + len(views), 3), dtype=np.int64)
    strides[STAGE] = (0, 0, item_bytes)
    for i, v in enumerate(views, 1):
        strides[i] = v.strides[:3]
    st = strides[tpl.src]
    first = tpl.off + tpl.layer * st[:, 0] + tpl.head * st[:, 1]
    return (first[None, :] + np.arange(c, dtype=np.int64)[:, None] * st[None, :, 2]).reshape(-1)


# Bytes per preadv/pwritev batch of the native path: small enough to be checksummed
# while still in L2 (read) or to stay there between checksum and write.
NATIVE_BATCH = 512 << 10


def native_io(
    lib: object,
    fd: int,
    tpl: Template,
    views: list[np.ndarray],
    stage: np.ndarray,
    file_base: np.ndarray,
    nl: int,
    write: bool,
    threads: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Move c items in one native call (kvstrata/platform/csrc/pio.cpp), checksumming every
    region (XXH3-64) while it is in cache, split over `threads` threads.

    Args:
        lib: the native library.
        fd: the arena file.
        tpl: the item template; views: direct views [nl, Hkv, c, piece] in tpl.keys order.
        stage: staging bytes [c, item_bytes] (C-contiguous) for the staged segments.
        file_base: [c] file offset of each item.
        nl: layers per item.
        write: pwritev (True) or preadv.
        threads: most threads to use.

    Returns:
        (per-layer XXH3-64 [c, nl], bool [c] items a read found past the end of file).

    Raises:
        OSError: a failed system call (errno set).
    """
    c, item_bytes = len(file_base), stage.shape[1]
    P = len(tpl.src)
    bases = np.array([stage.ctypes.data] + [v.ctypes.data for v in views], dtype=np.int64)
    addr = np.tile(bases[tpl.src], c) + piece_offsets(tpl, views, item_bytes, c)
    item = np.arange(c, dtype=np.int64)[:, None]
    length = np.broadcast_to(tpl.nbytes, (c, P)).reshape(-1).copy()
    foff = (file_base.astype(np.int64)[:, None] + tpl.fpos[None, :]).reshape(-1)
    out = np.where(tpl.summed[None, :], item * nl + tpl.layer[None, :], -1).reshape(-1)
    sums = np.zeros(c * nl, dtype=np.uint64)
    status = np.zeros(c * P, dtype=np.uint8)
    ptr = lambda a: a.ctypes.data  # noqa: E731
    rc = lib.kv_pio(
        fd,
        int(write),
        c * P,
        ptr(addr),
        ptr(length),
        ptr(foff),
        ptr(out),
        ptr(sums),
        ptr(status),
        NATIVE_BATCH,
        threads,
    )
    if rc < 0:
        raise OSError(-rc, os.strerror(-rc))
    return sums.reshape(c, nl), status.reshape(c, P).any(axis=1)
