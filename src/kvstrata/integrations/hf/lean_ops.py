"""The lean forward's RoPE and RMSNorm on decode-sized inputs, in one native call each.

A decode step applies RoPE (7 torch ops per tensor: two slices, a negation, a cat, two
products, a sum) and two RMSNorms (6 ops) per layer to a few hundred floats, so their
time is the ops' dispatch, which the step pays cold, after its weights went through the
caches: together a noticeable share of a small model's decode step
(docs/MEASUREMENTS.md). `kv_rope` and `kv_rms_scale` (platform/csrc/elementwise.cpp) do
the same float operations in the same order, each rounded on its own, so the result is
bit-identical: the norm keeps torch's `pow(2).mean` (the one reduction, whose summation
order is torch's own) and takes the rest natively.

Each is adopted only if, at construction, it gives the bits of the model's own function
on a probe (random inputs, 1 and 3 tokens): a variant that computes anything else — a
norm with an offset, a partial rotary — keeps the model's. Inputs of more than
MAX_ELEMENTS floats (a prefill chunk), other dtypes or layouts, and anything autograd
records take the model's function.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from kvstrata.platform import native

# decode-sized: above this many floats torch's ops (parallel, vectorised) take over (a
# decode step of 16 sequences through smollm2's RoPE: 12,288)
MAX_ELEMENTS = 1 << 16


class NativeRope:
    """`rope(q, k, cos, sin)` with q/k [1, H, T, D] and cos/sin [1, T, D], fp32 CPU."""

    def __init__(self, rope: Any, lib: Any) -> None:
        self.rope, self.lib = rope, lib

    def __call__(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        if not self._fits(q, k, cos, sin):
            return self.rope(q, k, cos, sin)
        qo, ko = torch.empty_like(q), torch.empty_like(k)  # the strides torch's would have
        if qo.stride(-1) != 1 or ko.stride(-1) != 1:
            return self.rope(q, k, cos, sin)
        _, hq, tokens, dim = q.shape
        qs = (ctypes.c_int64 * 4)(q.stride(1), q.stride(2), qo.stride(1), qo.stride(2))
        ks = (ctypes.c_int64 * 4)(k.stride(1), k.stride(2), ko.stride(1), ko.stride(2))
        rc = self.lib.kv_rope(
            q.data_ptr(),
            qo.data_ptr(),
            hq,
            qs,
            k.data_ptr(),
            ko.data_ptr(),
            k.shape[1],
            ks,
            tokens,
            dim,
            cos.data_ptr(),
            sin.data_ptr(),
            cos.stride(1),
        )
        if rc != 0:  # (ruled out by _fits)
            return self.rope(q, k, cos, sin)
        return qo, ko

    @staticmethod
    def _fits(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or q.shape[0] != 1:
            return False
        _, _, tokens, dim = q.shape
        if q.numel() + k.numel() > MAX_ELEMENTS or dim % 2:
            return False
        if k.shape[0] != 1 or k.shape[2:] != q.shape[2:]:
            return False
        if cos.shape != (1, tokens, dim) or sin.shape != cos.shape:
            return False
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
            return False
        for t in (q, k, cos, sin):
            if t.dtype != torch.float32 or t.device.type != "cpu" or t.stride(-1) != 1:
                return False
        return min(*q.stride(), *k.stride()) >= 0 and sin.stride() == cos.stride()


class NativeRMSNorm:
    """A Llama-style RMSNorm module's forward on fp32 CPU rows."""

    def __init__(self, module: torch.nn.Module, lib: Any) -> None:
        self.module, self.forward, self.lib = module, module.forward, lib
        self.eps = float(module.variance_epsilon)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        w = self.module.weight
        dim = w.shape[0]
        if (
            h.dtype != torch.float32
            or h.device.type != "cpu"
            or not h.is_contiguous()
            or h.shape[-1] != dim
            or h.numel() > MAX_ELEMENTS
            or w.dtype != torch.float32
            or not w.is_contiguous()
            or (torch.is_grad_enabled() and (w.requires_grad or h.requires_grad))
        ):
            return self.forward(h)
        var = h.pow(2).mean(-1, keepdim=True)
        y = torch.empty_like(h)
        rows = h.numel() // dim
        rc = self.lib.kv_rms_scale(
            h.data_ptr(), var.data_ptr(), w.data_ptr(), self.eps, y.data_ptr(), rows, dim
        )
        return y if rc == 0 else self.forward(h)


def native_rope(rope: Any, head_dim: int) -> Any:
    """`rope` or, when the native library gives its bits on a probe, a NativeRope."""
    lib = native.load()
    if lib is None:
        return rope
    fast = NativeRope(rope, lib)
    gen = torch.Generator().manual_seed(0)
    for tokens in (1, 3):
        q = torch.randn(1, tokens, 3, head_dim, generator=gen).transpose(1, 2)
        k = torch.randn(1, tokens, 2, head_dim, generator=gen).transpose(1, 2)
        angle = torch.randn(1, tokens, head_dim, generator=gen) * 7
        cos, sin = angle.cos(), angle.sin()
        if not all(map(torch.equal, rope(q, k, cos, sin), fast(q, k, cos, sin))):
            return rope
    return fast


def native_norm(module: torch.nn.Module) -> Any:
    """`module.forward` or, for an RMSNorm whose bits the native path gives on a probe,
    a NativeRMSNorm."""
    lib = native.load()
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", None)
    if lib is None or not isinstance(weight, torch.Tensor) or not isinstance(eps, float):
        return module.forward
    if weight.dim() != 1 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return module.forward
    fast = NativeRMSNorm(module, lib)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for rows in (1, 3):
            h = torch.randn(1, rows, weight.shape[0], generator=gen) * 4
            if not torch.equal(module.forward(h), fast(h)):
                return module.forward
    return fast
