"""Unmasked attention of packed queries over one part of the keys, with its LSE: torch's
CPU flash kernel on the CPU, an LSE-returning GPU kernel on CUDA (`attention.device`),
plain torch for soft-capping and odd shapes (`attention.math`).
"""

from __future__ import annotations

import torch

from kvstrata.attention.device import lse_attention
from kvstrata.attention.math import host_partial


def partial_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked attention of packed queries over one part of the keys.

    Args:
        q: [Hkv, M, D] packed queries. k: [Hkv, T, D], v: [Hkv, T, Dv] (views are fine).
        scale: softmax scale. softcap: Gemma-2 logit soft-capping.

    Returns:
        (out [Hkv, M, Dv], lse [Hkv, M] float32).
    """
    if q.device.type == "cuda":  # an LSE-returning GPU kernel
        return lse_attention(q, k, v, scale, softcap)
    return host_partial(q, k, v, scale, softcap)
