"""Fused dequantisation on the GPU (Triton): int8 / fp8 / int4 blocks decoded where
they are used.

Quantized host blocks cross PCIe as they are stored (4-8x fewer bytes than the model
dtype) and are decoded into the staging buffer by one kernel launch per kind (K or V)
and chunk, instead of the eager reference's ~10 torch ops and temporaries. The kernel
reads the codecs' fields exactly as kvstrata stores them (see int8.py, fp8.py,
int4.py) and computes the reference's arithmetic in the same order, rounded the same
way (fp32, a * b then + c, no fused multiply-add: `enable_fp_fusion=False`), so its
output equals `kvstrata.codecs._reference` bit for bit:

    mode      data [H, R, ·]                   scale / zero [H, ·, ·]     value
    int8      uint8 [R, D]                     fp16 [R, 1] / fp16 [R, 1]    q*s + z
    int4 K    uint8 [R, D/2]: byte j = ch j    fp16 [R/g, D] (per channel,  q*s + z
              (low nibble) | ch j+D/2 (high)   g tokens per group)
    int4 V    same packing                     fp16 [R, D/g] (per token)    q*s + z
    fp8       e4m3fn bits as uint8 [R, D]      fp32 [R/bs, 1] (per block)   f*s

fp8 codes are decoded from their bits (sign, 4-bit exponent with bias 7, 3-bit
mantissa; subnormals when the exponent is 0) rather than through a float8 load, so
the same kernel runs on GPUs without fp8 conversions and in Triton's interpreter.
The e4m3fn NaN code never occurs: the encoder saturates at +-448.

Used on CUDA when `triton` is importable (`pip install "kvstrata[cuda]"`). `runs`
counts the kernel's launches in this process (what `kvstrata bench gpu` reports as
fused_dequant), `disabled` says why it was switched off. On the CPU the kernel
runs in Triton's interpreter (`TRITON_INTERPRET=1`, numpy), which is how the tests
check it against the reference without a GPU (tests/codecs/test_triton_dequant.py).
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from typing import Any

import torch

from kvstrata.codecs._kernels import as_3d
from kvstrata.codecs.base import Codec
from kvstrata.codecs.fp8 import Fp8Codec
from kvstrata.codecs.int4 import Int4Codec
from kvstrata.codecs.int8 import Int8Codec

# Imported at first use (a noticeable delay), never on the CPU path: `_import_triton`.
triton: Any = None
tl: Any = None

MODE_INT8, MODE_INT4_K, MODE_INT4_V, MODE_FP8 = 0, 1, 2, 3
_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TILE = 4096  # elements per program: BLOCK_R rows x BLOCK_D (power of two >= D) columns


def available() -> bool:
    """Triton is installed (`kvstrata[cuda]`)."""
    return triton is not None or importlib.util.find_spec("triton") is not None


def _import_triton() -> bool:
    global triton, tl  # the kernel's globals: Triton resolves `tl` there when compiling
    if triton is None:
        try:
            import triton as triton_mod
            import triton.language as tl_mod
        except ImportError:
            return False
        triton, tl = triton_mod, tl_mod
    return True


def interpreting() -> bool:
    """Triton's interpreter is on (TRITON_INTERPRET=1): kernels run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _dequant(
    data,
    scale,
    zero,
    out,
    num_rows,
    dim,
    d_sh,
    d_sr,
    s_sh,
    s_sr,
    z_sh,
    z_sr,
    o_sh,
    o_sr,
    MODE: tl.constexpr,
    GROUP: tl.constexpr,
    BF16: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """The Triton kernel (jitted by `_kernel`). One program: BLOCK_R rows x all D
    columns of one head; strides in elements (d_: data, s_: scale, z_: zero, o_: out;
    _sh: head, _sr: row)."""
    h = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < num_rows
    mask = row_ok[:, None] & (cols[None, :] < dim)
    r2 = rows[:, None]
    c2 = cols[None, :]
    if MODE == 0:  # int8: per-row scale and zero point
        q = tl.load(data + h * d_sh + r2 * d_sr + c2, mask=mask, other=0).to(tl.float32)
        s = tl.load(scale + h * s_sh + rows * s_sr, mask=row_ok, other=0.0).to(tl.float32)
        z = tl.load(zero + h * z_sh + rows * z_sr, mask=row_ok, other=0.0).to(tl.float32)
        val = q * s[:, None] + z[:, None]
    elif MODE == 3:  # fp8 e4m3fn from its bits, one scale per block of GROUP rows
        b = tl.load(data + h * d_sh + r2 * d_sr + c2, mask=mask, other=0).to(tl.int32)
        e = (b >> 3) & 15
        m = b & 7
        normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormal m * 2^-9
        f = tl.where(b >= 128, -mag, mag)
        s = tl.load(scale + h * s_sh + (rows // GROUP) * s_sr, mask=row_ok, other=0.0)
        val = f * s.to(tl.float32)[:, None]
    else:  # int4: byte j holds channel j (low nibble) and channel j + D/2 (high nibble)
        half = dim // 2
        high = c2 >= half
        byte_col = tl.where(high, c2 - half, c2)
        b = tl.load(data + h * d_sh + r2 * d_sr + byte_col, mask=mask, other=0).to(tl.int32)
        q = tl.where(high, b >> 4, b & 15).to(tl.float32)
        if MODE == 1:  # keys: per channel, GROUP tokens share a scale / zero point
            at = (r2 // GROUP) * s_sr + c2
            s = tl.load(scale + h * s_sh + at, mask=mask, other=0.0).to(tl.float32)
            z = tl.load(zero + h * z_sh + (r2 // GROUP) * z_sr + c2, mask=mask, other=0.0)
        else:  # values: per token, GROUP channels share a scale / zero point
            s = tl.load(scale + h * s_sh + r2 * s_sr + c2 // GROUP, mask=mask, other=0.0)
            s = s.to(tl.float32)
            z = tl.load(zero + h * z_sh + r2 * z_sr + c2 // GROUP, mask=mask, other=0.0)
        val = q * s + z.to(tl.float32)
    if BF16:  # out is viewed as int16: round to nearest even by hand (see decode)
        bits = val.to(tl.uint32, bitcast=True)
        val = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16)
    tl.store(out + h * o_sh + r2 * o_sr + c2, val.to(out.dtype.element_ty), mask=mask)


_kernels: dict[bool, object] = {}
disabled: str | None = None  # why the kernel is off in this process (it failed once)
runs = 0  # launches of the kernel in this process (each decoded one kind of one chunk)


def _kernel():
    """The jitted kernel; built at first use, once per mode (compiled for the GPU, or
    interpreted when TRITON_INTERPRET=1 is set at that time)."""
    mode = interpreting()
    kernel = _kernels.get(mode)
    if kernel is None:
        kernel = _kernels[mode] = triton.jit(_dequant)
    return kernel


def _mode(codec: Codec, kind: str, out: torch.Tensor, scale: torch.Tensor) -> tuple[int, int]:
    """(MODE, GROUP) of a codec's fields, or (-1, 0) when the kernel does not know it."""
    if isinstance(codec, Int8Codec):
        return MODE_INT8, 1
    if isinstance(codec, Int4Codec):
        return (MODE_INT4_K if kind == "k" else MODE_INT4_V), codec.group
    if isinstance(codec, Fp8Codec):
        blocks = scale.shape[-2]
        if blocks == 0 or out.shape[-2] % blocks:
            return -1, 0
        return MODE_FP8, out.shape[-2] // blocks
    return -1, 0


def kernel_codec(codec: Codec) -> bool:
    """The kernel decodes this codec's blocks (int8, int4 of any group, fp8)."""
    return isinstance(codec, Int8Codec | Int4Codec | Fp8Codec)


def can_decode(codec: Codec, out: torch.Tensor) -> bool:
    """Whether `decode` would run the kernel for this codec and output."""
    return (
        disabled is None
        and (out.is_cuda or (interpreting() and out.device.type == "cpu"))
        and out.dtype in _OUT_DTYPES
        and kernel_codec(codec)
        and _import_triton()
    )


def decode(codec: Codec, kind: str, enc: dict[str, torch.Tensor], out: torch.Tensor) -> bool:
    """Decode one kind's fields `enc` ([..., rows, cols] as the codec stores them) into
    `out` [..., R, D] with one kernel launch.

    Args:
        codec: an int8, int4 (any group) or fp8 codec.
        kind: "k" or "v".
        enc: the codec's fields ("data", "scale", and "zero" except for fp8), on the
            device of `out`.
        out: the decode target (fp32 / fp16 / bf16; rows may be strided, the last
            dim must be contiguous), e.g. a view of the staging buffer.

    Returns:
        True when the kernel ran; False when it cannot take these tensors (no
        Triton, not on CUDA and not interpreting, an unknown codec, or a layout whose
        leading dims do not collapse): the caller then uses `codec.decode`.
    """
    if not can_decode(codec, out):
        return False
    data, scale = enc["data"], enc["scale"]
    zero = enc.get("zero", scale)
    mode, group = _mode(codec, kind, out, scale)
    if mode < 0 or data.device != out.device:
        return False
    if data.dtype != torch.uint8:  # fp8 codes as their bits
        data = data.view(torch.uint8)
    geo_out = as_3d(out, row_contiguous=False)
    geos = [as_3d(t, row_contiguous=True) for t in (data, scale, zero)]
    if geo_out is None or any(g is None or g[0] != geo_out[0] for g in geos):
        return False
    heads, o_sh, o_sr = geo_out
    (_, d_sh, d_sr), (_, s_sh, s_sr), (_, z_sh, z_sr) = geos
    rows, dim = out.shape[-2], out.shape[-1]
    if heads == 0 or rows == 0:
        return True
    # bf16 is rounded from fp32 in the kernel, as torch rounds it (to nearest even):
    # Triton's interpreter would truncate, the GPU rounds; this way both match torch.
    bf16 = out.dtype == torch.bfloat16
    target = out.view(torch.int16) if bf16 else out
    block_d = triton.next_power_of_2(dim)
    block_r = max(1, min(triton.next_power_of_2(rows), _TILE // block_d))
    grid = (heads, triton.cdiv(rows, block_r))
    try:
        _kernel()[grid](
            data,
            scale,
            zero,
            target,
            rows,
            dim,
            d_sh,
            d_sr,
            s_sh,
            s_sr,
            z_sh,
            z_sr,
            o_sh,
            o_sr,
            MODE=mode,
            GROUP=group,
            BF16=bf16,
            BLOCK_R=block_r,
            BLOCK_D=block_d,
            enable_fp_fusion=False,
        )
    except Exception as err:  # e.g. a Triton / driver without this GPU: torch ops instead
        _disable(err)
        return False
    global runs
    runs += 1
    return True


def _disable(err: Exception) -> None:
    global disabled
    disabled = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    warnings.warn(
        f"kvstrata: the fused Triton dequant kernel failed ({disabled}); quantized blocks "
        "are decoded with torch ops from now on in this process",
        RuntimeWarning,
        stacklevel=3,
    )


def decode_fields(codec: Codec, kind: str, enc: dict[str, torch.Tensor], out: torch.Tensor) -> None:
    """`decode` when the kernel can take it, else the codec's own decode (the native CPU
    kernels or the torch reference, on whatever device the tensors are)."""
    if not decode(codec, kind, enc, out):
        codec.decode(kind, enc, out)
