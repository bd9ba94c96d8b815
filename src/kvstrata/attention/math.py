"""Attention math in plain torch: pack-GQA views, masked and unmasked partials with
their log-sum-exp, and the log-sum-exp merge.

For one sequence, the keys live in several places (device runs, host runs, staged
copies of disk blocks, this step's new keys). Softmax attention over their union is
the log-sum-exp merge of the partials over each part:

    o = sum_i exp(lse_i - lse) * o_i,   lse = logsumexp_i(lse_i)

done for all parts at once (`merge_all`): decode steps are dispatch-bound.

Queries are "pack-GQA": [Hq, Q, D] viewed as [Hkv, R*Q, D] so each KV head is
attended once, with no K/V expansion and no mask (valid whenever every query may see
every key of the part, i.e. always in decode). Parts that need a mask (prefill
causality, sliding windows inside a prefill, padding holes) take the math path.

`reference_attention` is the same function in plain torch, used by tests as ground
truth.
"""

from __future__ import annotations

import math

import torch

_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def pack_gqa(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[Hq, Q, D] -> [Hkv, R*Q, D] (query head h uses kv head h // R, as repeat_kv)."""
    hq, nq, d = q.shape
    return q.reshape(num_kv_heads, (hq // num_kv_heads) * nq, d)


def unpack_gqa(o: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """[Hkv, R*Q, D] -> [Hq, Q, D]."""
    hkv, rq, d = o.shape
    return o.reshape(num_q_heads, (hkv * rq) // num_q_heads, d)


def host_partial(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`partial_attention` off CUDA: torch's CPU flash kernel (which returns the LSE) when
    it applies, else the math path (soft-capping, K and V of different head dims)."""
    if softcap is None and q.device.type == "cpu" and k.shape[-1] == v.shape[-1]:
        out, lse = _flash_cpu(q[None], k[None], v[None], 0.0, False, scale=scale)
        return out[0], lse[0]
    return math_attention(q, k, v, scale, None, softcap)


def math_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    allowed: torch.Tensor | None,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch attention with an optional boolean mask [M, T] (or [H, M, T]).

    Rows with no allowed key get out = 0 and lse = -inf (they merge as "nothing")."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.clamp_min(torch.finfo(torch.float32).min).unsqueeze(-1))
    probs = torch.nan_to_num(probs, nan=0.0)
    out = torch.matmul(probs, v.float()).to(v.dtype)
    return out, lse


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    allowed: torch.Tensor,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of unpacked queries [Hq, Q, D] over keys [Hkv, T, D] under a boolean
    mask `allowed` [Q, T]. Returns (out [Hq, Q, Dv], lse [Hq, Q])."""
    hq, nq, d = q.shape
    hkv = k.shape[0]
    r = hq // hkv
    qg = q.reshape(hkv, r * nq, d)
    allowed_g = allowed.unsqueeze(0).expand(r, nq, allowed.shape[-1]).reshape(r * nq, -1)
    out, lse = math_attention(qg, k, v, scale, allowed_g, softcap)
    return out.reshape(hq, nq, -1), lse.reshape(hq, nq)


def merge_all(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge any number of partials (out, lse) in one pass: a handful of ops whatever
    the count (decode steps are dispatch-bound, so op count matters more than flops)."""
    if len(parts) == 1:
        return parts[0]
    lses = torch.stack([lse for _, lse in parts])  # [P, H, M]
    lse = torch.logsumexp(lses, dim=0)
    # parts with no keys at all have lse = -inf: weight 0, not NaN
    weights = torch.exp(lses - lse).nan_to_num_(0.0).unsqueeze(-1)
    outs = torch.stack([o for o, _ in parts])
    out = (outs.float() * weights).sum(dim=0).to(outs.dtype)
    return out, lse


def merge_sink(acc: tuple[torch.Tensor, torch.Tensor], sink_logits: torch.Tensor) -> torch.Tensor:
    """Apply learned attention-sink logits (one per query head, [Hq] broadcast over
    rows, gpt-oss style `s_aux`): a virtual key with value 0 that only adds to the
    softmax denominator."""
    out, lse = acc
    scale = torch.sigmoid(lse - sink_logits.float().view(-1, 1))
    return (out.float() * scale.unsqueeze(-1)).to(out.dtype)


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    *,
    q_positions: torch.Tensor | None = None,
    key_valid: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Ground truth: causal (optionally windowed, soft-capped, padded) GQA attention.

    Args:
        q: [B, Hq, Q, D]; k: [B, Hkv, T, D]; v: [B, Hkv, T, Dv].
        q_positions: [Q] key index of each query (default: the last Q keys).
        key_valid: [B, T] False for padding keys.
        sliding_window: a query at p sees keys in (p - window, p].

    Returns:
        [B, Q, Hq, Dv] (the layout transformers' attention functions return).
    """
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    if q_positions is None:
        q_positions = torch.arange(nk - nq, nk)
    kpos = torch.arange(nk)
    allowed = kpos[None, :] <= q_positions[:, None]
    if sliding_window is not None:
        allowed &= kpos[None, :] > q_positions[:, None] - sliding_window
    outs = []
    for i in range(b):
        row_allowed = allowed if key_valid is None else allowed & key_valid[i][None, :]
        k_rep = k[i].repeat_interleave(hq // hkv, dim=0)
        v_rep = v[i].repeat_interleave(hq // hkv, dim=0)
        out, _ = math_attention(q[i], k_rep, v_rep, scale, row_allowed[None], softcap)
        outs.append(out.transpose(0, 1))
    return torch.stack(outs)
