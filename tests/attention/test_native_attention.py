"""Native decode attention (kvstrata/platform/csrc/attention.cpp) against torch.

Raw parts must match torch attention to fp32 rounding; quantized parts (int8, fp8, int4
read in place) must match "decode the blocks, then attend" — the kernel changes where
the dequantization happens, not what is computed. Then the same through TieredCache:
native decode vs the torch partials path, and vs staging of quantized host blocks.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hf_models import tiny_model
from kvstrata.attention.math import merge_all
from kvstrata.attention.native import (
    encoded_field,
    native_attention,
    native_attention_batch,
    raw_field,
)
from kvstrata.attention.partials import partial_attention
from kvstrata.codecs.registry import get_codec
from kvstrata.core.formats import FieldDesc, FieldFormat
from kvstrata.core.layout import BlockLayout
from kvstrata.integrations.hf import TieredCache, enable
from kvstrata.platform import native as _native

pytestmark = pytest.mark.skipif(not _native.available(), reason="no C++ compiler")


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    err = ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()
    assert err <= tol, err


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [36, 64, 80, 96, 128, 256])  # 36: not a multiple of 8
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7])  # register blocks of 3 rows and their tails
def test_raw_parts_match_torch(dtype, dim, rows, threads):
    g = torch.Generator().manual_seed(dim + rows)
    h, lengths = 2, [1, 300, 17, 2100]
    q = torch.randn(h, rows, dim, generator=g)
    ks = [torch.randn(h, n, dim, generator=g).to(dtype) for n in lengths]
    vs = [torch.randn(h, n, dim, generator=g).to(dtype) for n in lengths]
    scale = 1 / math.sqrt(dim)
    want, want_lse = partial_attention(q, torch.cat(ks, 1).float(), torch.cat(vs, 1).float(), scale)
    parts = [(n, raw_field(k), raw_field(v)) for n, k, v in zip(lengths, ks, vs, strict=True)]
    out, lse = native_attention(q, parts, dim, scale)
    _close(out, want, 1e-5)
    assert torch.allclose(lse, want_lse, atol=2e-5)


def test_strided_views_softcap_and_value_dim(threads):
    """Views into a wider arena (head stride != rows * dim), Gemma-2 soft-capping,
    and a value head dim different from the key head dim (math path as reference)."""
    g = torch.Generator().manual_seed(3)
    arena_k = torch.randn(3, 4, 5000, 64, generator=g)[1]  # [4, 5000, 64] view
    arena_v = torch.randn(3, 4, 5000, 32, generator=g)[2]
    k, v = arena_k[:, 1000:3100], arena_v[:, 1000:3100]
    q = torch.randn(4, 3, 64, generator=g) * 3
    want, want_lse = partial_attention(q, k, v, 0.125, softcap=5.0)  # math path
    out, lse = native_attention(q, [(2100, raw_field(k), raw_field(v))], 32, 0.125, 5.0)
    _close(out, want, 1e-5)
    assert torch.allclose(lse, want_lse, atol=2e-5)


def test_peaked_scores_and_exp_accuracy(threads):
    """Scores spanning ~80 nats (exp underflow territory) and one dominant key."""
    g = torch.Generator().manual_seed(4)
    k = torch.randn(1, 4096, 64, generator=g)
    v = torch.randn(1, 4096, 64, generator=g)
    q = k[:, 1234:1235].clone() * 6  # aligned with one key: a sharp peak
    want, want_lse = partial_attention(q, k, v, 0.125)
    out, lse = native_attention(q, [(4096, raw_field(k), raw_field(v))], 64, 0.125)
    _close(out, want, 1e-5)
    assert torch.allclose(lse, want_lse, atol=1e-4)


def _encoded(codec_name: str, dim: int, n_blocks: int, bs: int = 64, seed: int = 0):
    """Encoded arenas [1, H, rows, cols] of random K/V with outlier key channels, and
    the decoded K/V [H, n*bs, dim] they stand for."""
    codec = get_codec(codec_name)
    layout = BlockLayout(1, 2, dim, bs)
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, 2, n_blocks * bs, dim, generator=g)
    k[..., 3] *= 20
    v = torch.randn(1, 2, n_blocks * bs, dim, generator=g)
    enc, dec = {}, {}
    for kind, x in (("k", k), ("v", v)):
        fields = {
            f: torch.empty((1, 2, n_blocks * s.rows, s.cols), dtype=s.dtype)
            for f, s in codec.fields(kind, layout).items()
        }
        codec.encode(kind, x, fields)
        enc[kind] = fields
        dec[kind] = torch.empty_like(x)
        codec.decode(kind, fields, dec[kind])
    return codec, enc, dec["k"][0], dec["v"][0]


@pytest.mark.parametrize("codec_name", ["int8", "fp8", "int4", "int4-g32", "int4-g128"])
@pytest.mark.parametrize("dim", [64, 128, 256])
def test_quantized_parts_match_decode_then_attend(codec_name, dim, threads):
    if codec_name == "int4-g128" and dim < 128:
        pytest.skip("group 128 needs a head dim of at least 128")
    bs = 128
    codec, enc, k, v = _encoded(codec_name, dim, 12, bs)
    g = torch.Generator().manual_seed(9)
    q = torch.randn(2, 2, dim, generator=g)
    scale = 1 / math.sqrt(dim)

    def field(kind: str, row0: int) -> FieldDesc | None:
        f = enc[kind]
        zero = f["zero"][0] if "zero" in f else None
        fmt = codec.attend_format(kind, BlockLayout(1, 2, dim, bs))
        return encoded_field(fmt, f["data"][0], f["scale"][0], zero, row0)

    # parts that start mid-block and mid key-group, plus a raw part in between
    raw_k = torch.randn(2, 40, dim, generator=g)
    raw_v = torch.randn(2, 40, dim, generator=g)
    spans = [(5, 700), (700, 701), (830, 1536)]
    parts = [(b - a, field("k", a), field("v", a)) for a, b in spans]
    parts.insert(1, (40, raw_field(raw_k), raw_field(raw_v)))
    keys = torch.cat([k[:, 5:700], raw_k, k[:, 700:701], k[:, 830:1536]], 1)
    vals = torch.cat([v[:, 5:700], raw_v, v[:, 700:701], v[:, 830:1536]], 1)
    want, want_lse = partial_attention(q, keys, vals, scale)
    out, lse = native_attention(q, parts, dim, scale)
    _close(out, want, 1e-5)
    assert torch.allclose(lse, want_lse, atol=1e-4)


def test_nan_input_propagates_never_a_finite_guess():
    g = torch.Generator().manual_seed(8)
    k = torch.randn(2, 600, 64, generator=g)
    v = torch.randn(2, 600, 64, generator=g)
    q = torch.randn(2, 2, 64, generator=g)
    q[1, 0, 5] = float("nan")
    out, _ = native_attention(q, [(600, raw_field(k), raw_field(v))], 64, 0.125)
    assert out[1, 0].isnan().all() and not out[0].isnan().any()


def test_no_parts_and_oversized_shapes_return_none():
    q = torch.randn(2, 1, 64)
    assert native_attention(q, [], 64, 0.125) is None
    k = torch.randn(2, 8, 64)
    part = [(8, raw_field(k), raw_field(k))]
    assert native_attention(torch.randn(2, 65, 64), part, 64, 0.125) is None  # > 64 rows
    assert raw_field(torch.randn(2, 8, 64).to(torch.float64)) is None  # no fp64 format


def test_descriptors_are_named_and_checked():
    k = torch.randn(3, 10, 64, dtype=torch.float16)[:, 2:]
    d = raw_field(k)
    assert (d.format, d.data, d.scale, d.row0) == (FieldFormat.F16, k.data_ptr(), None, 0)
    assert (d.data_head_stride, d.data_row_stride) == (10 * 64 * 2, 64 * 2)
    q = torch.randn(3, 1, 64)
    d.format = 99
    with pytest.raises(RuntimeError, match="status -2"):  # unknown format
        native_attention(q, [(8, d, raw_field(k))], 64, 0.125)
    bad = encoded_field((FieldFormat.INT4_TOKEN, 0), k, k, None, 0)
    with pytest.raises(RuntimeError, match="status -3"):  # group 0
        native_attention(q, [(8, raw_field(k), bad)], 64, 0.125)


def test_std_thread_workers_without_openmp():
    """The kernel's own threads (no OpenMP runtime in the process) give the same result."""
    lib = _native.load()
    g = torch.Generator().manual_seed(6)
    k = torch.randn(2, 5000, 64, generator=g)
    v = torch.randn(2, 5000, 64, generator=g)
    q = torch.randn(2, 2, 64, generator=g)
    part = [(5000, raw_field(k), raw_field(v))]
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with_omp = native_attention(q, part, 64, 0.125)
        lib.kv_use_openmp(b"-")
        without = native_attention(q, part, 64, 0.125)
    finally:
        gomp = _native._loaded_openmp()
        lib.kv_use_openmp(gomp.encode() if gomp else None)
        torch.set_num_threads(before)
    _close(without[0], with_omp[0], 1e-6)
    _close(without[0], partial_attention(q, k, v, 0.125)[0], 1e-5)


def test_merges_with_torch_partials(threads):
    """A native partial merges with torch partials (disk chunks) by log-sum-exp."""
    g = torch.Generator().manual_seed(5)
    k = torch.randn(2, 3000, 64, generator=g)
    v = torch.randn(2, 3000, 64, generator=g)
    q = torch.randn(2, 2, 64, generator=g)
    want, _ = partial_attention(q, k, v, 0.125)
    nat = native_attention(q, [(1000, raw_field(k[:, :1000]), raw_field(v[:, :1000]))], 64, 0.125)
    out, _ = merge_all([nat, partial_attention(q, k[:, 1000:], v[:, 1000:], 0.125)])
    _close(out, want, 1e-5)


def test_batched_decodes_equal_one_call_per_sequence(threads):
    """S sequences in one `kv_attn_decode_batch` call get, bit for bit, what a call of
    their own gives them: lengths from 1 to several splits, raw and int8 parts,
    soft-capping; a sequence with no parts gets lse -inf."""
    import ctypes

    from kvstrata.core.formats import PartDesc

    codec, enc, k8, v8 = _encoded("int8", 64, 8, 64, seed=3)
    fmt = codec.attend_format("k", BlockLayout(1, 2, 64, 64))

    def int8_part(a: int, b: int) -> tuple:
        f = [encoded_field(fmt, enc[x]["data"][0], enc[x]["scale"][0], None, a) for x in "kv"]
        return (b - a, *f)

    g = torch.Generator().manual_seed(11)
    raws = [(torch.randn(2, n, 64, generator=g), torch.randn(2, n, 64, generator=g)) for n in
            (1, 700, 3000, 37)]  # fmt: skip
    seqs = [
        [(1, raw_field(raws[0][0]), raw_field(raws[0][1]))],
        [int8_part(0, 300), (700, raw_field(raws[1][0]), raw_field(raws[1][1]))],
        [(3000, raw_field(raws[2][0]), raw_field(raws[2][1])), int8_part(64, 512)],
        [int8_part(5, 6)],
        [(37, raw_field(raws[3][0]), raw_field(raws[3][1]))],
    ]
    q = torch.randn(len(seqs), 2, 3, 64, generator=g)
    for softcap in (None, 4.0):
        arrays = [(PartDesc * len(p))(*p) for p in seqs]
        descs = np.array([ctypes.addressof(a) for a in arrays], dtype=np.uint64)
        nparts = np.array([len(p) for p in seqs], dtype=np.intc)
        out, lse = native_attention_batch(q, descs, nparts, 64, 0.125, softcap)
        solo = [native_attention(q[i], parts, 64, 0.125, softcap) for i, parts in enumerate(seqs)]
        for i, (want, want_lse) in enumerate(solo):
            assert torch.equal(out[i], want) and torch.equal(lse[i], want_lse), i
        nparts[1] = 0  # an empty sequence: no key at all; the others are unchanged
        out, lse = native_attention_batch(q, descs, nparts, 64, 0.125, softcap)
        assert torch.isneginf(lse[1]).all()
        assert all(torch.equal(out[i], solo[i][0]) for i in (0, 2, 3, 4))


# -- through TieredCache --------------------------------------------------------------------
def _decode_logits(model, ids, steps: int, native: bool, **cache_kw) -> torch.Tensor:
    cache = TieredCache(model.config, block_size=64, **cache_kw)
    cache.native_attention = native
    with torch.no_grad():
        out = model(ids, cache=cache, use_cache=True)
        logits = [out.logits[:, -1]]
        tok = out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            out = model(tok, cache=cache, use_cache=True)
            logits.append(out.logits[:, -1])
            tok = out.logits[:, -1:].argmax(-1)
    assert cache.stats()["tiers"]["host"]["used_blocks"] >= 6
    assert ("host" in cache.store.runtime.native) == native, "the path under test was not taken"
    return torch.cat(logits)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
@pytest.mark.parametrize("host_codec", ["none", "int8", "fp8", "int4"])
def test_cache_native_decode_matches_torch_path(family, host_codec):
    """Same cache contents, two attention paths: native decode (in-place raw and
    quantized runs, one call) vs torch partials with quantized blocks staged."""
    # head dim 64 (int4 groups of 64 channels), 2 KiB of K/V per token
    size = dict(hidden_size=256, intermediate_size=512, initializer_range=0.05)
    if family == "gemma2":
        size.update(head_dim=64, query_pre_attn_scalar=64)
    model = enable(tiny_model(family, "sdpa" if family != "gemma2" else "eager", **size))
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 97, (1, 700), generator=g)
    kw = dict(max_tokens=1024, device_budget="512KiB", host_budget="4MiB", host_codec=host_codec)
    if host_codec != "none":
        kw["residual_tokens"] = 64
    fast = _decode_logits(model, ids, 40, True, **kw)
    slow = _decode_logits(model, ids, 40, False, **kw)
    _close(fast, slow, 1e-4)
    assert torch.equal(fast.argmax(-1), slow.argmax(-1))


def test_layer_descs_equal_descriptors_built_per_layer() -> None:
    """The step's descriptor arrays (built from layers 0 and 1 and shifted) are, byte
    for byte, the arrays built directly for every layer — raw and int8 parts."""
    import ctypes

    from kvstrata.attention.native import LayerDescs
    from kvstrata.core.formats import PartDesc

    layers, heads, rows, dim = 5, 2, 48, 64
    raw = torch.randn(layers, heads, rows, dim)
    codec = get_codec("int8")
    layout = BlockLayout(num_layers=layers, num_kv_heads=heads, head_dim=dim, block_size=16)
    fmt = codec.attend_format("k", layout)
    data = torch.zeros(layers, heads, rows, dim, dtype=torch.int8)
    scale = torch.ones(layers, heads, rows, 1)
    zero = torch.zeros(layers, heads, rows, 1)

    def parts(layer: int) -> list[tuple]:
        k = raw[layer][:, 3:40]
        enc = encoded_field(fmt, data[layer], scale[layer], zero[layer], 16)
        return [(37, raw_field(k), raw_field(k)), (16, enc, enc)]

    descs = LayerDescs(parts(0), parts(1), layers)
    size = 2 * ctypes.sizeof(PartDesc)
    for layer in range(layers):
        want = bytes((PartDesc * 2)(*parts(layer)))
        assert ctypes.string_at(descs.at(layer), size) == want


@pytest.mark.parametrize("host_codec", ["none", "int8"])
def test_patched_read_plans_equal_rebuilt_ones(monkeypatch, host_codec):
    """A decode step that only grows a sequence's last run patches last step's plan;
    every patched plan must equal, byte for byte, the plan built from scratch — over
    steps that cross block boundaries and spill blocks to the host tier."""
    from kvstrata.attention.reads import ReadPlanner

    real = ReadPlanner._grown_plan
    checked = []

    def grown(self, group, seq_id, start, end, native, runs):
        plan = real(self, group, seq_id, start, end, native, runs)
        if plan is not None:
            fresh = self._build_plan(group, start, end, native, runs)
            assert plan.pieces == fresh.pieces and plan.runs is runs
            assert plan.native.num_parts == fresh.native.num_parts
            assert np.array_equal(plan.native._bufs, fresh.native._bufs), (seq_id, end)
            checked.append(end)
        return plan

    monkeypatch.setattr(ReadPlanner, "_grown_plan", grown)
    size = dict(hidden_size=256, intermediate_size=512, initializer_range=0.05)
    model = enable(tiny_model("llama", **size))
    ids = torch.randint(3, 97, (1, 700), generator=torch.Generator().manual_seed(4))
    kw = dict(max_tokens=1024, device_budget="512KiB", host_budget="4MiB", host_codec=host_codec)
    if host_codec != "none":
        kw["residual_tokens"] = 64
    _decode_logits(model, ids, 100, True, **kw)
    assert len(checked) > 50, "decode steps should mostly patch their plans"
