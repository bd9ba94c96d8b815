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
  flat from 4k to 64k tokens; a 16k-token prefill without [Hq, Q, Q] scores;
- a device -> host write read back on the CPU at once (the non-blocking copy race);
- no host synchronisation from kvstrata's code in decode steps beyond a stated
  per-step budget, the staged attention returning before the device has run it,
  and staged loads hidden behind compute slower than the link.
"""

from __future__ import annotations

import math
import time
import traceback
import warnings
from pathlib import Path

import pytest
import torch

import kvstrata

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
    from kvstrata.core.layout import BlockLayout
    from kvstrata.platform.streams import CudaStreams, streams_for
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
    from kvstrata.attention.device import kernel_name, lse_attention
    from kvstrata.attention.math import math_attention, merge_all

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
    ref_out, ref_lse = math_attention(q.float(), k.float(), v.float(), scale, None, None)
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
    from kvstrata.core.layout import BlockLayout

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
    from kvstrata.core.layout import BlockLayout
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
        assert t["num_waits"] > 0 and t["num_stalled"] <= t["num_waits"]
        assert t["bytes_per_link"].get("host->device", 0) > 0
        assert t["transfer_s"] > 0  # the copy stream's loads were timed by its events


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

    from kvstrata.bench.gpu import sections as gpu_sections
    from kvstrata.bench.gpu import setup as gpu_setup

    args = argparse.Namespace(
        quick=True, contexts=None, memory_contexts="4k,16k,64k", codecs=None, steps=8,
        repeats=None, copy_mib=None, fractions="1", dtype="fp32",
    )  # fmt: skip
    s = gpu_setup.settings(args)
    s["memory_budget_tokens"], s["memory_staging_tokens"] = 2048, 2048
    model = gpu_setup.build_model(s, CUDA)
    out = gpu_sections.memory(
        model, CUDA, s, lambda ctx: gpu_setup.prefill(model, ctx), gpu_setup.Budget(600)
    )
    rows = out["rows"]
    assert [r["context"] for r in rows] == [4096, 16384, 65536]
    assert out["flat"], [r["peak_kv_bytes"] for r in rows]
    for r in rows:
        assert r["host_blocks"] > 0
        # arenas + staging, plus at most 1 MiB of transients (partials, logits, one
        # demoted block in flight): a stray buffer of even a quarter of the budget fails
        assert r["peak_kv_bytes"] <= r["budget_plus_staging_bytes"] + (1 << 20), r
        assert r["budget_plus_staging_bytes"] > 4 * (1 << 20)
    assert rows[-1]["dynamic_cache_kv_bytes"] > 4 * rows[-1]["peak_kv_bytes"]


def test_long_prefill_runs_in_memory_linear_in_the_prompt():
    """A 16k-token prompt through TieredCache: this step's causal attention runs in an
    LSE-returning fused kernel, not the math path (whose [Hq, Q, Q] fp32 scores alone
    would be 4 GiB here, and 16 GiB at 32k with 4 heads), and gives DynamicCache's
    logits."""
    from transformers import DynamicCache

    from hf_models import tiny_model
    from kvstrata.integrations.hf import TieredCache, enable

    n = 16384
    model = tiny_model("llama", "sdpa", max_position_embeddings=2 * n).to(CUDA)
    ids = _prompt(n)
    with torch.no_grad():
        ref = model(input_ids=ids, cache=DynamicCache(config=model.config), logits_to_keep=1)
        ref = ref.logits[0, -1]
        enable(model)
        try:
            cache = TieredCache(model.config, block_size=64, max_tokens=n + 128)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            got = model(input_ids=ids, cache=cache, logits_to_keep=1).logits[0, -1]
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
        finally:
            model.set_attn_implementation("sdpa")
    heads = model.config.num_attention_heads
    scores = heads * n * n * 4
    assert peak < scores // 8, (peak, scores)  # activations, KV and kernels: ~100 MiB
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3)
    assert int(got.argmax()) == int(ref.argmax())


# -- no host synchronisation --------------------------------------------------------------------
KVSTRATA_DIR = str(Path(kvstrata.__file__).resolve().parent)

# The synchronisations kvstrata's own code may make per decode step (innermost kvstrata
# frame -> at most this many per step), each needed by the HF integration, not the
# staging path: the token ids read once per step to name blocks for prefix reuse, and
# the step's write rows (built on the CPU by the block manager) copied to the device.
SYNCS_PER_STEP = {
    "integrations/hf/cache.py:_update": 1,
    "attention/writes.py:write_plan": 2,
}


def _kvstrata_syncs(fn) -> dict[str, list[str]]:
    """Run fn() with CUDA's sync debug mode on: the synchronising calls whose Python
    stack passes through the kvstrata package, by innermost kvstrata frame
    ("path/in/kvstrata.py:function") -> their messages."""
    hits: dict[str, list[str]] = {}

    def show(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack() if f.filename.startswith(KVSTRATA_DIR)]
        if frames and "synchroniz" in str(message).lower():
            f = frames[-1]
            site = f"{Path(f.filename).relative_to(KVSTRATA_DIR).as_posix()}:{f.name}"
            hits.setdefault(site, []).append(f"line {f.lineno}: {message}")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return hits


def _staged_decode_model():
    """The tiny Llama decoding with 90 % of its KV staged from the host (after a warm-up:
    the kernel selection checks run once)."""
    from hf_models import tiny_model
    from kvstrata.integrations.hf import TieredCache, enable

    model = enable(tiny_model("llama", "sdpa").to(CUDA))
    cache = TieredCache(
        model.config, block_size=64, max_tokens=1536, resident_fraction=0.1, host_budget="8MiB"
    )
    ids = _prompt(1024)
    with torch.no_grad():
        model(input_ids=ids, cache=cache)
        tok = ids[:, -1:]
        for _ in range(3):
            tok = model(input_ids=tok, cache=cache).logits[:, -1:].argmax(-1)
    torch.cuda.synchronize()
    return model, cache, tok


def test_no_host_synchronisation_in_decode_steps_beyond_the_budget():
    """Decode steps with 90 % of the KV staged from the host: no op reached through
    kvstrata's code (any module: staging, transfer, tiers, runtime, attention, the HF
    integration, ...) blocks the host on the device, except the stated per-step
    budget (SYNCS_PER_STEP)."""
    model, cache, tok = _staged_decode_model()
    steps = 8

    def decode():
        nonlocal tok
        with torch.no_grad():
            for _ in range(steps):
                tok = model(input_ids=tok, cache=cache).logits[:, -1:].argmax(-1)

    try:
        hits = _kvstrata_syncs(decode)
    finally:
        model.set_attn_implementation("sdpa")
    over = {
        site: msgs for site, msgs in hits.items() if len(msgs) > SYNCS_PER_STEP.get(site, 0) * steps
    }
    assert not over, over
    assert cache.stats()["tiers"]["host"]["used_blocks"] > 0


def test_staged_attention_returns_before_the_device_has_run_it():
    """The staged attention of one layer (chunks loaded from the pinned host arena on the
    copy stream, attended, merged) is only enqueued: with the compute stream held up by
    a long sleep, the host is back before the sleep ends — and no kvstrata code
    synchronised on the way."""
    from kvstrata.attention.math import merge_all, pack_gqa

    model, cache, _ = _staged_decode_model()
    model.set_attn_implementation("sdpa")
    runtime = cache.store.runtime
    seq = cache.seq_ids[0]
    total = cache.store.num_tokens(seq)
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    q = torch.randn(cfg.num_attention_heads, 1, head_dim, device=CUDA)
    qp = pack_gqa(q, cfg.num_key_value_heads)
    out = {}

    def staged():
        parts = runtime._history_partials(0, seq, qp, 0, total, head_dim**-0.5, None)
        out["merged"] = merge_all(parts)

    plan = runtime.reads.read_plan(cache.store.layer_map[0][0], seq, 0, total, False)
    assert plan.has_staged  # the host runs come through the stager
    slept = torch.cuda.Event()
    torch.cuda._sleep(4_000_000_000)  # ~2 s of GPU clock cycles on the compute stream
    slept.record()
    start = time.perf_counter()
    hits = _kvstrata_syncs(staged)
    host_s = time.perf_counter() - start
    still_sleeping = not slept.query()
    torch.cuda.synchronize()
    assert not hits, hits
    assert still_sleeping, f"the host waited for the device ({host_s:.3f} s)"
    assert torch.isfinite(out["merged"][0]).all()


def test_staged_loads_hide_behind_compute_slower_than_the_link():
    """Chunks staged from the pinned host arena while each chunk's "attention" (a sleep
    on the compute stream, ~10 ms) takes longer than the next chunk's copy: every load
    but the first is hidden (done before the compute stream waits for it)."""
    from kvstrata.attention.staging import Stager
    from kvstrata.blocks.runs import Run
    from kvstrata.core.layout import BlockLayout
    from kvstrata.tiers.memory import HostTier

    lay = BlockLayout(2, 8, 128, 64)
    slots = 64  # 4096 tokens: 8 chunks of 512 (1 MiB of K and V per chunk and layer)
    host = HostTier(lay, slots)
    assert host.pinned
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(lay.raw_shape("k", slots), generator=gen)
    v = torch.randn(lay.raw_shape("v", slots), generator=gen)
    host.write_blocks(list(range(slots)), k, v)
    stager = Stager({"host": host}, lay, CUDA, 1024, "device")
    try:
        assert stager.guards is not None and stager.tokens_per_buffer == 512
        run = Run("host", 0, slots, 0, slots * 64)
        sums = []
        for sk, sv in stager.parts(0, run, 0, slots * 64):
            torch.cuda._sleep(20_000_000)  # the attention of this chunk, slower than its copy
            sums.append(sk.float().sum() + sv.float().sum())
        torch.cuda.synchronize()
        expected = k[0].float().sum() + v[0].float().sum()
        torch.testing.assert_close(torch.stack(sums).sum().cpu(), expected, rtol=1e-4, atol=1e-2)
        stats = stager.engine.stats
    finally:
        stager.close()
    assert stats.num_waits == 8
    assert stats.num_stalled <= 1, stats  # the first chunk had nothing to hide behind
    assert stats.hidden_fraction >= 7 / 8
