"""DiskTier's on-disk format: the slot layout, per-layer checksums, vectored file I/O.

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

The direct path moves bytes between the arena file and the caller's tensors, one
iovec per contiguous piece: for a field stored as [Hkv, rows, cols] per (block,
layer), one piece per head of each block. With the native kernels (`native_io`,
kvstrata/native/pio.cpp) one call per chunk batches the pieces into preadv/pwritev
calls, checksums each batch while it is in cache and splits the chunk over threads;
without them, os.preadv / os.pwritev and a numpy checksum do the same. Field
padding, the slot tail and fields that cannot be viewed directly (a GPU tensor, a
4-byte scale) go through a small staging buffer. The `mlh64` checksum is linear
in the words of a layer, so it is summed piece by piece right after each chunk is
read (the bytes are still in cache) with no copy at all.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from kvstrata.codecs.base import Codec
from kvstrata.errors import ConfigError
from kvstrata.layout import KINDS, BlockLayout, FieldSpec

CHECKSUMS = ("mlh64", "crc32")
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
    dispatch, and no OpenMP team to wait for on a busy machine (a 1 MiB torch
    copy_ took 15 ms instead of 25 us with 2 threads on 2 loaded cores)."""
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


def mlh_keys(n: int) -> np.ndarray:
    """Fixed odd 64-bit multipliers (splitmix64 of 1..n): identical in every process."""
    with np.errstate(over="ignore"):
        z = np.arange(1, n + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return (z ^ (z >> np.uint64(31))) | np.uint64(1)


class Checksum:
    """Per-region checksums.

    `mlh64` (default): sum of 64-bit words times fixed odd multipliers, mod 2^64, one
    numpy matmul over many regions. It detects every change confined to one word
    (torn, stale or zeroed sectors change many words and escape with negligible
    probability); it is not a cryptographic MAC. Being linear, a region's value is
    the sum of its pieces' values (`keys` at the pieces' word offsets), which is what
    lets the direct path checksum the caller's tensors in place.
    `crc32`: zlib.crc32 per region, slower, the classic guarantee for burst errors.
    """

    def __init__(self, name: str, max_bytes: int) -> None:
        if name not in CHECKSUMS:
            raise ConfigError.field("checksum", name, f"one of {', '.join(CHECKSUMS)}")
        self.name = name
        self.linear = name == "mlh64"
        self.keys = mlh_keys(max_bytes // 8 + 1) if self.linear else None

    def rows(self, regions: np.ndarray) -> np.ndarray:
        """Checksums of the last axis of a [..., nbytes] uint8 array (nbytes % 8 == 0,
        last axis contiguous): one value per region, shape [...]."""
        if self.keys is None:
            flat = regions.reshape(-1, regions.shape[-1])
            sums = np.array([zlib.crc32(r) for r in flat], dtype=np.uint64)
            return sums.reshape(regions.shape[:-1])
        words = regions.view(np.uint64)
        return words @ self.keys[: words.shape[-1]]

    def one(self, data: np.ndarray) -> int:
        """Checksum of one uint8 buffer of any length."""
        if self.keys is None:
            return zlib.crc32(data)
        padded = np.zeros(round_up(len(data), 8), dtype=np.uint8)
        padded[: len(data)] = data
        return int(self.rows(padded[None])[0])


def load_compressor() -> tuple:
    """(compress, decompress) from kvstrata.codecs.compress, or ConfigError."""
    try:
        from kvstrata.codecs import compress as mod
    except ImportError as exc:
        raise ConfigError.field(
            "compress", True, f"needs kvstrata.codecs.compress, which failed to import: {exc}"
        ) from exc
    return mod.compress, mod.decompress


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


def flat_bytes(arr: np.ndarray) -> memoryview:
    """A flat byte memoryview from `arr`'s first byte to its last (strides >= 0)."""
    span = sum((n - 1) * s for n, s in zip(arr.shape, arr.strides, strict=True)) + 1
    return memoryview(np.lib.stride_tricks.as_strided(arr, shape=(span,), strides=(1,)))


@dataclass
class Template:
    """File-order segments of one item (a slot, or one layer of a slot).

    Arrays of length P: src (STAGE or 1 + index into `keys`), layer (0..nl-1), head,
    off (byte offset in the item for staged segments), nbytes, fpos (byte offset in the
    item's file extent), woff (first checksum word within its layer; -1: the slot tail,
    not checksummed). `gaps`: per-layer byte ranges [a, b) not covered by direct fields
    (checksummed from the staging buffer).
    """

    keys: list[str]
    src: np.ndarray
    layer: np.ndarray
    head: np.ndarray
    off: np.ndarray
    nbytes: np.ndarray
    fpos: np.ndarray
    woff: np.ndarray
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
                    segs.append((STAGE, li, 0, li * layer_bytes + g0, g1 - g0, g0 // 8))
            piece = nbytes // num_heads
            src = 1 + direct.index(key)
            segs.extend((src, li, h, 0, piece, (off + h * piece) // 8) for h in range(num_heads))
        if gaps and gaps[-1][1] == layer_bytes:
            g0, g1 = gaps[-1]
            segs.append((STAGE, li, 0, li * layer_bytes + g0, g1 - g0, g0 // 8))
    if item_bytes > nl * layer_bytes:
        segs.append((STAGE, 0, 0, nl * layer_bytes, item_bytes - nl * layer_bytes, -1))
    src, layer, head, off, nbytes, woff = np.array(segs, dtype=np.int64).reshape(-1, 6).T
    fpos = np.concatenate([[0], np.cumsum(nbytes)[:-1]]).astype(np.int64)
    return Template(list(direct), src, layer, head, off, nbytes, fpos, woff, gaps=gaps)


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


def iovecs(
    tpl: Template,
    views: list[np.ndarray],
    stage: np.ndarray,
    item_bytes: int,
    run_of_block: np.ndarray,
) -> tuple[list[memoryview], np.ndarray, np.ndarray]:
    """iovecs for c items, adjacent pieces merged; the run boundaries in the list.

    Args:
        tpl: the item template.
        views: direct views [nl, Hkv, c, piece], in `tpl.keys` order.
        stage: staging bytes [c, item_bytes] (C-contiguous).
        item_bytes: bytes per item in the staging buffer.
        run_of_block: [c] run index of each item (items of one run are contiguous
            in the file, so their iovecs go to the same syscall).

    Returns:
        (iovecs, bounds [runs+1] into iovecs, cumulative bytes [len(iovecs)+1]).
    """
    c = len(run_of_block)
    bufs = [memoryview(stage.reshape(-1))] + [flat_bytes(v) for v in views]
    start = piece_offsets(tpl, views, item_bytes, c)
    src = np.broadcast_to(tpl.src, (c, len(tpl.src))).reshape(-1)
    length = np.broadcast_to(tpl.nbytes, (c, len(tpl.src))).reshape(-1)
    run = np.repeat(run_of_block, len(tpl.src))
    brk = np.ones(len(src), dtype=bool)
    brk[1:] = (
        (src[1:] != src[:-1]) | (start[1:] != start[:-1] + length[:-1]) | (run[1:] != run[:-1])
    )
    idx = np.flatnonzero(brk)
    m_len = np.add.reduceat(length, idx)
    iov = [
        bufs[s][a : a + n]
        for s, a, n in zip(src[idx].tolist(), start[idx].tolist(), m_len.tolist(), strict=True)
    ]
    bounds = np.searchsorted(run[idx], np.arange(run_of_block[-1] + 2))
    cum = np.zeros(len(iov) + 1, dtype=np.int64)
    np.cumsum(m_len, out=cum[1:])
    return iov, bounds, cum


def vector_io(fd: int, iov: list[memoryview], cum: np.ndarray, offset: int, write: bool) -> bool:
    """pwritev / preadv `iov` at `offset`, IOV_MAX buffers per call, resuming after a
    short transfer. `cum`: cumulative sizes, cum[0] == 0. False when a read hits the
    end of the file."""
    call = os.pwritev if write else os.preadv
    i = 0
    while i < len(iov):
        n = min(IOV_MAX, len(iov) - i)
        got = call(fd, iov[i : i + n], offset)
        if got == 0 and not write:
            return False
        offset += got
        if got == cum[i + n] - cum[i]:
            i += n
            continue
        # short transfer (a signal, a huge request): restart inside buffer j
        j = int(np.searchsorted(cum, cum[i] + got, side="right")) - 1
        skip = int(cum[i] + got - cum[j])
        iov = [iov[j][skip:], *iov[j + 1 :]]
        cum = cum[j:] - (cum[j] + skip)
        cum[0] = 0
        i = 0
    return True


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
    keys: np.ndarray,
    write: bool,
    threads: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Move c items in one native call (kvstrata/native/pio.cpp), checksumming every
    piece while it is in cache, split over `threads` threads.

    Args:
        lib: the native library.
        fd: the arena file.
        tpl: the item template; views: direct views [nl, Hkv, c, piece] in tpl.keys order.
        stage: staging bytes [c, item_bytes] (C-contiguous) for the staged segments.
        file_base: [c] file offset of each item.
        nl: layers per item.
        keys: the mlh64 multipliers.
        write: pwritev (True) or preadv.
        threads: most threads to use.

    Returns:
        (per-layer mlh64 sums [c, nl], bool [c] items a read found past the end of file).

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
    woff = np.broadcast_to(np.maximum(tpl.woff, 0), (c, P)).reshape(-1).copy()
    out = np.where(tpl.woff[None, :] >= 0, item * nl + tpl.layer[None, :], -1).reshape(-1)
    sums = np.zeros(c * nl, dtype=np.uint64)
    status = np.zeros(c * P, dtype=np.uint8)
    ptr = lambda a: a.ctypes.data  # noqa: E731
    rc = lib.kv_pio(
        fd, int(write), c * P, ptr(addr), ptr(length), ptr(foff), ptr(woff), ptr(out),
        ptr(keys), ptr(sums), ptr(status), NATIVE_BATCH, threads,
    )  # fmt: skip
    if rc < 0:
        raise OSError(-rc, os.strerror(-rc))
    return sums.reshape(c, nl), status.reshape(c, P).any(axis=1)
