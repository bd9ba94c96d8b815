"""Device attention (kvstrata.attention.device) on the CPU: the partials of any split
of the keys merge into full attention through the same interface the GPU uses, and
each GPU kernel's adapter (layouts, padded or base-2 LSE) is right — checked with
stand-in kernels that compute in the real kernels' documented layouts."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from kvstrata.attention import device as da
from kvstrata.attention.math import math_attention, merge_all, pack_gqa, reference_attention
from kvstrata.core.errors import ConfigError


def _qkv(heads=2, rows=3, keys=100, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(heads, rows, dim, generator=g)
    kb = torch.randn(heads, keys + 20, dim, generator=g)
    vb = torch.randn(heads, keys + 20, dim, generator=g)
    return q, kb[:, 10 : 10 + keys], vb[:, 10 : 10 + keys]  # strided, as arena views


@pytest.mark.parametrize("cuts", [[100], [1, 99], [37, 1, 62], [16, 16, 16, 16, 36]])
def test_merged_partials_equal_full_attention(cuts):
    """Decode over resident runs and staged chunks: one partial each, merged by LSE."""
    hq, hkv, dim = 4, 2, 16
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, hq, 1, dim, generator=g)
    k = torch.randn(1, hkv, 100, dim, generator=g)
    v = torch.randn(1, hkv, 100, dim, generator=g)
    scale = 1 / math.sqrt(dim)
    qp = pack_gqa(q[0], hkv)
    parts, start = [], 0
    for n in cuts:
        parts.append(
            da.lse_attention(qp, k[0, :, start : start + n], v[0, :, start : start + n], scale)
        )
        start += n
    out, lse = merge_all(parts)
    full_out, full_lse = math_attention(qp, k[0], v[0], scale, None, None)
    torch.testing.assert_close(out, full_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, full_lse, rtol=1e-5, atol=1e-5)
    want = reference_attention(q, k, v, scale)  # [B, Q, Hq, D]
    torch.testing.assert_close(
        out.reshape(hq, 1, dim), want[0].transpose(0, 1), rtol=1e-5, atol=1e-5
    )


def test_soft_capping_and_empty_parts_on_the_math_path():
    q, k, v = _qkv()
    out, lse = da.lse_attention(q, k, v, 0.25, softcap=5.0)
    ref_out, ref_lse = math_attention(q, k, v, 0.25, None, 5.0)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)


# -- stand-in kernels with the real ones' calling conventions ---------------------------------
def fake_efficient(q, k, v, bias, compute_lse, dropout_p, is_causal, *, scale):
    """aten._scaled_dot_product_efficient_attention: [B, H, S, D] in, out [B, H, M, Dv],
    LSE [B, H, ceil(M / 32) * 32] (padded), philox seed and offset."""
    assert bias is None and compute_lse and dropout_p == 0.0 and not is_causal
    out, lse = math_attention(q, k, v, scale, None, None)
    padded = torch.full((*lse.shape[:-1], -(-lse.shape[-1] // 32) * 32), float("nan"))
    padded[..., : lse.shape[-1]] = lse
    return out, padded, torch.tensor(0), torch.tensor(0)


def fake_flash_attn(q, k, v, softmax_scale, causal, return_attn_probs):
    """flash_attn_func: [B, S, H, D] in and out, LSE [B, H, M]."""
    assert return_attn_probs and not causal
    out, lse = math_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale, None, None
    )
    return out.transpose(1, 2), lse, None


def fake_flashinfer(q, k, v, kv_layout, causal, sm_scale, return_lse):
    """single_prefill_with_kv_cache, kv_layout="HND": q [M, H, D], K/V [H, T, D];
    out [M, H, Dv], LSE [M, H] in base 2."""
    assert kv_layout == "HND" and return_lse and not causal
    out, lse = math_attention(q.transpose(0, 1), k, v, sm_scale, None, None)
    return out.transpose(0, 1), (lse / math.log(2.0)).transpose(0, 1)


@pytest.mark.parametrize(
    "kernel",
    [
        da.efficient_kernel(fake_efficient),
        da.flash_attn_kernel(fake_flash_attn),
    ],
    ids=["efficient", "flash_attn"],
)
def test_adapters_give_partial_attention(kernel):
    q, k, v = _qkv(rows=5)
    out, lse = kernel(q, k, v, 0.3)
    ref_out, ref_lse = math_attention(q, k, v, 0.3, None, None)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    assert da.check_kernel(kernel, torch.device("cpu"), torch.float32, 16, 16) == 1.0


def test_base2_lse_is_detected_and_rescaled():
    kernel = da.flashinfer_kernel(fake_flashinfer)
    factor = da.check_kernel(kernel, torch.device("cpu"), torch.float32, 16, 16)
    assert factor == pytest.approx(math.log(2.0))
    q, k, v = _qkv()
    out, lse = kernel(q, k, v, 0.25)
    ref_out, ref_lse = math_attention(q, k, v, 0.25, None, None)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse * factor, ref_lse)


def test_selection_skips_failing_and_wrong_kernels(monkeypatch):
    def broken(q, k, v, scale):
        raise RuntimeError("no kernel image for this device")

    def wrong(q, k, v, scale):
        out, lse = math_attention(q, k, v, scale, None, None)
        return out * 1.01, lse

    cpu = torch.device("cpu")
    kernels = {
        "flash_attn": broken,
        "flashinfer": wrong,
        "efficient": da.efficient_kernel(fake_efficient),
        "math": da._math_kernel,
    }
    chosen = da.select_kernel(cpu, torch.float32, 16, 16, kernels)
    assert (chosen.name, chosen.lse_factor) == ("efficient", 1.0)
    del kernels["efficient"]
    assert da.select_kernel(cpu, torch.float32, 16, 16, kernels).name == "math"
    # forced: a kernel that fails its check is an error naming the variable, not math
    monkeypatch.setenv(da.ENV_FORCE, "flashinfer")
    with pytest.raises(
        ConfigError, match=r"^KVSTRATA_ATTENTION='flashinfer' is invalid: this kernel fails"
    ) as err:
        da.select_kernel(cpu, torch.float32, 16, 16, kernels)
    assert "\n" not in str(err.value) and "unset it" in str(err.value)
    monkeypatch.setenv(da.ENV_FORCE, "math")
    assert da.select_kernel(cpu, torch.float32, 16, 16, kernels).name == "math"
    monkeypatch.setenv(da.ENV_FORCE, "nope")
    with pytest.raises(ConfigError, match="KVSTRATA_ATTENTION='nope' is invalid: not installed"):
        da.select_kernel(cpu, torch.float32, 16, 16, kernels)
    del kernels["flashinfer"]
    monkeypatch.setenv(da.ENV_FORCE, "flashinfer")
    with pytest.raises(ConfigError, match=r'pip install "kvstrata\[flashinfer\]"'):
        da.select_kernel(cpu, torch.float32, 16, 16, kernels)


def test_kernel_errors_warn_once_and_are_counted(monkeypatch):
    monkeypatch.setattr(da, "fallbacks", {})
    with pytest.warns(RuntimeWarning, match=r"the efficient attention kernel raised .*misaligned"):
        da._fell_back("efficient", RuntimeError("misaligned view\nmore"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second time: counted, no warning
        da._fell_back("efficient", RuntimeError("misaligned view"))
    assert da.fallbacks == {"efficient": 2}


def test_kernel_name_off_cuda_and_installed_kernels():
    assert da.kernel_name(torch.device("cpu"), torch.float32, 64, 64) == "cpu"
    names = list(da.installed_kernels())
    assert names[-1] == "math" and "efficient" in names  # torch always has it
    assert names == [n for n in da.KERNEL_ORDER if n in names]
