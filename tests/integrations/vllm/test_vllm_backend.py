"""kvstrata as vLLM's offloading backend, end to end on a tiny Llama (CPU, fp32, greedy).

Each fixture below is one engine's life (an LLM whose scheduler and worker run in new
processes), run once and shared by the tests that read it:

    first_run    lossless host + disk: P1, then P2 stored; both again after vLLM's
                 prefix cache is reset                                       -> (a)
    restart      a new engine on the same disk_dir, one of P2's blocks
                 corrupted on disk beforehand                                -> (b), (c)
    control      a new engine on that disk after every stored V was zeroed
                 (checksums rewritten: the blocks are valid, their values wrong)   -> (e)
    lossy        host int8, disk int4-g32 + zstd, 64-token kvstrata blocks (two vLLM
                 blocks each)                                                -> (d)
    evicting     a host tier of 4 blocks (a prompt has 9) and a disk tier of 8: both
                 evict while P1, P2, then P1 and P2 again run                -> (f)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tests.integrations.vllm.tiny import HEAD_DIM, NUM_KV_HEADS, NUM_LAYERS, VLLM_BLOCK, prompts

pytestmark = pytest.mark.slow

P1, P2 = prompts(2, 300)  # 9 full vLLM blocks each (288 tokens) + 12 computed
FULL = 9 * VLLM_BLOCK
LOSSLESS = {"host_budget": "8MiB", "disk_budget": "32MiB"}


@pytest.fixture(scope="module")
def first_run(tiny_llama: Path, engine_factory: Any, tmp_path_factory: Any) -> dict[str, Any]:
    disk = tmp_path_factory.mktemp("disk")
    engine = engine_factory(tiny_llama, disk_dir=str(disk), **LOSSLESS)
    try:
        cold1, cached1 = engine.generate([P1])  # P1's blocks take disk slots 0-8
        engine.settle()
        cold2, cached2 = engine.generate([P2])  # P2's: slots 9-17
        settled = engine.settle()
        warm, warm_cached = engine.generate([P1, P2])
    finally:
        stats = engine.close()
    return {
        "disk": disk,
        "cold": cold1 + cold2,
        "cold_cached": cached1 + cached2,
        "settled": settled,
        "warm": warm,
        "warm_cached": warm_cached,
        "stats": stats,
        "startup_s": engine.startup_s,
    }


def test_a_second_run_is_loaded_from_kvstrata_with_identical_tokens(first_run: dict) -> None:
    assert first_run["cold_cached"] == [0, 0]
    assert first_run["warm"] == first_run["cold"]
    assert first_run["warm_cached"] == [FULL, FULL]  # vLLM's own cache was reset
    stats = first_run["stats"]
    assert stats["hits_host"] == 18 and stats["hits_disk"] == 0
    assert first_run["settled"]["disk_written"] == 18  # written through to disk
    assert (
        stats["bytes_per_block"]["host"]
        == stats["bytes_per_block"]["raw"]
        == (NUM_LAYERS * 2 * NUM_KV_HEADS * VLLM_BLOCK * HEAD_DIM * 4)
    )


def _disk_dir(run: dict) -> Path:
    (path,) = [p for p in run["disk"].iterdir() if p.is_dir()]  # one namespace
    assert Path(run["stats"]["disk_path"]) == path
    return path


@pytest.fixture(scope="module")
def restart(tiny_llama: Path, engine_factory: Any, first_run: dict) -> dict[str, Any]:
    arena = _disk_dir(first_run) / "blocks.bin"
    slot_bytes = arena.stat().st_size // first_run["stats"]["slots"]["disk"]
    with open(arena, "r+b") as f:  # flip 8 bytes inside slot 13: one of P2's blocks
        f.seek(13 * slot_bytes + 1000)
        data = f.read(8)
        f.seek(13 * slot_bytes + 1000)
        f.write(bytes(b ^ 0xFF for b in data))
    engine = engine_factory(tiny_llama, disk_dir=str(first_run["disk"]), **LOSSLESS)
    try:
        p1, p1_cached = engine.generate([P1])
        p1_stats = engine.stats()
        p2, p2_cached = engine.generate([P2])
    finally:
        stats = engine.close()
    return {"p1": p1, "p1_cached": p1_cached, "p1_stats": p1_stats,
            "p2": p2, "p2_cached": p2_cached, "stats": stats}  # fmt: skip


def test_b_a_new_process_hits_the_disk_tier(first_run: dict, restart: dict) -> None:
    assert restart["p1"] == first_run["cold"][:1]
    assert restart["p1_cached"] == [FULL]
    assert restart["p1_stats"]["hits_disk"] == 9
    assert restart["stats"]["found_on_disk"] == 18  # the index survived the restart


def test_c_a_corrupt_block_is_a_miss_and_recomputed(first_run: dict, restart: dict) -> None:
    assert restart["p2"] == first_run["cold"][1:]  # identical tokens, vLLM did not fail
    assert restart["stats"]["corrupt_refused"] == 1
    (cached,) = restart["p2_cached"]
    assert cached < FULL and cached % VLLM_BLOCK == 0  # hits up to the corrupt block


@pytest.fixture(scope="module")
def control(tiny_llama: Path, engine_factory: Any, first_run: dict, restart: dict) -> dict:
    from kvstrata.core.layout import BlockLayout
    from kvstrata.tiers.disk import DiskTier

    layout = BlockLayout(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, VLLM_BLOCK, torch.float32)
    with DiskTier(layout, first_run["stats"]["slots"]["disk"], _disk_dir(first_run)) as disk:
        keyed = disk.keyed_slots()
        slots = sorted(keyed)
        k = torch.empty(layout.raw_shape("k", len(slots)))
        v = torch.empty(layout.raw_shape("v", len(slots)))
        disk.read_blocks(slots, k, v)
        disk.write_blocks(slots, k, torch.zeros_like(v))  # valid checksums, V = 0
        disk.put_keys([(s, keyed[s], []) for s in slots])
    engine = engine_factory(tiny_llama, disk_dir=str(first_run["disk"]), **LOSSLESS)
    try:
        tokens, cached = engine.generate([P1])
    finally:
        stats = engine.close()
    return {"tokens": tokens, "cached": cached, "stats": stats}


def test_e_negative_control_the_loaded_kv_is_used(first_run: dict, control: dict) -> None:
    assert control["cached"] == [FULL] and control["stats"]["hits_disk"] == 9
    assert control["tokens"] != first_run["cold"][:1]  # same hits, other values: other tokens


@pytest.fixture(scope="module")
def lossy(tiny_llama: Path, engine_factory: Any, tmp_path_factory: Any) -> dict[str, Any]:
    disk = tmp_path_factory.mktemp("disk-lossy")
    engine = engine_factory(
        tiny_llama,
        host_budget="8MiB",
        host_codec="int8",
        disk_dir=str(disk),
        disk_budget="32MiB",
        disk_codec="int4-g32",
        disk_compress=True,
        block_size=2 * VLLM_BLOCK,
    )
    try:
        cold, _ = engine.generate([P1, P2])
        engine.settle()
        warm, warm_cached = engine.generate([P1, P2])
    finally:
        stats = engine.close()
    return {"cold": cold, "warm": warm, "warm_cached": warm_cached, "stats": stats}


def test_d_lossy_host_codec_runs_and_reports_agreement(
    lossy: dict, first_run: dict, record_property: Any, capsys: Any
) -> None:
    assert lossy["cold"] == first_run["cold"]  # nothing loaded: exact
    chunks = FULL // (2 * VLLM_BLOCK)  # whole 64-token blocks of a prompt: 4
    assert lossy["warm_cached"] == [chunks * 2 * VLLM_BLOCK] * 2
    assert lossy["stats"]["hits_host"] == 2 * chunks and lossy["stats"]["block_tokens"] == 64
    per_prompt = zip(lossy["cold"], lossy["warm"], strict=True)
    pairs = [(a, b) for ref, out in per_prompt for a, b in zip(ref, out, strict=True)]
    agreement = sum(a == b for a, b in pairs) / len(pairs)
    sizes = lossy["stats"]["bytes_per_block"]
    assert sizes["host"] < sizes["raw"] and sizes["disk"] < sizes["host"]
    record_property("int8_token_agreement", agreement)
    with capsys.disabled():
        print(
            f"\n[vllm int8 host codec] greedy token agreement with the exact run: "
            f"{agreement:.1%} ({len(pairs)} tokens); bytes per block raw {sizes['raw']}, "
            f"host int8 {sizes['host']}, disk int4-g32+zstd {sizes['disk']:.0f} (64 tokens)"
        )


@pytest.fixture(scope="module")
def evicting(tiny_llama: Path, engine_factory: Any, tmp_path_factory: Any) -> dict[str, Any]:
    block = NUM_LAYERS * 2 * NUM_KV_HEADS * VLLM_BLOCK * HEAD_DIM * 4  # lossless: 32 KiB
    disk = tmp_path_factory.mktemp("disk-evicting")
    engine = engine_factory(
        tiny_llama, disk_dir=str(disk), host_budget=f"{4 * block}", disk_budget=f"{8 * block}"
    )
    try:
        p1, _ = engine.generate([P1])  # stores the first 4 of its 9 blocks (all that fit)
        engine.settle()
        p2, _ = engine.generate([P2])  # P2's evict P1's host copies (on disk: 8 of 8)
        engine.settle()
        warm1, cached1 = engine.generate([P1])  # 4 disk hits; its new blocks evict P2's
        engine.settle()
        warm2, cached2 = engine.generate([P2])  # gone from both tiers: recomputed
    finally:
        stats = engine.close()
    return {"cold": p1 + p2, "warm": warm1 + warm2, "warm_cached": cached1 + cached2,
            "stats": stats}  # fmt: skip


def test_f_eviction_on_both_tiers_keeps_the_tokens_exact(evicting: dict, first_run: dict) -> None:
    assert evicting["cold"] == first_run["cold"] and evicting["warm"] == first_run["cold"]
    assert evicting["warm_cached"] == [4 * VLLM_BLOCK, 0]
    stats = evicting["stats"]
    assert stats["slots"] == {"host": 4, "disk": 8} and stats["hits_disk"] == 4
    assert stats["evicted_host"] > 0 and stats["evicted_disk"] > 0 and stats["store_refused"] > 0
    assert stats["disk_degraded"] == 0 and stats["disk_read_timeouts"] == 0
