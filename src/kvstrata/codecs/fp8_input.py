"""Codecs over fp8 K/V (vLLM's fp8 KV caches: `--kv-cache-dtype fp8 | fp8_e4m3 |
fp8_e5m2`).

A KV cache kept in fp8 reaches the tiers as fp8 values (float8_e4m3fn or float8_e5m2,
vLLM's per-layer k/v scale already applied: the values are what the cache holds).

- `none` stores those bytes as they are (the layout's dtype is the fp8 dtype): a
  lossless pass-through, half the bytes of fp16.
- every other codec quantizes *from* the fp8 values: `Fp8Input` widens them to fp32
  — exactly: every e4m3 and e5m2 value is an fp32 — encodes them with the codec, and
  decodes back to the fp8 dtype, rounding to nearest and saturating at its largest
  finite value (so a dequantized block never turns into inf or NaN).

Stored fields are those of the wrapped codec over an fp32 layout of the same shape.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kvstrata.codecs.base import Codec, NoneCodec
from kvstrata.core.errors import CodecError
from kvstrata.core.layout import BlockLayout, FieldSpec

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
CARRIER = torch.float32  # holds every fp8 value exactly


class Fp8Input(Codec):
    """`inner` over fp8 K/V of `dtype` (one of FP8_DTYPES); see the module docstring."""

    def __init__(self, inner: Codec, dtype: torch.dtype) -> None:
        if dtype not in FP8_DTYPES:
            raise CodecError(f"Fp8Input takes one of {FP8_DTYPES}, got {dtype}")
        self.inner, self.dtype = inner, dtype
        self.name, self.lossless = inner.name, inner.lossless
        self._limit = torch.finfo(dtype).max

    def _carrier(self, layout: BlockLayout) -> BlockLayout:
        return replace(layout, dtype=CARRIER)

    def validate(self, layout: BlockLayout) -> None:
        self.inner.validate(self._carrier(layout))

    def fields(self, kind: str, layout: BlockLayout) -> dict[str, FieldSpec]:
        return self.inner.fields(kind, self._carrier(layout))

    def encode(self, kind: str, x: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
        if x.dtype != self.dtype:
            raise CodecError(f"codec {self.name!r} over {self.dtype} K/V got {x.dtype}")
        self.inner.encode(kind, x.to(CARRIER), out)

    def decode(self, kind: str, enc: dict[str, torch.Tensor], out: torch.Tensor) -> None:
        if out.dtype != self.dtype:
            raise CodecError(f"codec {self.name!r} over {self.dtype} K/V got {out.dtype}")
        wide = torch.empty(out.shape, dtype=CARRIER)
        self.inner.decode(kind, enc, wide)
        out.copy_(wide.clamp_(-self._limit, self._limit))

    def __repr__(self) -> str:
        return f"Fp8Input({self.inner!r}, {self.dtype})"


def for_dtype(codec: Codec, dtype: torch.dtype) -> Codec:
    """`codec` for K/V of `dtype`: wrapped in Fp8Input for fp8 K/V unless it is
    `none` (which stores any dtype's bytes as they are)."""
    if dtype in FP8_DTYPES and not isinstance(codec, (Fp8Input, NoneCodec)):
        return Fp8Input(codec, dtype)
    return codec
