"""Disk hits read back in batches (integrations/vllm/disk_reads.py): a prefix's blocks
only on disk answer RETRY, are read in one batch at the step's end and hit at the next
lookup; a corrupt block is refused, counted and recomputed. First the scheduler's
store over real tiers, then vLLM end to end (a restart on a zstd-compressed disk)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tests.integrations.vllm.test_vllm_parts import N, _put, _store, read_back
from tests.integrations.vllm.tiny import VLLM_BLOCK, prompts

from kvstrata.integrations.vllm.remote import RETRY
from kvstrata.integrations.vllm.store import HIT, MISS, OffloadStore
from kvstrata.tiers.movement import copy_blocks

BLOCK = 32768  # bytes of one raw block of the parts tests' layout
LOSSLESS_ZSTD = {"disk_compress": True}
INT4_ZSTD = {"host_codec": "int8", "disk_codec": "int4-g32", "disk_compress": True}


def _restarted(
    tmp_path: Path, keys: list[bytes], host_budget: str = "1MiB", **extra: Any
) -> tuple[OffloadStore, Any, Any]:
    """A store whose blocks `keys` are on disk only (written, then a restart with a
    host tier of `host_budget`)."""
    store, worker = _store(tmp_path, **extra)
    data = _put(store, worker, keys, seed=7)
    store.close()
    store, worker = _store(tmp_path, host_budget=host_budget, **extra)
    assert all(store.index.get(k).host_slot is None for k in keys)
    return store, worker, data


def _corrupt(store: OffloadStore, key: bytes) -> None:
    disk = store.disk.tier
    with open(disk.path, "r+b") as f:  # inside the block's first layer (a frame, if packed)
        f.seek(store.index.get(key).disk_slot * disk.slot_bytes + 200)
        f.write(b"\xff\x00\xff\x00")


@pytest.mark.parametrize("extra", [{}, LOSSLESS_ZSTD, INT4_ZSTD], ids=["none", "zstd", "int4"])
def test_a_prefix_on_disk_is_read_back_in_one_batch(tmp_path: Path, extra: dict) -> None:
    keys = [bytes([i]) for i in range(8)]
    store, worker, data = _restarted(tmp_path, keys, **extra)
    try:
        assert [store.lookup(k) for k in keys] == [RETRY] * 8  # queued, nothing read yet
        assert store.stats()["disk_read_batches"] == 0
        store.end_step()
        store.drain()
        assert [store.lookup(k) for k in keys] == [HIT] * 8
        assert {store.source(k) for k in keys} == {"disk"}
        stats = store.stats()
        assert (stats["disk_read_batches"], stats["disk_read_blocks"]) == (1, 8)
        assert (stats["hits_disk"], stats["disk_retries"], stats["misses"]) == (8, 8, 0)
        loaded = worker.read(store.prepare_load(keys))
        if not extra.get("host_codec"):  # lossless: the values written
            assert torch.equal(loaded, data)
            return
        # lossy: the batch decoded exactly as a block read alone (the former path)
        alone = store.host.allocate(8)
        disk_slots = [store.index.get(k).disk_slot for k in keys]

        def one_at_a_time() -> None:
            for disk_slot, host_slot in zip(disk_slots, alone, strict=True):
                copy_blocks(
                    store.host.layout, store.disk.tier, [disk_slot], store.host, [host_slot]
                )

        store.disk.call(one_at_a_time)
        assert torch.equal(worker.read(alone), loaded)
    finally:
        store.close()


@pytest.mark.parametrize("extra", [{}, LOSSLESS_ZSTD], ids=["none", "zstd"])
def test_a_corrupt_block_in_a_batch_is_refused_and_the_rest_served(
    tmp_path: Path, extra: dict
) -> None:
    keys = [bytes([i]) for i in range(6)]
    store, worker, data = _restarted(tmp_path, keys, **extra)
    try:
        _corrupt(store, keys[1])
        _corrupt(store, keys[4])
        assert read_back(store, keys) == [HIT, MISS, HIT, HIT, MISS, HIT]
        stats = store.stats()
        assert stats["corrupt_refused"] == 2 and stats["hits_disk"] == 4
        assert (stats["disk_read_batches"], stats["disk_read_blocks"]) == (1, 6)
        assert store.index.get(keys[1]) is None and store.index.get(keys[4]) is None
        good = [0, 2, 3, 5]
        loaded = worker.read(store.prepare_load([keys[i] for i in good]))
        assert torch.equal(loaded, torch.cat([data[:, :, i * N : (i + 1) * N] for i in good], 2))
    finally:
        store.close()


def test_what_the_host_tier_cannot_take_is_a_miss(tmp_path: Path) -> None:
    keys = [bytes([i]) for i in range(5)]
    store, worker, data = _restarted(tmp_path, keys, host_budget=f"{3 * BLOCK}")
    try:
        # the first three fit: read; the other two answer MISS next step (vLLM stops there)
        assert read_back(store, keys) == [HIT, HIT, HIT, MISS, MISS]
        stats = store.stats()
        assert (stats["disk_read_blocks"], stats["disk_no_room"], stats["hits_disk"]) == (3, 2, 3)
        assert torch.equal(worker.read(store.prepare_load(keys[:3])), data[:, :, : 3 * N])
        assert store.index.get(keys[3]).disk_ready  # still on disk
    finally:
        store.close()


def test_blocks_read_in_stay_pinned_until_looked_up_or_a_step_has_seen_them(tmp_path: Path) -> None:
    keys = [bytes([i]) for i in range(3)]
    store, _, _ = _restarted(tmp_path, keys)
    try:
        assert [store.lookup(k) for k in keys] == [RETRY] * 3
        store.end_step()
        store.drain()  # landed: pinned, so nothing evicts them before the request sees them
        assert [store.index.get(k).pins for k in keys] == [1, 1, 1]
        assert store.lookup(keys[0]) == HIT  # the landing pin becomes the step's lease
        store.end_step()  # a whole step's lookups have seen the others: still pinned
        assert [store.index.get(k).pins for k in keys] == [0, 1, 1]
        store.end_step()
        assert [store.index.get(k).pins for k in keys] == [0, 0, 0]  # unclaimed ones expire
        assert store.lookup(keys[1]) == HIT and store.source(keys[1]) == "host"
    finally:
        store.close()


# -- vLLM end to end ---------------------------------------------------------------------------
P1, P2 = prompts(2, 300, seed=3)  # 9 full vLLM blocks each (288 tokens) + 12 computed
FULL = 9 * VLLM_BLOCK
ZSTD = {"host_budget": "8MiB", "disk_budget": "32MiB", "disk_compress": True}


@pytest.fixture(scope="module")
def restarted(tiny_llama: Path, engine_factory: Any, tmp_path_factory: Any) -> dict[str, Any]:
    """P1 then P2 stored by one engine (disk slots 0-8, 9-17), one block of P2's
    corrupted on disk, then both asked of a new engine (its host tier is empty)."""
    disk = tmp_path_factory.mktemp("disk-batched")
    engine = engine_factory(tiny_llama, disk_dir=str(disk), **ZSTD)
    try:
        cold1, _ = engine.generate([P1])
        engine.settle()
        cold2, _ = engine.generate([P2])
        first = engine.settle()
    finally:
        engine.close()
    (namespace,) = [p for p in disk.iterdir() if p.is_dir()]
    arena = namespace / "blocks.bin"
    slot_bytes = arena.stat().st_size // first["slots"]["disk"]
    with open(arena, "r+b") as f:  # inside slot 13's first layer frame: P2's 5th block
        f.seek(13 * slot_bytes + 200)
        f.write(b"\xff\x00\xff\x00")
    engine = engine_factory(tiny_llama, disk_dir=str(disk), **ZSTD)
    try:
        warm1, cached1 = engine.generate([P1])
        after1 = engine.stats()
        warm2, cached2 = engine.generate([P2])
    finally:
        stats = engine.close()
    return {"cold": cold1 + cold2, "warm": warm1 + warm2, "cached": cached1 + cached2,
            "after1": after1, "stats": stats}  # fmt: skip


@pytest.mark.slow
def test_a_disk_hit_after_a_restart_is_one_batch_with_identical_tokens(restarted: dict) -> None:
    assert restarted["warm"][0] == restarted["cold"][0]
    assert restarted["cached"][0] == FULL
    s = restarted["after1"]
    assert s["found_on_disk"] == 18 and s["hits_disk"] == 9 and s["hits_host"] == 0
    assert (s["disk_read_batches"], s["disk_read_blocks"]) == (1, 9)  # the whole prefix
    assert s["disk_retries"] >= 9 and s["corrupt_refused"] == 0


@pytest.mark.slow
def test_a_corrupt_disk_block_is_refused_counted_and_recomputed(restarted: dict) -> None:
    assert restarted["warm"][1] == restarted["cold"][1]  # vLLM recomputed it, no failure
    cached = restarted["cached"][1]
    assert cached < FULL and cached % VLLM_BLOCK == 0  # hits up to the corrupt block
    s = restarted["stats"]
    assert s["corrupt_refused"] == 1 and s["hits_disk"] == 9 + cached // VLLM_BLOCK
    assert (s["disk_read_batches"], s["disk_read_blocks"]) == (2, 18)
    assert s["disk_degraded"] == 0 and s["disk_read_timeouts"] == 0
