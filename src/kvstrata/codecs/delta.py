"""Lossless delta coding along tokens: each row minus the row before it, as integers.

A region of a buffer holds `count` groups of `rows` rows of `row_bytes` bytes (a
stored field [Hkv, rows, cols] of one block: count = Hkv, row_bytes = cols * element
size). Within each group, row r (r >= 1) is replaced by row r minus row r-1, taken
word by word as unsigned integers of the field's element size, modulo 2^(8*word):
the raw bit patterns of fp32/fp16/bf16/fp8 values, or the quantized codes of
int8/int4 fields (int4 as whole bytes: two codes per byte; nibble-wise differences
measured the same). Row 0 is kept. Decoding is a wrapping cumulative sum along the
rows, so the round trip is bit-exact for every bit pattern (NaN, inf, -0 included).

Measured on a model's real K/V (kvstrata.bench.delta; the figures:
docs/MEASUREMENTS.md): against byte planes + zstd alone it shrinks keys (int8 codes
most, fp8 and fp32/fp16 less, bf16 and int4 barely: per-channel offsets and slowly
rotating RoPE pairs change little from one token to the next) and grows values, so
the disk tier codes keys only. Measured and not kept: XOR with the previous row (ties
on fp32 keys, loses elsewhere), byte-by-byte differences (ties on fp32/fp16),
differences after an order-preserving map of float bits (worse), per-nibble
differences of int4 codes (the same as per byte).
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import numpy as np
import torch

from kvstrata.core.errors import CodecError

_WORD = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
# torch sums these (two's complement: the same bits as unsigned sums mod 2^bits)
_SIGNED = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
# one region in a frame header: offset u32, count u16, rows u16, row_bytes u16, word u8
_REGION = struct.Struct("<IHHHB")
_COUNT = struct.Struct("<B")
MAX_REGIONS = 255


class DeltaRegion(NamedTuple):
    """`count` groups of `rows` rows of `row_bytes` bytes at byte `offset`; rows are
    differenced as unsigned `word`-byte integers (1, 2, 4 or 8)."""

    offset: int
    count: int
    rows: int
    row_bytes: int
    word: int

    @property
    def nbytes(self) -> int:
        return self.count * self.rows * self.row_bytes


def check_regions(regions: tuple[DeltaRegion, ...] | list[DeltaRegion], length: int) -> None:
    """CodecError unless every region fits the header fields and `length` bytes, has
    whole words per row, and no two regions overlap."""
    if len(regions) > MAX_REGIONS:
        raise CodecError(f"delta: {len(regions)} regions, at most {MAX_REGIONS}")
    end = 0
    for r in sorted(regions):
        if r.word not in _WORD or r.row_bytes % r.word or min(r) < 0 or r.rows < 1:
            raise CodecError(f"delta: bad region {r}")
        if r.offset > 0xFFFFFFFF or max(r.count, r.rows, r.row_bytes) > 0xFFFF:
            raise CodecError(f"delta: region {r} does not fit the frame header")
        if r.offset < end or r.offset + r.nbytes > length:
            raise CodecError(f"delta: region {r} overlaps another or ends past {length} bytes")
        end = r.offset + r.nbytes


def _words(buf: np.ndarray, r: DeltaRegion) -> np.ndarray:
    """The region of uint8 `buf` as [count, rows, row_words] integers (a view)."""
    part = buf[r.offset : r.offset + r.nbytes]
    return part.view(_WORD[r.word]).reshape(r.count, r.rows, r.row_bytes // r.word)


def encode(raw: np.ndarray, regions: tuple[DeltaRegion, ...] | list[DeltaRegion]) -> np.ndarray:
    """A copy of uint8 `raw` with each region's rows replaced by their differences."""
    out = raw.copy()
    for r in regions:
        if r.rows < 2:
            continue
        src, dst = _words(raw, r), _words(out, r)
        np.subtract(src[:, 1:], src[:, :-1], out=dst[:, 1:])  # unsigned: wraps mod 2^bits
    return out


def decode(buf: np.ndarray, regions: tuple[DeltaRegion, ...] | list[DeltaRegion]) -> None:
    """Undo `encode` in place on uint8 `buf` (a wrapping cumulative sum along rows).

    torch's cumsum does it (faster than numpy's along a middle axis); numpy's
    where the words are not aligned to their size."""
    for r in regions:
        if r.rows < 2:
            continue
        w = _words(buf, r)
        if w.flags.aligned and w.flags.writeable:
            torch.from_numpy(w.view(_SIGNED[r.word])).cumsum_(1)
        else:
            np.cumsum(w, axis=1, dtype=w.dtype, out=w)


def pack(regions: tuple[DeltaRegion, ...] | list[DeltaRegion]) -> bytes:
    """The regions as frame-header bytes: a count (u8), then one record per region."""
    return _COUNT.pack(len(regions)) + b"".join(_REGION.pack(*r) for r in regions)


def unpack(view: memoryview, at: int, length: int) -> tuple[list[DeltaRegion], int]:
    """Regions packed at `view[at:]` (checked against `length` bytes) and the offset
    after them.

    Raises:
        CodecError: the header is cut short or names regions that do not fit.
    """
    if len(view) < at + _COUNT.size:
        raise CodecError("decompress: frame shorter than its header")
    (n,) = _COUNT.unpack_from(view, at)
    at += _COUNT.size
    if len(view) < at + n * _REGION.size:
        raise CodecError("decompress: frame shorter than its header")
    regions = [DeltaRegion(*_REGION.unpack_from(view, at + i * _REGION.size)) for i in range(n)]
    try:
        check_regions(regions, length)
    except CodecError as exc:
        raise CodecError(f"decompress: corrupt frame header ({exc})") from exc
    return regions, at + n * _REGION.size
