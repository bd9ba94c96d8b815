"""Decode-sized projections through kvstrata's native small-batch kernel.

A decode step feeds the model one token per running sequence, so every projection
(q/k/v/o, the MLP, the LM head over the rows kept) multiplies a few rows by a large
weight: the time goes into reading the weights. torch's sgemm packs the weight before
it multiplies, which on small inputs reads it about twice as slowly as streaming it;
the native kernel (`platform/csrc/linear.cpp`) streams each weight once, shared out
among the step's threads. Measured on a 2-core EPYC VM (smollm2, 4 rows, all 211
projections of a step): 50 ms against 118-158 ms for torch's.

`install(model)` gives every fp32 CPU `nn.Linear` of a model (weights of at least
MIN_WEIGHT_BYTES: smaller ones sit in cache) a forward that takes the
kernel only while `native_projections()` is on in the calling thread (the engine turns
it on around its own forwards) and for inputs of at most MAX_ROWS rows; anything else
— more rows, other dtypes, autograd, other callers of the same model — runs torch's
`F.linear` as before. The kernel's sums are fixed-order fp32 dot products: they do not
depend on the thread count or on how many rows come together, and they differ from
torch's BLAS in the last bits (tests check greedy agreement with the reference path).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from kvstrata.platform import native

MAX_ROWS = 8  # above this the BLAS (compute-bound, blocked for many rows) is faster
# Below this the weight sits in cache and the kernel's call and thread hand-off cost
# more than it saves: torch's product stays (measured, 2-core EPYC VM, 1 row: 256x256
# 26 us native against 15 us torch's; 576x576 37 / 35; 1536x576 68 / 82).
MIN_WEIGHT_BYTES = 1 << 20
_state = threading.local()


@contextmanager
def native_projections(enabled: bool = True) -> Iterator[None]:
    """Within this block, this thread's installed projections may take the kernel."""
    previous = getattr(_state, "on", False)
    _state.on = enabled
    try:
        yield
    finally:
        _state.on = previous


def install(model: torch.nn.Module) -> int:
    """Give the model's fp32 CPU `nn.Linear` layers of at least MIN_WEIGHT_BYTES the
    native decode path.

    Returns:
        How many layers have it (0 when the native library is unavailable).
    """
    lib = native.load()
    if lib is None:
        return 0
    count = 0
    for module in model.modules():
        if type(module) is not torch.nn.Linear:
            continue
        if getattr(module, "_kvstrata_native", False):
            count += 1
            continue
        weight = module.weight
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            continue
        if weight.numel() * weight.element_size() < MIN_WEIGHT_BYTES:
            continue
        if "forward" in vars(module):  # a forward of the caller's own: it stays
            continue
        module.forward = _native_forward(module, lib)  # an instance attribute
        module._kvstrata_native = True
        count += 1
    return count


def _native_forward(module: torch.nn.Linear, lib: Any) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        weight, bias = module.weight, module.bias
        if not getattr(_state, "on", False) or not _fits(x, weight, bias):
            return F.linear(x, weight, bias)
        n, k = weight.shape
        rows = x.numel() // k
        y = x.new_empty((*x.shape[:-1], n))
        status = lib.kv_linear_small(
            x.data_ptr(),
            weight.data_ptr(),
            None if bias is None else bias.data_ptr(),
            y.data_ptr(),
            rows,
            k,
            n,
            torch.get_num_threads(),
        )
        if status != 0:  # (ruled out by _fits)
            return F.linear(x, weight, bias)
        return y

    return forward


def _fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    if x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous():
        return False
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        return False
    if not weight.is_contiguous() or x.shape[-1] != weight.shape[1] or x.numel() == 0:
        return False
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    return x.numel() // weight.shape[1] <= MAX_ROWS
