"""Several KV cache groups (vLLM's hybrid allocator: sliding-window and full layers).

Without an engine: a manager and a worker driven here store and load three groups of
one request — a full one, a sliding one whose window starts inside a chunk, a short
one (fewer layers) — each under its own key.

With vLLM (CPU, fp32, greedy), each engine run once per module:

    gemma       a Gemma-2-style model (3 groups: sliding, sliding + padding, full),
                lossless host + disk: P1, P2 cold, then again from kvstrata's host
                tier, then a new engine on the same disk                  -> (a), (b)
    starved     the same model with a host tier of 10 blocks (a prompt has 13): some
                groups stored, not all: no hit at all                       -> (c)
    mistral     every layer sliding (one group), 64-token kvstrata blocks (two vLLM
                blocks) and an 80-token window: windows start inside a block -> (d)
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tests.integrations.vllm.tiny import (
    GEMMA_LAYERS,
    HEAD_DIM,
    NUM_KV_HEADS,
    VLLM_BLOCK,
    Rig,
    build_tiny_gemma2,
    build_tiny_mistral_window,
    prompts,
)
from vllm.v1.kv_offload.base import make_offload_key

from kvstrata.core.errors import UnsupportedModelError
from kvstrata.integrations.vllm.backend_plan import VllmSide, make_plan
from kvstrata.integrations.vllm.options import VllmOptions
from kvstrata.model.geometry import KVGeometry

P1, P2 = prompts(2, 300, seed=3)  # 9 full vLLM blocks each (288 tokens) + 12 computed
LOSSLESS = {"host_budget": "8MiB", "disk_budget": "32MiB"}


def _geometry(layers: int) -> dict[str, Any]:
    return {"model_type": "llama", "num_hidden_layers": layers, "num_attention_heads": 4,
            "num_key_value_heads": NUM_KV_HEADS, "hidden_size": 128, "head_dim": HEAD_DIM,
            "dtype": "float32"}  # fmt: skip


# -- without an engine --------------------------------------------------------------------
def test_each_group_is_stored_and_loaded_under_its_own_key() -> None:
    rig = Rig(_geometry(5), {"host_budget": "4MiB", "model_key": "tiny", "block_size": 64},
              group_layers=(2, 2, 1), blocks_per_chunk=2)  # fmt: skip
    h0, h1 = b"\x01" * 32, b"\x02" * 32
    keys = [make_offload_key(h0, 0), make_offload_key(h1, 0), make_offload_key(h1, 1),
            make_offload_key(h1, 2)]  # fmt: skip
    # group 0 (full): chunks 0-1 = blocks 1-4; group 1 (sliding): chunk 1 without its
    # first block (out of the window): block 6 at request index 3; group 2 (one layer):
    # chunk 1 = blocks 8, 9
    stored_from = [([1, 2, 3, 4], 0), ([6], 3), ([8, 9], 2)]
    try:
        assert rig.store_blocks(keys, stored_from) == keys
        assert rig.lookup([make_offload_key(h0, 1), make_offload_key(h0, 2)]) == ["MISS"] * 2
        pages = rig.pages[0]
        before = [p.clone() for p in pages]
        for p in pages:
            p.zero_()
        # group 1 loaded whole (from its first block: the one it never had) into 10, 11
        rig.load_blocks(keys, [([12, 13, 14, 15], 0), ([10, 11], 2), ([5, 7], 2)])
        for layer in range(2):
            assert torch.equal(pages[layer][12:16], before[layer][1:5])  # group 0, both layers
            assert torch.equal(pages[layer][11], before[layer][6])  # group 1
            assert not pages[layer][10].any()  # stored as zeros, never read by vLLM
        assert torch.equal(pages[0][[5, 7]], before[0][[8, 9]])  # group 2: its one layer
        assert not pages[1][[5, 7]].any()  # the padding layer is not written back
        assert rig.store.stats()["stored"] == 4 and rig.store.stats()["hits_host"] == 4
    finally:
        rig.close()


def test_groups_name_the_namespace_and_must_match_the_config() -> None:
    options = VllmOptions.from_extra_config({"host_budget": "1MiB"})
    page = NUM_KV_HEADS * 2 * VLLM_BLOCK * HEAD_DIM * 4

    def plan(groups: tuple[int, ...], layers: int) -> Any:
        side = VllmSide(model_name="m", dtype="float32", num_layers=max(groups),
                        tokens_per_block=VLLM_BLOCK, blocks_per_chunk=1,
                        worker_kv_bytes_per_block=max(groups) * page, engine_id="e",
                        group_layers=groups)  # fmt: skip
        return make_plan(options, side, KVGeometry.from_hf_config(_geometry(layers)))

    grouped, single = plan((2, 2), 4), plan((4,), 4)
    assert grouped.layout.num_layers == 2 and grouped.namespace["groups"] == [2, 2]
    assert "groups" not in single.namespace and grouped.digest != single.digest
    with pytest.raises(UnsupportedModelError, match="3 KV cache groups of 2/2/2 layers"):
        plan((2, 2, 2), 5)


# -- with vLLM ------------------------------------------------------------------------------
FULL = 9 * VLLM_BLOCK  # vLLM keeps the last prompt token to compute: 288 of 300 tokens


@pytest.fixture(scope="module")
def gemma(engine_factory: Any, tmp_path_factory: Any) -> dict[str, Any]:
    model = build_tiny_gemma2(tmp_path_factory.mktemp("tiny-gemma2"), seed=0)
    disk = tmp_path_factory.mktemp("disk")
    engine = engine_factory(model, disk_dir=str(disk), **LOSSLESS)
    try:
        cold, cold_cached = engine.generate([P1, P2])
        settled = engine.settle()
        warm, warm_cached = engine.generate([P1, P2])
    finally:
        stats = engine.close()
    restarted = engine_factory(model, disk_dir=str(disk), **LOSSLESS)
    try:
        again, again_cached = restarted.generate([P1, P2])
    finally:
        restart_stats = restarted.close()
    return {
        "cold": cold, "cold_cached": cold_cached, "settled": settled, "warm": warm,
        "warm_cached": warm_cached, "stats": stats, "again": again,
        "again_cached": again_cached, "restart_stats": restart_stats,
    }  # fmt: skip


@pytest.mark.slow
def test_a_sliding_and_full_model_reloads_every_group_with_identical_tokens(gemma: dict) -> None:
    assert gemma["cold_cached"] == [0, 0]
    assert gemma["warm_cached"] == [FULL, FULL] and gemma["warm"] == gemma["cold"]
    stats = gemma["stats"]
    # one block layout for every group: 2 layers (the largest group), K and V
    assert stats["bytes_per_block"]["raw"] == 2 * 2 * NUM_KV_HEADS * VLLM_BLOCK * HEAD_DIM * 4
    # a kvstrata block is one chunk of one group: the full group's 9, and what vLLM keeps
    # of each sliding group (its window at the end of the prompt: 2 blocks of 32 tokens)
    sliding = GEMMA_LAYERS.count("sliding_attention")
    per_prompt = 9 + 2 * -(-sliding // 2)  # 2 sliding groups (one of them padded)
    assert stats["stored"] == 2 * per_prompt
    assert stats["hits_host"] == 2 * per_prompt  # every group the requests need, each hit


@pytest.mark.slow
def test_a_restarted_sliding_and_full_model_reloads_from_disk(gemma: dict) -> None:
    stats = gemma["restart_stats"]
    assert stats["found_on_disk"] == gemma["settled"]["disk_written"] == gemma["stats"]["stored"]
    assert gemma["again_cached"] == [FULL, FULL] and gemma["again"] == gemma["cold"]
    # every stored block of every group read back from disk (batched) and hit, none
    # refused or left out (vLLM's lookups may also ask for blocks of a sliding group's
    # prefix that were never stored: those are the misses)
    assert stats["hits_disk"] == stats["found_on_disk"] == stats["disk_read_blocks"]
    assert stats["corrupt_refused"] == stats["disk_no_room"] == 0


@pytest.fixture(scope="module")
def starved(engine_factory: Any, tmp_path_factory: Any) -> dict[str, Any]:
    """The Gemma-2-style model with a host tier of 10 blocks: a prompt's 13 do not fit,
    so some of its groups are stored and not the others."""
    model = build_tiny_gemma2(tmp_path_factory.mktemp("tiny-gemma2-starved"), seed=0)
    block = 2 * 2 * NUM_KV_HEADS * VLLM_BLOCK * HEAD_DIM * 4
    engine = engine_factory(model, host_budget=str(10 * block))
    try:
        cold, cold_cached = engine.generate([P1])
        stored = engine.stats()["stored"]
        warm, warm_cached = engine.generate([P1])
    finally:
        stats = engine.close()
    return {"cold": cold, "cold_cached": cold_cached, "warm": warm, "warm_cached": warm_cached,
            "stored": stored, "stats": stats}  # fmt: skip


@pytest.mark.slow
def test_a_prefix_some_groups_lack_is_no_hit_at_all(starved: dict) -> None:
    assert starved["stored"] == 10 and starved["stats"]["store_refused"] >= 3
    assert starved["stats"]["hits_host"] > 0  # some groups' blocks were there ...
    assert starved["warm_cached"] == [0]  # ... but not every group's: nothing loaded
    assert starved["warm"] == starved["cold"]


@pytest.fixture(scope="module")
def mistral(engine_factory: Any, tmp_path_factory: Any) -> dict[str, Any]:
    model = build_tiny_mistral_window(tmp_path_factory.mktemp("tiny-mistral"), seed=0)
    engine = engine_factory(model, host_budget="8MiB", block_size=2 * VLLM_BLOCK)
    try:
        cold, cold_cached = engine.generate([P1, P2])
        warm, warm_cached = engine.generate([P1, P2])
    finally:
        stats = engine.close()
    return {"cold": cold, "cold_cached": cold_cached, "warm": warm, "warm_cached": warm_cached,
            "stats": stats}  # fmt: skip


@pytest.mark.slow
def test_a_mistral_window_reloads_windows_that_start_inside_a_block(mistral: dict) -> None:
    assert mistral["cold_cached"] == [0, 0]
    # 4 whole 64-token blocks of the prompt; the window needs the last 2 of them
    assert mistral["warm_cached"] == [4 * 64, 4 * 64] and mistral["warm"] == mistral["cold"]
    stats = mistral["stats"]
    assert stats["stored"] == stats["hits_host"] == 2 * 2
