"""Decode-sized projections through kvstrata's native small-batch kernel.

A decode step feeds the model one token per running sequence, so every projection
(q/k/v/o, the MLP, the LM head over the rows kept) multiplies a few rows by a large
weight: the time goes into reading the weights. torch's sgemm packs the weight before
it multiplies, which on small inputs reads it more slowly than streaming it; the
native kernel (`platform/csrc/linear.cpp`) streams each weight once, shared out among
the step's threads, and takes a fraction of torch's time for a step's projections
(the figures: docs/MEASUREMENTS.md).

`install(model)` gives every fp32 CPU `nn.Linear` of a model (weights of at least
MIN_WEIGHT_BYTES: smaller ones sit in cache) a forward that, while
`native_projections()` is on in the calling thread (the engine turns it on around its
own forwards), takes the kernel for inputs of at most MAX_ROWS rows and oneDNN's fp32
product (`mkldnn._linear_pointwise`, the library vLLM's CPU backend multiplies with)
for more: a prefill chunk. It is faster than torch's `F.linear` (MKL) on the largest
of a small model's projections and level with it on the others
(docs/MEASUREMENTS.md) — with the weight as it is, no packed copy.
Anything else — other dtypes, autograd, other callers of the same model — runs
`F.linear` as before. The kernel's sums are fixed-order fp32 dot products: they do not
depend on the thread count or on how many rows come together; both it and oneDNN
differ from MKL in the last bits (tests check greedy agreement with the reference
path, and `EngineConfig(native_linear=False)` keeps `F.linear` everywhere).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from kvstrata.platform import native

MAX_ROWS = 8  # above this the BLAS (compute-bound, blocked for many rows) is faster
# Below this the weight sits in cache and the kernel's call and thread hand-off cost
# more than it saves: torch's product stays (measured per weight shape, one row:
# docs/MEASUREMENTS.md).
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
        route = _route(x, weight, bias) if getattr(_state, "on", False) else TORCH
        if route == TORCH:
            return F.linear(x, weight, bias)
        n, k = weight.shape
        rows = x.numel() // k
        if route == ONEDNN:
            y = torch.ops.mkldnn._linear_pointwise(x.view(rows, k), weight, bias, "none", [], "")
            return y.view(*x.shape[:-1], n)
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
        if status != 0:  # (ruled out by _route)
            return F.linear(x, weight, bias)
        return y

    return forward


TORCH, NATIVE, ONEDNN = 0, 1, 2


@functools.cache
def onednn_available() -> bool:
    """Whether this torch has oneDNN's fp32 linear (`mkldnn._linear_pointwise`)."""
    try:
        return torch.backends.mkldnn.is_available() and bool(
            torch.ops.mkldnn._linear_pointwise.default
        )
    except (AttributeError, RuntimeError):
        return False


def _route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> int:
    """Which product an installed projection takes for `x` (engine forwards only)."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous():
        return TORCH
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        return TORCH
    if not weight.is_contiguous() or x.shape[-1] != weight.shape[1] or x.numel() == 0:
        return TORCH
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        return TORCH
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return TORCH
    if x.numel() // weight.shape[1] <= MAX_ROWS:
        return NATIVE
    return ONEDNN if onednn_available() else TORCH
