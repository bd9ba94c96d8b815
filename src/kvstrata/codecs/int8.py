"""`int8`: asymmetric 8-bit, one fp16 scale and zero point per token per head.

Stored per block per (layer, kv head): data [bs, D] uint8 + scale [bs, 1] fp16 +
zero [bs, 1] fp16, i.e. 8 + 32/D bits per element (8.25 at D=128).
"""

from __future__ import annotations

import torch

from kvstrata.codecs import _reference as ref
from kvstrata.codecs._common import check_raw, dim_of
from kvstrata.codecs._kernels import kernel_call
from kvstrata.codecs.base import Codec
from kvstrata.core.formats import FieldFormat
from kvstrata.core.layout import BlockLayout, FieldSpec


class Int8Codec(Codec):
    """Per-token asymmetric int8 (the same scheme for K and V)."""

    name = "int8"
    lossless = False

    def attend_format(self, kind: str, layout: BlockLayout) -> tuple[FieldFormat, int]:
        return FieldFormat.INT8, 1

    def fields(self, kind: str, layout: BlockLayout) -> dict[str, FieldSpec]:
        dim = dim_of(kind, layout)
        bs = layout.block_size
        return {
            "data": FieldSpec(bs, dim, torch.uint8),
            "scale": FieldSpec(bs, 1, torch.float16),
            "zero": FieldSpec(bs, 1, torch.float16),
        }

    def encode(self, kind: str, x: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
        check_raw(self.name, kind, x, 1, "block_size")
        data, scale, zero = out["data"], out["scale"], out["zero"]
        if not kernel_call("int8", "enc", x, data, scale, zero, 1):
            ref.int8_encode(x, data, scale, zero)

    def decode(self, kind: str, enc: dict[str, torch.Tensor], out: torch.Tensor) -> None:
        check_raw(self.name, kind, out, 1, "block_size")
        data, scale, zero = enc["data"], enc["scale"], enc["zero"]
        if not kernel_call("int8", "dec", out, data, scale, zero, 1):
            ref.int8_decode(data, scale, zero, out)
