"""Codec protocol: how a tier stores K/V blocks.

A codec turns raw K or V of shape [..., n*block_size, D] (model dtype) into named
fields of shape [..., n*rows, cols] (see `FieldSpec`) and back. It works on whole
runs of blocks at once (no Python loop per block) and writes into preallocated
outputs (`out=`), because allocating fresh outputs is itself slow (page faults).

Keys and values may be encoded differently (KIVI: keys per channel, values per
token), hence the `kind` argument ("k" or "v").
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from kvstrata.core.formats import FieldFormat
from kvstrata.core.layout import KINDS, BlockLayout, FieldSpec


class Codec(ABC):
    """Encodes blocks of one kind (K or V) into fixed-size fields."""

    name: str = "?"
    lossless: bool = False

    @abstractmethod
    def fields(self, kind: str, layout: BlockLayout) -> dict[str, FieldSpec]:
        """The stored fields of one block of `kind` per (layer, kv head)."""

    @abstractmethod
    def encode(self, kind: str, x: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
        """Encode x [..., n*bs, D] into out[field] [..., n*rows, cols] in place.

        Raises:
            CodecError: non-finite input, or a shape the codec cannot take.
        """

    @abstractmethod
    def decode(self, kind: str, enc: dict[str, torch.Tensor], out: torch.Tensor) -> None:
        """Decode enc[field] [..., n*rows, cols] into out [..., n*bs, D] in place."""

    def validate(self, layout: BlockLayout) -> None:  # noqa: B027 - optional hook
        """Raise ConfigError/CodecError when this codec cannot store `layout`."""

    def attend_format(self, kind: str, layout: BlockLayout) -> tuple[FieldFormat, int] | None:
        """(format, group) under which the native decode attention reads this
        codec's stored fields in place (kvstrata/platform/csrc/attention.cpp), or None when
        it cannot (the blocks are then decoded into a staging buffer first)."""
        return None

    def block_nbytes(self, layout: BlockLayout) -> int:
        """Exact stored bytes of one block (all layers, K and V, all fields)."""
        per_head_layer = sum(
            spec.nbytes for kind in KINDS for spec in self.fields(kind, layout).values()
        )
        return per_head_layer * layout.num_layers * layout.num_kv_heads

    def bits_per_element(self, layout: BlockLayout) -> float:
        """Stored bits per K/V element, scale and zero-point bytes included."""
        elements = (
            layout.num_layers
            * layout.num_kv_heads
            * layout.block_size
            * (layout.head_dim + layout.dim_v)
        )
        return 8 * self.block_nbytes(layout) / elements

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class NoneCodec(Codec):
    """Stores the model dtype as is: lossless, zero-copy views for attention."""

    name = "none"
    lossless = True

    def fields(self, kind: str, layout: BlockLayout) -> dict[str, FieldSpec]:
        dim = layout.head_dim if kind == "k" else layout.dim_v
        return {"data": FieldSpec(layout.block_size, dim, layout.dtype)}

    def encode(self, kind: str, x: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
        out["data"].copy_(x)

    def decode(self, kind: str, enc: dict[str, torch.Tensor], out: torch.Tensor) -> None:
        out.copy_(enc["data"])
