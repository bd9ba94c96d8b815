"""The CUDA path on a GPU (skipped without CUDA; scripts/gpu_check.sh runs them).

- pinned host arena, copy streams and timing events for real;
- the LSE-returning attention kernels and the fused Triton dequant against the
  references, on the device;
- tokens identical to DynamicCache + sdpa in fp32 at every lossless placement
  (resident, host staged, host + disk, tiny staging), the staging path running on
  the copy stream (events, no worker) and no host synchronisation in it;
- quantized host blocks: the fused dequant gives the tokens of the torch decode;
- bf16 within tolerance;
- the device KV peak (torch.cuda.max_memory_allocated) = resident budget + staging,
  flat from 4k to 64k tokens;
- a device -> host write read back on the CPU at once (the non-blocking copy race).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CUDA = torch.device("cuda")


def _prompt(length: int, seed: int = 1, vocab: int = 97) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (1, length), generator=g).to(CUDA)


def _greedy(model, ids, cache, n):
    return model.generate(ids, cache=cache, max_new_tokens=n, min_new_tokens=n, do_sample=False)


# -- pieces -------------------------------------------------------------------------------------
def test_host_arena_is_pinned_and_streams_time_copies():
    from kvstrata.device_streams import CudaStreams, streams_for
    from kvstrata.layout import BlockLayout
    from kvstrata.tiers.memory import HostTier

    tier = HostTier(BlockLayout(2, 2, 64, 64), 8)
    assert tier.pinned and all(t.is_pinned() for t in tier.arenas.values())
    streams = streams_for(CUDA)
    assert isinstance(streams, CudaStreams)
    src = torch.ones(64 << 20, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device=CUDA)
    start, ready = streams.event(), streams.event()
    with streams.use(streams.h2d):
        start.record(streams.h2d)
        dst.copy_(src, non_blocking=True)
        ready.record(streams.h2d)
    streams.compute().wait_event(ready)
    ready.synchronize()
    assert start.elapsed_time(ready) > 0 and int(dst.sum()) == 64 << 20


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dim", [64, 128])
def test_lse_attention_kernels_match_math(dtype, dim):
    from kvstrata.attention import _math_attention, merge_all
    from kvstrata.device_attention import kernel_name, lse_attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(4, 8, dim, generator=g).to(CUDA, dtype)
    kb = torch.randn(4, 3000, dim, generator=g).to(CUDA, dtype)
    vb = torch.randn(4, 3000, dim, generator=g).to(CUDA, dtype)
    k, v = kb[:, 100:2100], vb[:, 100:2100]  # arena-like strided views
    scale = 1 / math.sqrt(dim)
    assert kernel_name(CUDA, dtype, dim, dim) != "math"
    parts = [
        lse_attention(q, k[:, a : a + 500], v[:, a : a + 500], scale) for a in range(0, 2000, 500)
    ]
    out, lse = merge_all(parts)
    ref_out, ref_lse = _math_attention(q.float(), k.float(), v.float(), scale, None, None)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("codec_name", ["int8", "int4", "int4-g32", "fp8"])
def test_triton_dequant_on_the_gpu_equals_the_reference_bits(codec_name, dtype):
    pytest.importorskip("triton")
    from kvstrata.codecs import _reference as ref
    from kvstrata.codecs import triton_dequant
    from kvstrata.codecs.registry import get_codec
    from kvstrata.layout import BlockLayout

    codec = get_codec(codec_name)
    lay = BlockLayout(1, 4, 128, 64, dtype)
    g = torch.Generator().manual_seed(3)
    for kind in "kv":
        x = (torch.randn(4, 256, 128, generator=g) * 3).to(dtype)
        enc = {
            f: torch.empty(4, 4 * s.rows, s.cols, dtype=s.dtype)
            for f, s in codec.fields(kind, lay).items()
        }
        codec.encode(kind, x, enc)
        expected = torch.empty_like(x)  # the eager torch reference, on the CPU
        if codec_name == "int8":
            ref.int8_decode(enc["data"], enc["scale"], enc["zero"], expected)
        elif codec_name == "fp8":
            ref.fp8_decode(enc["data"], enc["scale"], expected, 64)
        else:
            fn = ref.int4k_decode if kind == "k" else ref.int4v_decode
            fn(enc["data"], enc["scale"], enc["zero"], expected, codec.group)
        out = torch.empty(4, 300, 128, dtype=dtype, device=CUDA)[:, 20:276]
        assert triton_dequant.decode(codec, kind, {f: t.to(CUDA) for f, t in enc.items()}, out)
        bits = torch.int32 if dtype == torch.float32 else torch.int16
        assert torch.equal(out.cpu().view(bits), expected.view(bits)), (codec_name, kind)


def test_device_to_host_writes_are_read_back_correctly():
    """A non-blocking GPU -> pinned host copy returns before the bytes land: a CPU read
    right after it must still see them (the tier waits for its event)."""
    from kvstrata.codecs.registry import get_codec
    from kvstrata.layout import BlockLayout
    from kvstrata.tiers.memory import DeviceTier, HostTier

    lay = BlockLayout(4, 8, 128, 64)
    n = 32  # 32 blocks x 1 MiB
    for codec in ("none", "int8"):
        device = DeviceTier(lay, n, device="cuda")
        host = HostTier(lay, n, get_codec(codec))
        k = torch.randn(lay.raw_shape("k", n), device=CUDA)
        v = torch.randn(lay.raw_shape("v", n), device=CUDA)
        device.write_blocks(list(range(n)), k, v)
        torch.cuda._sleep(200_000_000)  # keep the stream busy: the copy lands late
        if codec == "none":
            host.write_encoded(list(range(n)), device.read_encoded(list(range(n))))
            got = host.read_encoded(list(range(n)))["k.data"]  # a CPU read
            assert torch.equal(got, k.cpu())
        else:
            host.write_blocks(list(range(n)), k, v)  # encoded on the GPU, then copied
            ko, vo = torch.empty(k.shape), torch.empty(v.shape)
            host.read_blocks(list(range(n)), ko, vo)
            torch.testing.assert_close(ko, k.cpu(), atol=0.05, rtol=0.05)


# -- end to end ---------------------------------------------------------------------------------
PLACEMENTS = {
    "device": dict(max_tokens=1536),
    "resident25_host": dict(max_tokens=1536, resident_fraction=0.25, host_budget="8MiB"),
    "resident10_host": dict(max_tokens=1536, resident_fraction=0.1, host_budget="8MiB"),
    "resident10_host_tiny_staging": dict(
        max_tokens=1536, resident_fraction=0.1, host_budget="8MiB", staging_tokens=128
    ),
    "oldest_half_disk": dict(
        max_tokens=1536, resident_fraction=0.1, host_budget="128KiB", disk_budget="4MiB"
    ),
}


@pytest.fixture(scope="module")
def fp32_references():
    from transformers import DynamicCache

    from hf_models import tiny_model

    out = {}
    for family in ("llama", "mistral"):
        model = tiny_model(family, "sdpa").to(CUDA)
        ids = _prompt(1024)
        ref = _greedy(model, ids, DynamicCache(config=model.config), 200)
        if family == "llama":  # not blind: the first block of the prompt matters
            flipped = ids.clone()
            flipped[0, :32] = (flipped[0, :32] - 3 + 1) % 94 + 3
            alt = _greedy(model, flipped, DynamicCache(config=model.config), 40)
            assert not torch.equal(alt[:, 1024:], ref[:, 1024:1064])
        out[family] = (model, ids, ref)
    return out


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_tokens_identical_fp32(family, placement, fp32_references, tmp_path):
    from kvstrata.integrations.hf import TieredCache, enable

    model, ids, ref = fp32_references[family]
    kwargs = dict(PLACEMENTS[placement])
    if "disk_budget" in kwargs:
        kwargs["disk_dir"] = str(tmp_path)
    enable(model)
    try:
        cache = TieredCache(model.config, block_size=64, **kwargs)
        out = _greedy(model, ids, cache, 200)
        stats = cache.stats()
        runtime = cache.store.runtime
    finally:
        model.set_attn_implementation("sdpa")
    assert torch.equal(out, ref), (out != ref).nonzero()[:5].tolist()
    if placement != "device":
        assert runtime.stager is not None and runtime.stager.guards is not None  # events
        t = stats["transfers"]
        assert t["num_waits"] > 0 and 0.0 <= t["hidden_fraction"] <= 1.0
        assert t["bytes_per_link"].get("host->device", 0) > 0


@pytest.mark.parametrize("codec", ["int8", "int4-g32", "fp8"])
def test_fused_dequant_gives_the_tokens_of_the_torch_decode(codec, monkeypatch):
    pytest.importorskip("triton")
    from hf_models import tiny_model
    from kvstrata.codecs import triton_dequant
    from kvstrata.integrations.hf import TieredCache, enable

    model = enable(tiny_model("llama", "sdpa", head_dim=64).to(CUDA))
    ids = _prompt(1024)
    kw = dict(block_size=64, max_tokens=1536, resident_fraction=0.25, host_budget="8MiB",
              host_codec=codec)  # fmt: skip
    calls = []
    real = triton_dequant.decode

    def counted(*args):
        ran = real(*args)
        calls.append(ran)
        return ran

    monkeypatch.setattr(triton_dequant, "decode", counted)
    fused = _greedy(model, ids, TieredCache(model.config, **kw), 64)
    assert calls and all(calls)  # the kernel decoded every staged chunk
    monkeypatch.setattr(triton_dequant, "decode", lambda *args: False)
    unfused = _greedy(model, ids, TieredCache(model.config, **kw), 64)
    assert torch.equal(fused, unfused)


def test_bf16_within_tolerance():
    """bf16: teacher-forced logits close to DynamicCache's, argmax nearly always equal."""
    from transformers import DynamicCache

    from hf_models import tiny_model
    from kvstrata.integrations.hf import TieredCache, enable

    model = tiny_model("llama", "sdpa").to(CUDA, torch.bfloat16)
    ids = _prompt(1024)
    forced = _prompt(64, seed=2)

    @torch.no_grad()
    def logits(cache):
        model(input_ids=ids, cache=cache)
        return torch.cat(
            [model(input_ids=forced[:, i : i + 1], cache=cache).logits[0] for i in range(64)]
        ).float()

    ref = logits(DynamicCache(config=model.config))
    enable(model)
    try:
        got = logits(
            TieredCache(
                model.config,
                block_size=64,
                max_tokens=1536,
                resident_fraction=0.1,
                host_budget="8MiB",
                dtype=torch.bfloat16,
            )  # fmt: skip
        )
    finally:
        model.set_attn_implementation("sdpa")
    scale = ref.abs().max()
    assert (got - ref).abs().max() <= 0.03 * scale
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.95


def test_device_kv_peak_is_budget_plus_staging_and_flat_from_4k_to_64k():
    import argparse

    from kvstrata.bench import gpu

    args = argparse.Namespace(
        quick=True, contexts=None, memory_contexts="4k,16k,64k", codecs=None, steps=8,
        repeats=None, copy_mib=None, fractions="1", dtype="fp32",
    )  # fmt: skip
    s = gpu._settings(args)
    s["memory_budget_tokens"], s["memory_staging_tokens"] = 2048, 2048
    model = gpu._model(s, CUDA)
    out = gpu.memory(model, CUDA, s, lambda ctx: gpu._prefill(model, ctx), gpu.Budget(600))
    rows = out["rows"]
    assert [r["context"] for r in rows] == [4096, 16384, 65536]
    assert out["flat"], [r["peak_kv_bytes"] for r in rows]
    for r in rows:
        assert r["host_blocks"] > 0
        # arenas + staging, plus a few MiB of transients (partials, logits, rounding)
        assert r["peak_kv_bytes"] <= r["budget_plus_staging_bytes"] + (8 << 20), r
    assert rows[-1]["dynamic_cache_kv_bytes"] > 4 * rows[-1]["peak_kv_bytes"]


def test_no_host_synchronisation_in_the_staging_path():
    """Decode steps with 90 % of the KV staged from the host: no op in kvstrata's
    staging / transfer / attention / dequant code blocks the host on the device."""
    from hf_models import tiny_model
    from kvstrata.integrations.hf import TieredCache, enable

    model = enable(tiny_model("llama", "sdpa").to(CUDA))
    cache = TieredCache(
        model.config, block_size=64, max_tokens=1536, resident_fraction=0.1, host_budget="8MiB"
    )
    ids = _prompt(1024)
    watched = ("staging.py", "device_streams.py", "device_attention.py", "triton_dequant.py",
               "transfer.py")  # fmt: skip
    with torch.no_grad():
        model(input_ids=ids, cache=cache)
        tok = ids[:, -1:]
        for _ in range(3):  # warm-up: kernel selection checks run once
            tok = model(input_ids=tok, cache=cache).logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(8):
                    tok = model(input_ids=tok, cache=cache).logits[:, -1:].argmax(-1)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    model.set_attn_implementation("sdpa")
    ours = [w for w in caught if w.filename.endswith(watched)]
    assert not ours, [f"{w.filename}:{w.lineno}: {w.message}" for w in ours]
