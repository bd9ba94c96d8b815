"""Tiered attention: one partial per contiguous run of keys, merged with log-sum-exp.

For one sequence, the keys live in several places (device runs, host runs, staged
copies of disk blocks, this step's new keys). Softmax attention over their union is
the log-sum-exp merge of the partials over each part:

    o = sum_i exp(lse_i - lse) * o_i,   lse = logsumexp_i(lse_i)

done for all parts at once (`merge_all`): decode steps are dispatch-bound.

Queries are "pack-GQA": [Hq, Q, D] viewed as [Hkv, R*Q, D] so each KV head is
attended once, with no K/V expansion and no mask (valid whenever every query may see
every key of the part, i.e. always in decode). Parts that need a mask (prefill
causality, sliding windows inside a prefill, padding holes) take the math path.

`native_attention` does the same for a decode step in one native call over all
parts at once, reading quantized host blocks in place (kvstrata/native/attention.cpp):
no partial per part, no merge, no staging copy.

`reference_attention` is the same function in plain torch, used by tests as ground
truth.
"""

from __future__ import annotations

import ctypes
import math

import numpy as np
import torch

from kvstrata.formats import FieldDesc, FieldFormat, PartDesc

_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

# -- native decode attention ------------------------------------------------------------------
NATIVE_MAX_ROWS = 64  # packed query rows per KV head (R * new tokens)
NATIVE_MAX_DIM = 512


def raw_field(t: torch.Tensor) -> FieldDesc | None:
    """Descriptor of a raw K or V view [Hkv, T, D] (rows contiguous, on the CPU), or
    None when the native kernel cannot read it in place."""
    fmt = FieldFormat.raw(t.dtype)
    if fmt is None or t.device.type != "cpu" or (t.stride(-1) != 1 and t.shape[-1] > 1):
        return None
    es = t.element_size()
    return FieldDesc(
        data=t.data_ptr(),
        data_head_stride=t.stride(0) * es,
        data_row_stride=t.stride(1) * es,
        format=fmt,
    )


def encoded_field(
    fmt: tuple[FieldFormat, int],
    data: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    row0: int,
) -> FieldDesc | None:
    """Descriptor of a codec's fields for one layer ([Hkv, rows, cols] arenas, rows
    contiguous, CPU), starting at arena token row `row0`; `fmt` is the codec's
    `attend_format` (format, group); `zero` None for codecs without a zero point (fp8)."""
    zero = scale if zero is None else zero
    if any(t.device.type != "cpu" or not t[0].is_contiguous() for t in (data, scale, zero)):
        return None
    code, group = fmt
    return FieldDesc(
        data=data.data_ptr(),
        scale=scale.data_ptr(),
        zero=zero.data_ptr(),
        data_head_stride=data.stride(0) * data.element_size(),
        data_row_stride=data.stride(1) * data.element_size(),
        scale_head_stride=scale.stride(0) * scale.element_size(),
        zero_head_stride=zero.stride(0) * zero.element_size(),
        group=group,
        row0=row0,
        format=code,
    )


def native_attention(
    q: torch.Tensor,
    parts: list[tuple[int, FieldDesc, FieldDesc]],
    dim_v: int,
    scale: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Packed queries q [Hkv, M, D] over the union of `parts`, in one native call.

    Args:
        q: packed queries (any device/dtype; computed in fp32 on the CPU).
        parts: (tokens, K descriptor, V descriptor) per part (`raw_field`,
            `encoded_field`); every query sees every key.
        dim_v: value head dim.
        scale, softcap: as `partial_attention`.

    Returns:
        (out [Hkv, M, Dv] in q's dtype and device, lse [Hkv, M] fp32), or None when
        the native library is unavailable or the shapes are beyond it.
    """
    if not parts:
        return None
    desc = (PartDesc * len(parts))(*parts)  # one contiguous kv_part array
    return native_attention_desc(q, ctypes.addressof(desc), len(parts), dim_v, scale, softcap)


def native_attention_desc(
    q: torch.Tensor, desc: int, num_parts: int, dim_v: int, scale: float, softcap: float | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`native_attention` over a ready `PartDesc` array at address `desc`."""
    from kvstrata._native import load

    lib = load()
    hkv, m, d = q.shape
    if lib is None or not num_parts or m > NATIVE_MAX_ROWS or max(d, dim_v) > NATIVE_MAX_DIM:
        return None
    qf = q.detach().to("cpu", torch.float32).contiguous()
    out = torch.empty((hkv, m, dim_v), dtype=torch.float32)
    lse = torch.empty((hkv, m), dtype=torch.float32)
    rc = lib.kv_attn_decode(
        num_parts, ctypes.cast(desc, ctypes.POINTER(PartDesc)), qf.data_ptr(), out.data_ptr(),
        lse.data_ptr(), hkv, m, d, dim_v, scale, softcap or 0.0, torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"native decode attention failed with status {rc}")
    return out.to(q.device, q.dtype), lse.to(q.device)


def native_attention_batch(
    q: torch.Tensor,
    descs: np.ndarray,
    nparts: np.ndarray,
    dim_v: int,
    scale: float,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of S sequences in one native call: q [S, Hkv, M, D] (packed
    queries per sequence), sequence s over the `nparts[s]` parts of the `PartDesc`
    array at address `descs[s]`. Each sequence gets the bits `native_attention_desc`
    gives it alone.

    Returns (out [S, Hkv, M, Dv] in q's dtype, lse [S, Hkv, M] fp32). The caller checks
    the native library is available and M, D, Dv are within NATIVE_MAX_*."""
    from kvstrata._native import load

    lib = load()
    num, hkv, m, d = q.shape
    qf = q.detach().to("cpu", torch.float32).contiguous()
    out = torch.empty((num, hkv, m, dim_v), dtype=torch.float32)
    lse = torch.empty((num, hkv, m), dtype=torch.float32)
    descs = np.ascontiguousarray(descs, dtype=np.uint64)
    nparts = np.ascontiguousarray(nparts, dtype=np.intc)
    rc = lib.kv_attn_decode_batch(
        num, nparts.ctypes.data, descs.ctypes.data, qf.data_ptr(), out.data_ptr(),
        lse.data_ptr(), hkv, m, d, dim_v, scale, softcap or 0.0, torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"native batched decode attention failed with status {rc}")
    return out.to(q.device, q.dtype), lse.to(q.device)


class LayerDescs:
    """The `PartDesc` arrays of every layer of a group, built once per step: the
    arenas are [layers, ...] tensors, so one layer's descriptors differ from the
    previous layer's by a fixed distance per pointer (the layer strides).

    Built from the descriptors of local layers 0 and 1 (`second` None for a one-layer
    group) with one vectorised op; `at(layer)` is then the address of that layer's
    array, no per-layer work."""

    # uint64 word of each pointer (K and V: data, scale, zero) within one PartDesc
    _WORDS = [
        (part.offset + ptr.offset) // 8
        for part in (PartDesc.k, PartDesc.v)
        for ptr in (FieldDesc.data, FieldDesc.scale, FieldDesc.zero)
    ]

    def __init__(self, first: list[tuple], second: list[tuple] | None, num_layers: int) -> None:
        self.num_parts = n = len(first)
        per_part = ctypes.sizeof(PartDesc) // 8
        idx = np.array([p * per_part + w for p in range(n) for w in self._WORDS])
        base = np.frombuffer(bytes((PartDesc * n)(*first)), dtype=np.uint64)
        p0 = base[idx].astype(np.int64)
        delta = np.zeros_like(p0)
        if second is not None:
            p1 = np.frombuffer(bytes((PartDesc * n)(*second)), dtype=np.uint64)[idx]
            delta = np.where(p0 != 0, p1.astype(np.int64) - p0, 0)
        self._bufs = np.tile(base, (num_layers, 1))
        layers = np.arange(num_layers, dtype=np.int64)[:, None]
        self._bufs[:, idx] = (p0 + layers * delta).astype(np.uint64)
        self._addr, self._stride = self._bufs.ctypes.data, self._bufs.strides[0]

    def at(self, layer: int) -> int:
        """Address of the `PartDesc` array of local layer `layer`."""
        return self._addr + layer * self._stride

    def set_tokens(self, part: int, tokens: int) -> None:
        """Set part `part`'s token count in every layer's array (a run that grew)."""
        per_part = ctypes.sizeof(PartDesc) // 8
        self._bufs[:, part * per_part + PartDesc.tokens.offset // 8] = tokens


def pack_gqa(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[Hq, Q, D] -> [Hkv, R*Q, D] (query head h uses kv head h // R, as repeat_kv)."""
    hq, nq, d = q.shape
    return q.reshape(num_kv_heads, (hq // num_kv_heads) * nq, d)


def unpack_gqa(o: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """[Hkv, R*Q, D] -> [Hq, Q, D]."""
    hkv, rq, d = o.shape
    return o.reshape(num_q_heads, (hkv * rq) // num_q_heads, d)


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
    if softcap is None and q.device.type == "cpu" and k.shape[-1] == v.shape[-1]:
        out, lse = _flash_cpu(q[None], k[None], v[None], 0.0, False, scale=scale)
        return out[0], lse[0]
    if q.device.type == "cuda":  # an LSE-returning GPU kernel (kvstrata.device_attention)
        from kvstrata.device_attention import lse_attention

        return lse_attention(q, k, v, scale, softcap)
    return _math_attention(q, k, v, scale, None, softcap)


def _math_attention(
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
    out, lse = _math_attention(qg, k, v, scale, allowed_g, softcap)
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
        out, _ = _math_attention(q[i], k_rep, v_rep, scale, row_allowed[None], softcap)
        outs.append(out.transpose(0, 1))
    return torch.stack(outs)
