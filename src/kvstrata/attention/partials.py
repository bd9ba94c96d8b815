"""Partials with their LSE, chosen by device: unmasked attention of packed queries over
one part of the keys (torch's CPU flash kernel on the CPU, an LSE-returning GPU kernel on
CUDA (`attention.device`), plain torch for soft-capping and odd shapes), computed where
the keys live, and the causal partial of a step's queries over its own new keys.
"""

from __future__ import annotations

import warnings

import torch

from kvstrata.attention.device import lse_attention
from kvstrata.attention.math import masked_attention


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

    One dispatcher, `attention.device.lse_attention`: an LSE-returning GPU kernel on
    CUDA, `attention.math.host_partial` (CPU flash kernel or the math path) elsewhere.
    """
    return lse_attention(q, k, v, scale, softcap)


def partial_where_kv_lives(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial attention computed on the device that holds k/v: host blocks attended
    in place on the CPU (FlexGen's "CPU attention"), only q and the partial result
    ([Hkv, R*Q, D] + LSE, tiny in decode) cross the link."""
    if k.device == q.device:
        return partial_attention(q, k, v, scale, softcap)
    out, lse = partial_attention(q.to(k.device), k, v, scale, softcap)
    return out.to(q.device, non_blocking=True), lse.to(q.device, non_blocking=True)


def causal_new(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    softcap: float | None,
    num_kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of this step's queries over this step's keys (square),
    returned packed ([Hkv, R*Q, Dv], [Hkv, R*Q]). On the CPU and CUDA an LSE-returning
    fused kernel (memory linear in Q: the math path's [Hq, Q, Q] scores would take
    16 GiB at a 32k-token prompt); soft-capping and Dv != D take the math path."""
    hq, nq, _ = q.shape
    r = hq // num_kv_heads
    out = None
    if softcap is None and q.device.type == "cpu" and k.shape[-1] == v.shape[-1]:
        kx = k.repeat_interleave(r, dim=0) if r > 1 else k
        vx = v.repeat_interleave(r, dim=0) if r > 1 else v
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[None], kx[None], vx[None], 0.0, True, scale=scale
        )
        out, lse = out[0], lse[0]
    elif softcap is None and q.is_cuda and k.shape[-1] == v.shape[-1]:
        kx = k.repeat_interleave(r, dim=0) if r > 1 else k
        vx = v.repeat_interleave(r, dim=0) if r > 1 else v
        try:  # compute_log_sumexp=True, dropout 0, is_causal=True
            out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
                q[None], kx[None], vx[None], None, True, 0.0, True, scale=scale
            )[:2]
            out, lse = out[0], lse[0, :, :nq]  # its LSE is padded to a multiple of 32
        except RuntimeError as err:  # e.g. a head dim it does not support
            why = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
            warnings.warn(
                f"kvstrata: memory-efficient causal attention failed ({why}); using the "
                f"math path ([Hq, Q, Q] fp32 scores: {hq * nq * nq * 4:,} bytes)",
                RuntimeWarning,
                stacklevel=2,
            )
            out = None
    if out is None:
        allowed = torch.ones(nq, nq, dtype=torch.bool, device=q.device).tril()
        out, lse = masked_attention(q, k, v, scale, allowed, softcap)
    return out.reshape(num_kv_heads, r * nq, -1), lse.reshape(num_kv_heads, r * nq)
