"""The fused Triton dequant kernel against the torch reference, on the CPU.

Triton's interpreter (TRITON_INTERPRET=1) runs the very kernel the GPU compiles, with
numpy, on CPU tensors: every codec (int8, int4 keys / values and their group sizes,
fp8), every output dtype, strided outputs and edge values must decode to the
reference's bits. Skipped when triton (the `cuda` extra) is not installed."""

from __future__ import annotations

import pytest
import torch

from kvstrata.codecs import _reference as ref
from kvstrata.codecs import triton_dequant as td
from kvstrata.codecs.registry import get_codec
from kvstrata.core.layout import BlockLayout

pytest.importorskip("triton", reason="the fused dequant kernel needs the `cuda` extra")

CODECS = ["int8", "int4", "int4-g32", "fp8"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _encode(codec_name: str, kind: str, x: torch.Tensor, block_size: int = 64):
    codec = get_codec(codec_name)
    lay = BlockLayout(1, x.shape[0], x.shape[-1], block_size, x.dtype)
    blocks = x.shape[-2] // block_size
    enc = {
        f: torch.empty(x.shape[0], blocks * s.rows, s.cols, dtype=s.dtype)
        for f, s in codec.fields(kind, lay).items()
    }
    codec.encode(kind, x, enc)
    return codec, enc


def _reference_decode(codec_name: str, kind: str, enc: dict, out: torch.Tensor, bs: int) -> None:
    """The eager torch reference itself (not the native kernels the codecs may use)."""
    if codec_name == "int8":
        ref.int8_decode(enc["data"], enc["scale"], enc["zero"], out)
    elif codec_name == "fp8":
        ref.fp8_decode(enc["data"], enc["scale"], out, bs)
    else:
        group = get_codec(codec_name).group
        fn = ref.int4k_decode if kind == "k" else ref.int4v_decode
        fn(enc["data"], enc["scale"], enc["zero"], out, group)


def _kv(dtype: torch.dtype, heads: int = 2, rows: int = 128, dim: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(heads, rows, dim, generator=g) * 3
    x[0, :, 5] *= 20  # an outlier channel (keys)
    x[1, 64:128] = 0.0  # an all-zero block: scale 0
    x[0, 64:72] = 1.5  # constant rows
    x[1, 3, :] = torch.tensor([1e-3, -1e-3] * (dim // 2))  # tiny values: fp8 subnormals
    x[0, 7, 0] = -0.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["k", "v"])
@pytest.mark.parametrize("codec_name", CODECS)
def test_kernel_equals_reference_bit_for_bit(codec_name, kind, dtype):
    x = _kv(dtype)
    codec, enc = _encode(codec_name, kind, x)
    expected = torch.empty_like(x)
    _reference_decode(codec_name, kind, enc, expected, 64)
    # decode into a strided view, as into the staging buffer: rows 10..137 of 300
    buffer = torch.full((2, 300, 64), float("nan"), dtype=dtype)
    out = buffer[:, 10:138]
    assert td.decode(codec, kind, enc, out)
    bits = torch.int32 if dtype == torch.float32 else torch.int16  # -0.0 != 0.0 here
    assert torch.equal(out.view(bits), expected.view(bits))
    assert buffer[:, :10].isnan().all() and buffer[:, 138:].isnan().all()  # nothing else written


def test_leading_dims_collapse_and_odd_shapes():
    # [layers, heads, rows, D] fields as a whole-tier decode passes them
    x = torch.randn(3, 2, 96, 32)
    codec = get_codec("int4-g32")
    lay = BlockLayout(3, 2, 32, 32)
    for kind in "kv":
        enc = {
            f: torch.empty(3, 2, 3 * s.rows, s.cols, dtype=s.dtype)
            for f, s in codec.fields(kind, lay).items()
        }
        codec.encode(kind, x, enc)
        expected, out = torch.empty_like(x), torch.empty_like(x)
        _reference_decode("int4-g32", kind, enc, expected, 32)
        assert td.decode(codec, kind, enc, out)
        assert torch.equal(out, expected)
    # D = 48 (not a power of two) with int8: masked columns
    x = torch.randn(2, 40, 48)
    codec, enc = _encode("int8", "v", x, block_size=8)
    expected, out = torch.empty_like(x), torch.empty_like(x)
    _reference_decode("int8", "v", enc, expected, 8)
    assert td.decode(codec, "v", enc, out) and torch.equal(out, expected)


def test_declines_what_it_cannot_take(monkeypatch):
    x = torch.randn(2, 64, 64)
    codec, enc = _encode("int8", "k", x)
    assert not td.decode(get_codec("none"), "k", {"data": x}, torch.empty_like(x))
    assert not td.decode(codec, "k", enc, torch.empty(2, 64, 64, dtype=torch.float64))
    # leading dims that do not collapse into one stride
    big = torch.empty(2, 3, 64, 64)[:, 1:]
    assert not td.decode(codec, "k", {f: t[:, None] for f, t in enc.items()}, big)
    monkeypatch.delenv("TRITON_INTERPRET")  # CPU tensors without the interpreter
    assert not td.can_decode(codec, x)
    out = torch.empty_like(x)
    td.decode_fields(codec, "k", enc, out)  # falls back to the codec's own decode
    expected = torch.empty_like(x)
    codec.decode("k", enc, expected)
    assert torch.equal(out, expected)


def test_tier_layer_fields_decode_like_read_layer():
    """What the staging path does on CUDA — read one layer's encoded fields, decode them
    with the kernel — gives read_layer's values."""
    from kvstrata.tiers.memory import MemoryTier

    lay = BlockLayout(2, 2, 64, 64)
    for name in CODECS:
        tier = MemoryTier("host", lay, 4, get_codec(name))
        g = torch.Generator().manual_seed(2)
        tier.write_blocks(
            [0, 1, 2, 3],
            torch.randn(lay.raw_shape("k", 4), generator=g),
            torch.randn(lay.raw_shape("v", 4), generator=g),
        )
        slots = [3, 0, 1]  # two runs
        outs = {
            f"{kind}.{f}": torch.empty(2, 3 * s.rows, s.cols, dtype=s.dtype)
            for kind in "kv"
            for f, s in tier.field_specs[kind].items()
        }
        tier.read_layer_fields(1, slots, outs)
        ek, ev = torch.empty(2, 192, 64), torch.empty(2, 192, 64)
        tier.read_layer(1, slots, ek, ev)
        for kind, expected in (("k", ek), ("v", ev)):
            out = torch.empty_like(expected)
            enc = {f: outs[f"{kind}.{f}"] for f in tier.field_specs[kind]}
            assert td.decode(tier.codec, kind, enc, out)
            assert torch.equal(out, expected), (name, kind)


def test_a_failing_kernel_switches_itself_off(monkeypatch):
    class Broken:
        def __getitem__(self, grid):
            raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(td, "_kernel", lambda: Broken())
    monkeypatch.setattr(td, "disabled", None)
    x = torch.randn(2, 64, 64)
    codec, enc = _encode("int8", "k", x)
    out = torch.empty_like(x)
    with pytest.warns(RuntimeWarning, match="decoded with torch ops from now on"):
        assert not td.decode(codec, "k", enc, out)
    assert td.disabled == "RuntimeError: no kernel image is available for execution on the device"
    assert not td.can_decode(codec, out)
    td.decode_fields(codec, "k", enc, out)  # the codec's own decode
    expected = torch.empty_like(x)
    codec.decode("k", enc, expected)
    assert torch.equal(out, expected)
