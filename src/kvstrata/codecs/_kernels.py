"""Fast CPU kernels for the quantizing codecs, and when they are used.

The kernels are plain C++ (`kvstrata/platform/csrc/codecs.cpp`) in the library that
`kvstrata.platform.native` builds once per machine and loads once per process. Without a
compiler, or with `KVSTRATA_NATIVE=0`, `kernel_call` returns False and the
codecs fall back to the eager torch reference in `_reference.py` (same bits, an
order of magnitude slower or more: docs/MEASUREMENTS.md).

Every tensor is passed as [H, rows, cols] (leading dims collapsed, see `as_3d`),
so one call covers all layers and heads of a run of blocks.
"""

from __future__ import annotations

import torch

from kvstrata.core.errors import CodecError
from kvstrata.core.formats import DType
from kvstrata.platform.native import available, load

__all__ = ["as_3d", "available", "kernel_call", "load", "raise_for_flags"]

# Kernel work buffers hold one row of channels on the stack.
_MAX_DIM = 4096


def as_3d(t: torch.Tensor, *, row_contiguous: bool) -> tuple[int, int, int] | None:
    """Describe t [..., rows, cols] as (heads, head_stride, row_stride) in elements.

    Args:
        t: a tensor whose last dim is contiguous.
        row_contiguous: also require row stride == cols (codec fields).

    Returns:
        (H, head stride, row stride), or None when the leading dims cannot be
        collapsed into one strided dim (the caller then uses the eager path).
    """
    if t.dim() < 2 or t.stride(-1) != 1 and t.shape[-1] > 1:
        return None
    rows, cols = t.shape[-2], t.shape[-1]
    row_stride = t.stride(-2) if rows > 1 else cols
    if row_contiguous and row_stride != cols:
        return None
    lead = [(s, st) for s, st in zip(t.shape[:-2], t.stride()[:-2], strict=True) if s != 1]
    heads = 1
    for s, _ in lead:
        heads *= s
    if not lead:
        return 1, 0, row_stride
    for (_, outer), (size, inner) in zip(lead, lead[1:], strict=False):
        if outer != inner * size:
            return None
    return heads, lead[-1][1], row_stride


def kernel_call(
    op: str,
    direction: str,
    raw: torch.Tensor,
    data: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    group: int,
) -> bool:
    """Run kernel `kv_<op>_<direction>` on a run of blocks, if it can take the tensors.

    Args:
        op: "int8", "int4v", "int4k" or "fp8".
        direction: "enc" (raw -> fields) or "dec" (fields -> raw).
        raw: x to encode or the decode output, [..., R, D] in fp32/fp16/bf16.
        data, scale, zero: the codec fields [..., rows, cols] (zero may be None).
        group: the group size (int4) or block size (fp8); ignored by int8.

    Returns:
        True when the kernel ran; False when the eager path must be used instead
        (kernels unavailable, unsupported dtype, or tensors not collapsible).

    Raises:
        CodecError: non-finite input, or a scale/zero point beyond the fp16 range.
    """
    lib = load()
    code = DType.of(raw.dtype)
    if lib is None or code is None or raw.device.type != "cpu":
        return False
    if raw.shape[-1] > _MAX_DIM:
        return False
    zero_t = zero if zero is not None else scale
    geo_raw = as_3d(raw, row_contiguous=False)
    geos = [as_3d(t, row_contiguous=True) for t in (data, scale, zero_t)]
    if geo_raw is None or any(g is None for g in geos):
        return False
    heads = geo_raw[0]
    if any(g[0] != heads for g in geos):
        return False
    rows, dim = raw.shape[-2], raw.shape[-1]
    threads = torch.get_num_threads()
    (_, dsh, _), (_, ssh, _), (_, zsh, _) = geos
    fn = getattr(lib, f"kv_{op}_{direction}")
    if direction == "enc":
        flags = fn(
            code,
            raw.data_ptr(),
            geo_raw[1],
            geo_raw[2],
            data.data_ptr(),
            dsh,
            scale.data_ptr(),
            ssh,
            zero_t.data_ptr(),
            zsh,
            heads,
            rows,
            dim,
            group,
            threads,
        )
    else:
        flags = fn(
            code,
            data.data_ptr(),
            dsh,
            scale.data_ptr(),
            ssh,
            zero_t.data_ptr(),
            zsh,
            raw.data_ptr(),
            geo_raw[1],
            geo_raw[2],
            heads,
            rows,
            dim,
            group,
            threads,
        )
    raise_for_flags(flags)
    return True


def raise_for_flags(flags: int) -> None:
    """Turn a kernel's status bits into the CodecError the eager path would raise."""
    if flags & 1:
        raise CodecError("cannot encode non-finite K/V (inf or NaN in the input)")
    if flags & 2:
        raise CodecError(
            "K/V values exceed the fp16 range of the scale/zero point (|x| > 65504); "
            "use the 'none' or 'fp8' codec for this model"
        )
    if flags < 0:
        raise CodecError(f"codec kernel failed with status {flags}")
