"""Lossless byte-plane + zstd compression: bit-exact, ratio, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstrata.bench.codecs import synthetic_kv
from kvstrata.codecs import compress as lossless
from kvstrata.core.errors import CodecError


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_roundtrip_bit_exact_and_compresses(dtype):
    k, _ = synthetic_kv(2, 512, 64, dtype=dtype)
    raw = k.view(torch.uint8).numpy() if dtype == torch.bfloat16 else k.numpy()
    size = k.element_size()
    frame = lossless.compress(raw, size)
    out = np.empty(k.numel() * size, dtype=np.uint8)
    lossless.decompress(frame, out)
    assert np.array_equal(out, raw.reshape(-1).view(np.uint8))
    assert lossless.ratio(raw.nbytes, frame) > 1.05, lossless.ratio(raw.nbytes, frame)


@pytest.mark.parametrize("elem_size", [1, 2, 3, 4, 8])
def test_any_element_size(elem_size):
    data = np.random.default_rng(0).integers(0, 4, size=elem_size * 999, dtype=np.uint8)
    out = bytearray(len(data))
    lossless.decompress(lossless.compress(data.tobytes(), elem_size), memoryview(out))
    assert bytes(out) == data.tobytes()


def test_byte_planes_beat_plain_zstd():
    import zstandard

    k, v = synthetic_kv(2, 1024, 128, dtype=torch.float16)
    raw = torch.cat([k, v]).numpy()
    plain = len(zstandard.ZstdCompressor(level=3).compress(raw.tobytes()))
    assert len(lossless.compress(raw, 2)) < plain


def test_errors():
    with pytest.raises(CodecError, match="2-byte elements"):
        lossless.compress(b"abc", 2)
    frame = lossless.compress(b"abcd" * 100, 4)
    with pytest.raises(CodecError, match="out has"):
        lossless.decompress(frame, bytearray(10))
    with pytest.raises(CodecError, match="bad magic"):
        lossless.decompress(b"XXXX" + frame[4:], bytearray(400))
    with pytest.raises(CodecError, match="corrupt"):
        lossless.decompress(frame[:20] + b"\0" * 8 + frame[28:], bytearray(400))
