"""The native small-batch projection (platform/csrc/linear.cpp, integrations/hf/linear.py).

The kernel must agree with a float64 product to fp32 rounding (no worse than torch's
BLAS), give every row the same bits alone or in a batch and with any thread count, and
be taken only where the engine turns it on: the same model called by anyone else runs
torch's `F.linear`, bit for bit as before. The engine's greedy tokens with it equal
those without it and transformers' own (tests/engine/test_engine.py checks the latter with it
on, the default).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_models import tiny_model
from kvstrata.engine import Engine, EngineConfig, SamplingParams
from kvstrata.integrations.hf import linear as native_linear
from kvstrata.platform import native

pytestmark = pytest.mark.skipif(not native.available(), reason="no C++ compiler")


def kernel(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, threads: int):
    lib = native.load()
    y = torch.empty(x.shape[0], w.shape[0])
    status = lib.kv_linear_small(
        x.data_ptr(),
        w.data_ptr(),
        None if b is None else b.data_ptr(),
        y.data_ptr(),
        x.shape[0],
        x.shape[1],
        w.shape[0],
        threads,
    )
    assert status == 0
    return y


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize(("k", "n"), [(576, 576), (64, 1536), (577, 193), (5, 3), (1536, 7)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_a_float64_product(rows, k, n, bias):
    g = torch.Generator().manual_seed(rows * 1000 + k + n)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    got = kernel(x, w, b, 2)
    blas = F.linear(x, w, b)
    err, blas_err = (got - exact).abs().max().item(), (blas - exact).abs().max().item()
    # fp32 dot products of k terms: error ~ sqrt(k) ulp of the terms' size
    assert err <= 2e-6 * k**0.5 * exact.abs().max().item() + 1e-6
    assert err <= 4 * blas_err + 1e-6  # no worse than torch's own fp32 product


def test_rows_get_the_same_bits_alone_in_a_batch_and_on_any_thread_count():
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(8, 577, generator=g), torch.randn(301, 577, generator=g), None
    batch = kernel(x, w, b, 1)
    assert torch.equal(kernel(x, w, b, 2), batch)
    assert torch.equal(kernel(x, w, b, 3), batch)
    for i in range(8):
        assert torch.equal(kernel(x[i : i + 1].contiguous(), w, b, 2)[0], batch[i])
    assert torch.equal(kernel(x[3:6].contiguous(), w, b, 2), batch[3:6])


def test_bad_shapes_are_refused_by_the_kernel():
    lib = native.load()
    x, w, y = torch.randn(17, 4), torch.randn(3, 4), torch.empty(17, 3)
    assert lib.kv_linear_small(x.data_ptr(), w.data_ptr(), None, y.data_ptr(), 17, 4, 3, 1) == -1
    assert lib.kv_linear_small(x.data_ptr(), w.data_ptr(), None, y.data_ptr(), 0, 4, 3, 1) == -1


def test_installed_layers_take_the_kernel_only_when_turned_on(monkeypatch):
    monkeypatch.setattr(native_linear, "MIN_WEIGHT_BYTES", 0)
    torch.manual_seed(0)
    layer = torch.nn.Linear(40, 24)
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    model = torch.nn.Sequential(layer)
    assert native_linear.install(model) == 1
    assert native_linear.install(model) == 1  # idempotent
    x = torch.randn(2, 3, 40)  # 6 rows
    with torch.inference_mode():
        off = model(x)
        with native_linear.native_projections():
            on = model(x)
            many_x = torch.randn(3, 3, 40)  # 9 rows: a prefill chunk's product
            many = model(many_x)
    assert torch.equal(off, F.linear(x, w, b))  # other callers: torch's, bit for bit
    assert on.shape == (2, 3, 24)
    assert torch.equal(on.reshape(6, 24), kernel(x.reshape(6, 40), w, b, torch.get_num_threads()))
    assert torch.allclose(on, off, rtol=1e-5, atol=1e-6)  # the same numbers to rounding
    # more rows (a prefill chunk): oneDNN's product where torch has it, else torch's
    if native_linear.onednn_available():
        dnn = torch.ops.mkldnn._linear_pointwise(many_x.reshape(9, 40), w, b, "none", [], "")
        assert torch.equal(many, dnn.reshape(3, 3, 24))
    else:
        assert torch.equal(many, F.linear(many_x, w, b))
    assert torch.allclose(many, F.linear(many_x, w, b), rtol=1e-5, atol=1e-6)
    # autograd: the kernel has no backward, so a product that needs one is torch's
    with native_linear.native_projections():
        y = model(x)
    y.sum().backward()
    assert layer.weight.grad is not None


def test_small_weights_keep_torchs_product():
    small, big = torch.nn.Linear(256, 256), torch.nn.Linear(512, 512)  # 256 KiB, 1 MiB
    assert native_linear.install(torch.nn.Sequential(small, big)) == 1
    assert "forward" not in vars(small) and "forward" in vars(big)


def test_a_layer_with_other_weights_keeps_torchs_product():
    layer = torch.nn.Linear(16, 8).to(torch.float64)
    assert native_linear.install(torch.nn.Sequential(layer)) == 0
    x = torch.randn(2, 16, dtype=torch.float64)
    with torch.inference_mode(), native_linear.native_projections():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_engine_greedy_tokens_equal_with_and_without_the_kernel(family, monkeypatch):
    monkeypatch.setattr(native_linear, "MIN_WEIGHT_BYTES", 0)  # (the tiny model's are small)
    g = torch.Generator().manual_seed(3)
    ps = [torch.randint(3, 97, (m,), generator=g).tolist() for m in (5, 30, 70, 12)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outs = {}
    for on in (True, False):
        config = EngineConfig(native_linear=on, max_batched_tokens=64)
        with Engine(tiny_model(family), block_size=16, config=config) as engine:
            outs[on] = [o.token_ids for o in engine.generate(ps, params)]
            if on:
                assert engine.runner.native_linear
    assert outs[True] == outs[False]
