"""Codes and descriptors shared with the native kernels (kvstrata/platform/csrc/common.h).

Everything here has one C twin in `common.h`, and tests/core/test_formats.py checks that
the two agree (enum values against the header text, struct layouts against the
compiled library):

    DType        enum kv_dtype   element type of raw K/V rows (codec kernels' `dt`)
    FieldFormat  enum kv_format  how the decode attention reads one field of a part
    FieldDesc    struct kv_field one field (K or V) of one part, read in place
    PartDesc     struct kv_part  one part: its token count, then K's and V's fields

No torch import at module load: `kvstrata.platform.native` uses the structs as argtypes.
"""

from __future__ import annotations

import ctypes
import functools
from enum import IntEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["DType", "FieldDesc", "FieldFormat", "PartDesc"]


class DType(IntEnum):
    """Element type of raw K/V rows, as the native kernels number it (`kv_dtype`)."""

    F32 = 0
    F16 = 1
    BF16 = 2

    @classmethod
    def of(cls, dtype: torch.dtype) -> DType | None:
        """The code of a torch dtype; None when the kernels do not take it."""
        return _torch_codes()[0].get(dtype)


class FieldFormat(IntEnum):
    """How the native decode attention reads a field in place (`kv_format`).

    F32 / F16 / BF16: raw rows (the same numbers as `DType`).
    INT8: u8 codes [rows, D], fp16 scale and zero [rows, 1] (per token).
    INT4_TOKEN: int4 values per token: nibbles [rows, D/2] (byte j = channel j low,
        channel j + D/2 high), fp16 scale/zero [rows, D/group].
    INT4_CHANNEL: int4 keys per channel: same nibbles, fp16 scale/zero [rows/group, D].
    FP8_E4M3: e4m3fn codes [rows, D], one fp32 scale per `group` rows, no zero point.
    """

    F32 = 0
    F16 = 1
    BF16 = 2
    INT8 = 3
    INT4_TOKEN = 4
    INT4_CHANNEL = 5
    FP8_E4M3 = 6

    @classmethod
    def raw(cls, dtype: torch.dtype) -> FieldFormat | None:
        """The format of raw rows of a torch dtype; None when the kernel cannot read it."""
        return _torch_codes()[1].get(dtype)


@functools.cache
def _torch_codes() -> tuple[dict[torch.dtype, DType], dict[torch.dtype, FieldFormat]]:
    import torch

    dtypes = {torch.float32: DType.F32, torch.float16: DType.F16, torch.bfloat16: DType.BF16}
    return dtypes, {t: FieldFormat(code) for t, code in dtypes.items()}


class FieldDesc(ctypes.Structure):
    """One field (K or V) of one part of a decode attention call (`struct kv_field`).

    Strides are in bytes; token t of the part is arena row `row0 + t`. Pointers and
    strides a format does not use are 0 (raw rows use only data and its strides).
    """

    _fields_ = [
        ("data", ctypes.c_void_p),  # rows or codes, [H, rows, ...]
        ("scale", ctypes.c_void_p),
        ("zero", ctypes.c_void_p),
        ("data_head_stride", ctypes.c_int64),
        ("data_row_stride", ctypes.c_int64),
        ("scale_head_stride", ctypes.c_int64),
        ("zero_head_stride", ctypes.c_int64),
        ("group", ctypes.c_int64),  # int4: group size; fp8: rows per scale
        ("row0", ctypes.c_int64),
        ("format", ctypes.c_int32),  # a FieldFormat
    ]


class PartDesc(ctypes.Structure):
    """One part of a decode attention call (`struct kv_part`): `tokens` keys, K and V."""

    _fields_ = [("tokens", ctypes.c_int64), ("k", FieldDesc), ("v", FieldDesc)]
