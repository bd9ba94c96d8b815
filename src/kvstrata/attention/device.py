"""Partial attention with its log-sum-exp on the GPU: one function, several kernels.

`lse_attention(q, k, v, scale)` is `attention.partials.partial_attention` for CUDA tensors:
packed queries q [Hkv, M, D] over one part of the keys (a resident run's arena view,
a staged chunk) -> (out [Hkv, M, Dv], lse [Hkv, M] fp32, natural log), so the parts
merge exactly as on the CPU (`attention.merge_all`). Kernels, first usable wins:

    flash_attn   flash-attn 2 (`flash_attn_func(..., return_attn_probs=True)`), fp16/bf16
    flashinfer   `single_prefill_with_kv_cache(..., kv_layout="HND", return_lse=True)`
    efficient    torch's memory-efficient SDPA (`aten._scaled_dot_product_efficient_
                 attention` with compute_log_sumexp): always there with CUDA torch
    math         plain torch (`attention.math_attention`): soft-capping, odd shapes

flash-attn and flashinfer are optional: `pip install "kvstrata[flash-attn]"` or
`"kvstrata[flashinfer]"` (the fused dequant's Triton is `"kvstrata[cuda]"`).
`KVSTRATA_ATTENTION=<name>` forces one: a forced kernel that is not installed, or that
fails its check, is an error rather than a silent fallback. Each kernel is checked
once per (device, dtype, head dims) against the math path on a small strided input
before it is used: a kernel whose LSE is not the natural-log LSE of the same scores
(flashinfer has used base 2) is rescaled when the base is the only difference; one
that fails or disagrees is skipped. A checked kernel that still raises on some input
(e.g. a view whose alignment it refuses) falls back to the math path for that call,
with a warning the first time (per kernel) and a count in `fallbacks`. The adapters
(layouts, LSE padding) are tested on the CPU with stand-in kernels.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvstrata.attention.math import host_partial, math_attention
from kvstrata.core.errors import ConfigError

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple]
KERNEL_ORDER = ("flash_attn", "flashinfer", "efficient", "math")
ENV_FORCE = "KVSTRATA_ATTENTION"
# where the optional kernels come from
EXTRAS = {"flash_attn": "kvstrata[flash-attn]", "flashinfer": "kvstrata[flashinfer]"}


# -- adapters: each takes q [H, M, D], k [H, T, D], v [H, T, Dv] and returns (out, lse) ---
def efficient_kernel(op: Callable | None = None) -> Kernel:
    """torch's memory-efficient attention. Its LSE is [B, H, ceil(M / 32) * 32]: padded."""

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple:
        fn = op or torch.ops.aten._scaled_dot_product_efficient_attention
        out, lse = fn(q[None], k[None], v[None], None, True, 0.0, False, scale=scale)[:2]
        return out[0], lse[0, :, : q.shape[1]]

    return run


def flash_attn_kernel(fn: Callable) -> Kernel:
    """flash-attn 2's `flash_attn_func`: [B, S, H, D] layout, LSE [B, H, M]."""

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple:
        out, lse, *_ = fn(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            softmax_scale=scale,
            causal=False,
            return_attn_probs=True,
        )
        return out[0].transpose(0, 1), lse[0]

    return run


def flashinfer_kernel(fn: Callable) -> Kernel:
    """flashinfer's `single_prefill_with_kv_cache`: q [M, H, D], K/V "HND"
    [H, T, D], out [M, H, Dv], LSE [M, H]."""

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple:
        out, lse = fn(
            q.transpose(0, 1),
            k,
            v,
            kv_layout="HND",
            causal=False,
            sm_scale=scale,
            return_lse=True,
        )
        return out.transpose(0, 1), lse.transpose(0, 1)

    return run


def _math_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple:
    return math_attention(q, k, v, scale, None, None)


def installed_kernels() -> dict[str, Kernel]:
    """The kernels importable here, in preference order."""
    kernels: dict[str, Kernel] = {}
    try:
        from flash_attn import flash_attn_func

        kernels["flash_attn"] = flash_attn_kernel(flash_attn_func)
    except ImportError:
        pass
    try:
        from flashinfer import single_prefill_with_kv_cache

        kernels["flashinfer"] = flashinfer_kernel(single_prefill_with_kv_cache)
    except ImportError:
        pass
    if hasattr(torch.ops.aten, "_scaled_dot_product_efficient_attention"):
        kernels["efficient"] = efficient_kernel()
    kernels["math"] = _math_kernel
    return kernels


# -- selection ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Checked:
    """A kernel that passed the check for one (device, dtype, dims): its name and the
    factor that turns its LSE into natural log (1, or ln 2 for a base-2 LSE)."""

    name: str
    kernel: Kernel
    lse_factor: float = 1.0


def check_kernel(
    kernel: Kernel, device: torch.device, dtype: torch.dtype, dim: int, dim_v: int
) -> float | None:
    """Run `kernel` on a small strided input and compare with the math path.

    Returns:
        The LSE factor (1.0, or ln 2 when the kernel's LSE is base 2), or None when
        the kernel fails or disagrees.
    """
    gen = torch.Generator().manual_seed(0)
    heads, rows, keys = 2, 3, 40
    q = torch.randn(heads, rows, dim, generator=gen).to(device, dtype)
    # keys / values as arena views: a slice of a longer buffer (rows strided by D,
    # heads by the buffer's length), as the kernels receive them in use
    kb = torch.randn(heads, keys + 24, dim, generator=gen).to(device, dtype)
    vb = torch.randn(heads, keys + 24, dim_v, generator=gen).to(device, dtype)
    k, v = kb[:, 8 : 8 + keys], vb[:, 8 : 8 + keys]
    scale = 1.0 / math.sqrt(dim)
    try:
        out, lse = kernel(q, k, v, scale)
    except Exception:  # a kernel that cannot take these shapes / dtypes is skipped
        return None
    ref_out, ref_lse = math_attention(q, k, v, scale, None, None)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    if tuple(out.shape) != tuple(ref_out.shape) or tuple(lse.shape) != tuple(ref_lse.shape):
        return None
    if not torch.allclose(out.float(), ref_out.float(), rtol=tol, atol=tol):
        return None
    lse = lse.float()
    for factor in (1.0, math.log(2.0)):
        if torch.allclose(lse * factor, ref_lse, rtol=tol, atol=tol):
            return factor
    return None


_checked: dict[tuple, Checked] = {}


def select_kernel(
    device: torch.device,
    dtype: torch.dtype,
    dim: int,
    dim_v: int,
    kernels: dict[str, Kernel] | None = None,
) -> Checked:
    """The first kernel (KERNEL_ORDER, or $KVSTRATA_ATTENTION) that passes
    `check_kernel` for these inputs; cached per (device, dtype, dims)."""
    forced = os.environ.get(ENV_FORCE) or None
    key = (str(device), dtype, dim, dim_v, forced)
    hit = _checked.get(key) if kernels is None else None
    if hit is not None:
        return hit
    available = kernels if kernels is not None else installed_kernels()
    names = [n for n in KERNEL_ORDER if n in available]
    if forced is not None:
        if forced not in available:
            extra = f'pip install "{EXTRAS[forced]}", or ' if forced in EXTRAS else ""
            raise ConfigError.field(
                ENV_FORCE, forced, f"not installed here; {extra}use one of: {', '.join(names)}"
            )
        names = [forced]
    chosen = Checked("math", _math_kernel)
    for name in names:
        factor = 1.0 if name == "math" else check_kernel(available[name], device, dtype, dim, dim_v)
        if factor is not None:
            chosen = Checked(name, available[name], factor)
            break
        if forced is not None:
            raise ConfigError.field(
                ENV_FORCE,
                forced,
                f"this kernel fails or disagrees with the math path on "
                f"{device} {dtype} (head dims {dim}/{dim_v}); unset it to pick the first "
                f"kernel that passes, or choose another of: {', '.join(available)}",
            )
    if kernels is None:
        _checked[key] = chosen
    return chosen


def lse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked attention of packed queries over one part of the keys, with its LSE.

    Args:
        q: [Hkv, M, D] packed queries; k [Hkv, T, D], v [Hkv, T, Dv] (views are fine).
        scale: softmax scale. softcap: Gemma-2 logit soft-capping (math path).

    Returns:
        (out [Hkv, M, Dv] in q's dtype, lse [Hkv, M] float32, natural log).
    """
    if q.device.type != "cuda":
        return host_partial(q, k, v, scale, softcap)
    if softcap is not None or k.shape[1] == 0:
        return math_attention(q, k, v, scale, None, softcap)
    chosen = select_kernel(q.device, q.dtype, q.shape[-1], v.shape[-1])
    try:
        out, lse = chosen.kernel(q, k, v, scale)
    except RuntimeError as err:  # e.g. a view whose alignment the kernel refuses
        _fell_back(chosen.name, err)
        return math_attention(q, k, v, scale, None, None)
    lse = lse.float()
    if chosen.lse_factor != 1.0:
        lse = lse * chosen.lse_factor
    return out.to(q.dtype), lse


fallbacks: dict[str, int] = {}  # kernel name -> calls that fell back to the math path


def _fell_back(name: str, err: Exception) -> None:
    """Count a call of kernel `name` that raised; warn the first time."""
    count = fallbacks[name] = fallbacks.get(name, 0) + 1
    if count == 1:
        first = str(err).splitlines()[0] if str(err) else ""
        warnings.warn(
            f"kvstrata: the {name} attention kernel raised on an input it was checked for "
            f"({type(err).__name__}: {first}); such calls use the math path "
            f"(counted in kvstrata.attention.device.fallbacks)",
            RuntimeWarning,
            stacklevel=3,
        )


def kernel_name(device: torch.device, dtype: torch.dtype, dim: int, dim_v: int) -> str:
    """Which kernel `lse_attention` uses for these inputs ("cpu" off CUDA)."""
    if device.type != "cuda":
        return "cpu"
    return select_kernel(device, dtype, dim, dim_v).name
