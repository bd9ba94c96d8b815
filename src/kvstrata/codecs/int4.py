"""`int4` (KIVI-style): keys per channel, values per token, fp16 scale + zero point.

Keys have outlier *channels*, so they are grouped along tokens: for every channel,
`group` consecutive tokens share a scale and zero point. Values are grouped along
channels: for every token, `group` consecutive channels share them. Two 4-bit codes
per byte: byte j holds channel j (low nibble) and channel j + D/2 (high nibble),
which keeps packing and unpacking SIMD-friendly.

Stored per block per (layer, kv head), block size bs, group g:

    K: data [bs, D/2] uint8 + scale [bs/g, D] fp16 + zero [bs/g, D] fp16
    V: data [bs, D/2] uint8 + scale [bs, D/g] fp16 + zero [bs, D/g] fp16

i.e. exactly 4 + 32/g bits per element (g=64: 4.5 bits). g must divide block_size
(keys) and the head dim (values). Registered as "int4" (g=64), "int4-g32",
"int4-g128".
"""

from __future__ import annotations

import torch

from kvstrata.codecs import _reference as ref
from kvstrata.codecs._common import check_raw, dim_of
from kvstrata.codecs._kernels import kernel_call
from kvstrata.codecs.base import Codec
from kvstrata.core.errors import CodecError, ConfigError
from kvstrata.core.formats import FieldFormat
from kvstrata.core.layout import BlockLayout, FieldSpec

DEFAULT_GROUP = 64


class Int4Codec(Codec):
    """KIVI-style int4 with groups of `group` tokens (K) or channels (V)."""

    lossless = False

    def __init__(self, group: int = DEFAULT_GROUP) -> None:
        if group < 2 or group % 2:
            raise ConfigError.field("codec group size", group, "an even number >= 2")
        self.group = group
        self.name = "int4" if group == DEFAULT_GROUP else f"int4-g{group}"

    def validate(self, layout: BlockLayout) -> None:
        """Raise ConfigError unless the group size divides block_size and the head dims."""
        g = self.group
        if layout.block_size % g:
            raise ConfigError.field(
                "block_size",
                layout.block_size,
                f"codec {self.name!r} groups keys by {g} tokens: block_size must be a "
                f"multiple of the group size {g} (or use a smaller group, e.g. int4-g32)",
            )
        for field, dim in (("head_dim", layout.head_dim), ("v_head_dim", layout.dim_v)):
            if dim % g or dim % 2:
                raise ConfigError.field(
                    field,
                    dim,
                    f"codec {self.name!r} groups values by {g} channels: the head dim must "
                    f"be a multiple of the group size {g} (pick a group size dividing {dim})",
                )

    def attend_format(self, kind: str, layout: BlockLayout) -> tuple[FieldFormat, int]:
        fmt = FieldFormat.INT4_CHANNEL if kind == "k" else FieldFormat.INT4_TOKEN
        return fmt, self.group

    def fields(self, kind: str, layout: BlockLayout) -> dict[str, FieldSpec]:
        self.validate(layout)
        dim = dim_of(kind, layout)
        bs, g = layout.block_size, self.group
        rows, cols = (bs // g, dim) if kind == "k" else (bs, dim // g)
        return {
            "data": FieldSpec(bs, dim // 2, torch.uint8),
            "scale": FieldSpec(rows, cols, torch.float16),
            "zero": FieldSpec(rows, cols, torch.float16),
        }

    def _check(self, kind: str, x: torch.Tensor) -> None:
        g = self.group
        if kind == "k":
            check_raw(self.name, kind, x, g, "group size (keys are grouped by tokens)")
        else:
            check_raw(self.name, kind, x, 1, "block_size")
        if kind == "v" and x.shape[-1] % g or x.shape[-1] % 2:
            raise CodecError(
                f"codec {self.name!r}: head dim {x.shape[-1]} is not a multiple of the "
                f"group size {g}"
            )

    def encode(self, kind: str, x: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
        self._check(kind, x)
        data, scale, zero = out["data"], out["scale"], out["zero"]
        op = "int4k" if kind == "k" else "int4v"
        if kernel_call(op, "enc", x, data, scale, zero, self.group):
            return
        encode = ref.int4k_encode if kind == "k" else ref.int4v_encode
        encode(x, data, scale, zero, self.group)

    def decode(self, kind: str, enc: dict[str, torch.Tensor], out: torch.Tensor) -> None:
        self._check(kind, out)
        data, scale, zero = enc["data"], enc["scale"], enc["zero"]
        op = "int4k" if kind == "k" else "int4v"
        if kernel_call(op, "dec", out, data, scale, zero, self.group):
            return
        decode = ref.int4k_decode if kind == "k" else ref.int4v_decode
        decode(data, scale, zero, out, self.group)
