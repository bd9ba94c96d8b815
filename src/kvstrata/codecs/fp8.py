"""`fp8`: float8 e4m3fn with one fp32 scale per block per head, taken from the data.

scale = absmax / 448 over the block's [bs, D] values of one (layer, kv head), so the
largest value maps to e4m3's largest finite value; encoding saturates (clamps to
±448), so it never produces NaN. Stored per block per (layer, kv head):
data [bs, D] float8_e4m3fn + scale [1, 1] fp32.
"""

from __future__ import annotations

import torch

from kvstrata.codecs import _reference as ref
from kvstrata.codecs._common import check_raw, dim_of
from kvstrata.codecs._kernels import kernel_call
from kvstrata.codecs.base import Codec
from kvstrata.core.errors import CodecError
from kvstrata.core.formats import FieldFormat
from kvstrata.core.layout import BlockLayout, FieldSpec


class Fp8Codec(Codec):
    """e4m3fn with a per-block, per-head absmax scale (the same scheme for K and V)."""

    name = "fp8"
    lossless = False

    def attend_format(self, kind: str, layout: BlockLayout) -> tuple[FieldFormat, int]:
        return FieldFormat.FP8_E4M3, layout.block_size

    def fields(self, kind: str, layout: BlockLayout) -> dict[str, FieldSpec]:
        dim = dim_of(kind, layout)
        return {
            "data": FieldSpec(layout.block_size, dim, torch.float8_e4m3fn),
            "scale": FieldSpec(1, 1, torch.float32),
        }

    @staticmethod
    def _block_size(x: torch.Tensor, scale: torch.Tensor) -> int:
        # One scale row per block: the run's block size is rows / scale rows.
        blocks = scale.shape[-2]
        if blocks == 0 or x.shape[-2] % blocks:
            raise CodecError(
                f"codec 'fp8': {x.shape[-2]} tokens do not split into {blocks} blocks "
                "(the scale field has one row per block)"
            )
        return x.shape[-2] // blocks

    def encode(self, kind: str, x: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
        check_raw(self.name, kind, x, 1, "block_size")
        data, scale = out["data"], out["scale"]
        block = self._block_size(x, scale)
        if not kernel_call("fp8", "enc", x, data, scale, None, block):
            ref.fp8_encode(x, data, scale, block)

    def decode(self, kind: str, enc: dict[str, torch.Tensor], out: torch.Tensor) -> None:
        check_raw(self.name, kind, out, 1, "block_size")
        data, scale = enc["data"], enc["scale"]
        block = self._block_size(out, scale)
        if not kernel_call("fp8", "dec", out, data, scale, None, block):
            ref.fp8_decode(data, scale, out, block)
