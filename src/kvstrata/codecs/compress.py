"""Lossless byte compression for the disk tier: byte-plane shuffle + zstd.

The bytes of each element are split into planes (all first bytes, then all second
bytes, ...), the "差分编码"/delta direction: the high byte of an fp16/bf16 K/V value
(sign + exponent + top mantissa bits) varies slowly and compresses well, while the
low mantissa byte is nearly random. Grouping them lets zstd exploit the former
without being disturbed by the latter.

Optionally (`delta=`), regions of the buffer are first delta coded along tokens
(kvstrata.codecs.delta: each token's row minus the previous one, as integers, exactly
invertible). On real K/V (SmolLM2-135M, kvstrata.bench.delta) that pays for keys and
not for values; the disk tier applies it to key fields when asked (disk_delta).

Frames (little endian):
    b"KVZ1" | elem_size (u8) | raw length (u64) | zstd frame            (no transform)
    b"KVZ2" | elem_size (u8) | raw length (u64) | regions | zstd frame  (delta coded)
where `regions` is a count (u8) and, per region, offset u32, count u16, rows u16,
row_bytes u16, word u8 (kvstrata.codecs.delta). A frame without `delta` is KVZ1,
byte for byte what earlier versions wrote; both are read.

Needs the `zstandard` package: `pip install 'kvstrata[compress]'`.
"""

from __future__ import annotations

import struct

import numpy as np

from kvstrata.codecs import delta as _delta
from kvstrata.codecs.delta import DeltaRegion
from kvstrata.core.errors import CodecError

_MAGIC = b"KVZ1"
_MAGIC_DELTA = b"KVZ2"
_HEADER = struct.Struct("<4sBQ")
DEFAULT_LEVEL = 3


def _zstd():
    try:
        import zstandard
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "lossless KV compression needs the 'zstandard' package: "
            "pip install 'kvstrata[compress]'"
        ) from exc
    return zstandard


def _as_bytes(buf: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
    if isinstance(buf, np.ndarray):
        return np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
    return np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)


_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def shuffle(raw: np.ndarray, elem_size: int) -> np.ndarray:
    """Byte planes of `raw` (uint8, length a multiple of elem_size), plane-major."""
    if elem_size == 1:
        return raw
    if elem_size in _UINT:  # shifts of whole words: much faster than a strided transpose
        words = raw.view(_UINT[elem_size])
        planes = np.empty((elem_size, words.size), dtype=np.uint8)
        for i in range(elem_size):
            planes[i] = (words >> (8 * i)).astype(np.uint8)
        return planes.reshape(-1)
    return np.ascontiguousarray(raw.reshape(-1, elem_size).T).reshape(-1)


def unshuffle(planes: np.ndarray, elem_size: int, target: np.ndarray) -> None:
    """Inverse of `shuffle`, written into `target` (uint8, same length)."""
    if elem_size == 1:
        target[:] = planes
        return
    rows = planes.reshape(elem_size, -1)
    if elem_size in _UINT:
        word = _UINT[elem_size]
        out = target.view(word)
        out[:] = rows[0]
        for i in range(1, elem_size):
            out |= rows[i].astype(word) << word(8 * i)
        return
    target.reshape(-1, elem_size)[:] = rows.T


def compress(
    buf: bytes | bytearray | memoryview | np.ndarray,
    elem_size: int,
    level: int = DEFAULT_LEVEL,
    delta: tuple[DeltaRegion, ...] | list[DeltaRegion] = (),
) -> bytes:
    """Compress `buf` losslessly, shuffling its bytes into `elem_size` planes first.

    Args:
        buf: the raw bytes (e.g. a block's fp16 K/V, or a numpy array of any dtype).
        elem_size: bytes per element (2 for fp16/bf16, 4 for fp32, 1 for int codecs).
        level: zstd level (3 = zstd's default; 1 is faster, higher is smaller).
        delta: regions to delta code along tokens before the shuffle (see
            kvstrata.codecs.delta); empty (default): a KVZ1 frame, as before.

    Returns:
        A self-describing frame for `decompress`.

    Raises:
        CodecError: the length is not a multiple of elem_size, elem_size is not
            1..255, or a delta region does not fit the buffer.
        ImportError: zstandard is not installed (names the `compress` extra).
    """
    raw = _as_bytes(buf)
    if not 1 <= elem_size <= 255 or raw.size % elem_size:
        raise CodecError(
            f"compress: {raw.size} bytes is not a whole number of {elem_size}-byte elements"
        )
    head = _HEADER.pack(_MAGIC, elem_size, raw.size)
    if delta:
        _delta.check_regions(delta, raw.size)
        raw = _delta.encode(raw, delta)
        head = _HEADER.pack(_MAGIC_DELTA, elem_size, raw.size) + _delta.pack(delta)
    planes = shuffle(raw, elem_size)
    return head + _zstd().ZstdCompressor(level=level).compress(planes.data)


def decompress(data: bytes | bytearray | memoryview, out: memoryview | np.ndarray) -> None:
    """Decompress a `compress` frame into `out` (exactly the original bytes).

    Args:
        data: the frame.
        out: a writable buffer or contiguous numpy array of exactly the original size.

    Raises:
        CodecError: not a kvstrata frame, corrupt data, or `out` has the wrong size.
    """
    view = memoryview(data)
    if len(view) < _HEADER.size:
        raise CodecError("decompress: frame shorter than its header")
    magic, elem_size, length = _HEADER.unpack_from(view)
    if magic not in (_MAGIC, _MAGIC_DELTA) or elem_size == 0:
        raise CodecError("decompress: not a kvstrata compressed frame (bad magic)")
    regions, body = [], _HEADER.size
    if magic == _MAGIC_DELTA:
        regions, body = _delta.unpack(view, body, length)
    target = out.reshape(-1).view(np.uint8) if isinstance(out, np.ndarray) else None
    if target is None:
        target = np.frombuffer(memoryview(out).cast("B"), dtype=np.uint8)
    if target.size != length:
        raise CodecError(f"decompress: frame holds {length} bytes, out has {target.size}")
    zstd = _zstd()
    try:
        planes = zstd.ZstdDecompressor().decompress(view[body:], max_output_size=length)
    except zstd.ZstdError as exc:
        raise CodecError(f"decompress: corrupt frame ({exc})") from exc
    if len(planes) != length:
        raise CodecError(f"decompress: frame decoded to {len(planes)} bytes, expected {length}")
    if length % elem_size:
        raise CodecError(f"decompress: {length} bytes is not whole {elem_size}-byte elements")
    unshuffle(np.frombuffer(planes, dtype=np.uint8), elem_size, target)
    _delta.decode(target, regions)


def ratio(raw_nbytes: int, frame: bytes) -> float:
    """Compression ratio raw / compressed (> 1 means smaller)."""
    return raw_nbytes / max(1, len(frame))
