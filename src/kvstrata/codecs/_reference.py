"""Eager torch quantize/dequantize primitives: the fallback and the test oracle.

These define the codecs' exact bits; the C++ kernels (kvstrata/platform/csrc/codecs.cpp)
compute the same operations in the same order (fp32 arithmetic, a*b+c rounded twice, round half
to even), so both paths produce identical fields and decoded values.

Shapes: x / out are [..., R, D] (R = n * block_size); fields are [..., rows, cols].
Asymmetric min/max quantization with `levels` steps:

    scale = fp16((max - min) / levels)     zero = fp16(min)
    q     = clamp(round((x - zero) / scale), 0, levels)     (q = 0 when scale == 0)
    x'    = q * scale + zero
"""

from __future__ import annotations

import torch

from kvstrata.core.errors import CodecError

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def check_finite(x: torch.Tensor) -> None:
    """Raise CodecError when x holds inf or NaN (one vectorised check per call)."""
    if not bool(torch.isfinite(x).all()):
        raise CodecError("cannot encode non-finite K/V (inf or NaN in the input)")


def _params(mn: torch.Tensor, mx: torch.Tensor, levels: float):
    s16 = ((mx - mn) / levels).to(torch.float16)
    z16 = mn.to(torch.float16)
    if not (bool(torch.isfinite(s16).all()) and bool(torch.isfinite(z16).all())):
        raise CodecError(
            "K/V values exceed the fp16 range of the scale/zero point (|x| > 65504); "
            "use the 'none' or 'fp8' codec for this model"
        )
    sf = s16.float()
    inv = torch.where(sf > 0, sf.reciprocal(), torch.zeros_like(sf))
    return s16, z16, inv


def _quantize(xf: torch.Tensor, z16: torch.Tensor, inv: torch.Tensor, levels: float):
    return ((xf - z16.float()) * inv).round_().clamp_(0, levels).to(torch.uint8)


def _pack(q: torch.Tensor, out: torch.Tensor) -> None:
    # Byte j = channel j (low nibble) | channel j + D/2 (high nibble).
    half = q.shape[-1] // 2
    out.copy_(q[..., :half] | (q[..., half:] << 4))


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    return torch.cat([packed & 15, packed >> 4], dim=-1)


def int8_encode(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor):
    """Per-row int8: data [..., R, D] uint8, scale/zero [..., R, 1] fp16."""
    check_finite(x)
    xf = x.float()
    s16, z16, inv = _params(xf.amin(-1, keepdim=True), xf.amax(-1, keepdim=True), 255.0)
    data.copy_(_quantize(xf, z16, inv, 255.0))
    scale.copy_(s16)
    zero.copy_(z16)


def int8_decode(data: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, out: torch.Tensor):
    """Inverse of `int8_encode` into out [..., R, D]."""
    out.copy_(data.float() * scale.float() + zero.float())


def int4v_encode(x, data, scale, zero, group: int) -> None:
    """Per-token int4 with groups of `group` channels: data [..., R, D/2] uint8,
    scale/zero [..., R, D/group] fp16."""
    check_finite(x)
    *lead, rows, dim = x.shape
    xg = x.float().reshape(*lead, rows, dim // group, group)
    s16, z16, inv = _params(xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True), 15.0)
    _pack(_quantize(xg, z16, inv, 15.0).reshape(*lead, rows, dim), data)
    scale.copy_(s16.squeeze(-1))
    zero.copy_(z16.squeeze(-1))


def int4v_decode(data, scale, zero, out: torch.Tensor, group: int) -> None:
    """Inverse of `int4v_encode` into out [..., R, D]."""
    *lead, rows, dim = out.shape
    q = _unpack(data).float().reshape(*lead, rows, dim // group, group)
    values = q * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)
    out.copy_(values.reshape(*lead, rows, dim))


def int4k_encode(x, data, scale, zero, group: int) -> None:
    """Per-channel int4 with groups of `group` tokens: data [..., R, D/2] uint8,
    scale/zero [..., R/group, D] fp16."""
    check_finite(x)
    *lead, rows, dim = x.shape
    xg = x.float().reshape(*lead, rows // group, group, dim)
    s16, z16, inv = _params(xg.amin(-2, keepdim=True), xg.amax(-2, keepdim=True), 15.0)
    _pack(_quantize(xg, z16, inv, 15.0).reshape(*lead, rows, dim), data)
    scale.copy_(s16.squeeze(-2))
    zero.copy_(z16.squeeze(-2))


def int4k_decode(data, scale, zero, out: torch.Tensor, group: int) -> None:
    """Inverse of `int4k_encode` into out [..., R, D]."""
    *lead, rows, dim = out.shape
    q = _unpack(data).float().reshape(*lead, rows // group, group, dim)
    values = q * scale.float().unsqueeze(-2) + zero.float().unsqueeze(-2)
    out.copy_(values.reshape(*lead, rows, dim))


def fp8_encode(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, block: int) -> None:
    """float8_e4m3fn with one fp32 scale (absmax / 448) per block of `block` rows:
    data [..., R, D] float8_e4m3fn, scale [..., R/block, 1] fp32. Saturating."""
    check_finite(x)
    *lead, rows, dim = x.shape
    xb = x.float().reshape(*lead, rows // block, block * dim)
    sc = xb.abs().amax(-1, keepdim=True) / FP8_MAX
    inv = torch.where(sc > 0, sc.reciprocal(), torch.zeros_like(sc))
    q = (xb * inv).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    data.view(torch.uint8).copy_(q.view(torch.uint8).reshape(*lead, rows, dim))
    scale.copy_(sc)


def fp8_decode(data: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, block: int) -> None:
    """Inverse of `fp8_encode` into out [..., R, D]."""
    *lead, rows, dim = out.shape
    q = data.view(torch.float8_e4m3fn).float().reshape(*lead, rows // block, block * dim)
    out.copy_((q * scale.float()).reshape(*lead, rows, dim))
