"""Checks shared by the quantizing codecs (fp8, int8, int4)."""

from __future__ import annotations

import torch

from kvstrata.core.errors import CodecError
from kvstrata.core.layout import KINDS, BlockLayout

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def dim_of(kind: str, layout: BlockLayout) -> int:
    """Head dim of K or V for `layout`.

    Raises:
        CodecError: kind is not "k" or "v".
    """
    if kind not in KINDS:
        raise CodecError(f"kind={kind!r} is invalid: expected 'k' or 'v'")
    return layout.head_dim if kind == "k" else layout.dim_v


def check_raw(codec: str, kind: str, x: torch.Tensor, multiple: int, what: str) -> None:
    """Check a raw K/V tensor [..., R, D] before encoding or as a decode target.

    Args:
        codec: codec name for the message.
        kind: "k" or "v".
        x: the raw tensor.
        multiple: R must be a multiple of this (block size or group size).
        what: what `multiple` is, for the message (e.g. "block_size").

    Raises:
        CodecError: wrong dtype, fewer than 2 dims, or R not a multiple.
    """
    if kind not in KINDS:
        raise CodecError(f"kind={kind!r} is invalid: expected 'k' or 'v'")
    if x.dtype not in FLOAT_DTYPES:
        raise CodecError(f"codec {codec!r} takes float32/float16/bfloat16 K/V, got {x.dtype}")
    if x.dim() < 2 or x.shape[-2] % multiple:
        raise CodecError(
            f"codec {codec!r}: {kind.upper()} has {x.shape[-2] if x.dim() >= 2 else 0} "
            f"tokens, not a multiple of {what}={multiple}"
        )
