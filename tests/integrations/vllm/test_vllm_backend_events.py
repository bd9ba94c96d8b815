"""The vLLM backend's KV events name the tier each copy is on: a stored block is
announced on CPU (the host tier) when vLLM's store completes, on STORAGE (LOCAL) once
its write-through to the disk tier has finished and on STORAGE (REMOTE) once the shared
remote tier's server stored it; a copy leaving a tier is a removal on that tier's
medium."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.integrations.vllm.tiny import HEAD_DIM, NUM_KV_HEADS, Rig
from vllm.v1.kv_offload.base import Locality, Medium, make_offload_key

from kvstrata.bench._redis import REDIS_SERVER, RedisServer

GEOMETRY = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": NUM_KV_HEADS, "hidden_size": 128, "head_dim": HEAD_DIM,
            "dtype": "float32"}  # fmt: skip
KEYS = [make_offload_key(bytes([i]) * 32, 0) for i in range(3)]


def test_stored_on_cpu_then_on_storage_and_removed_per_medium(tmp_path: Path) -> None:
    extra = {"host_budget": "1MiB", "disk_dir": str(tmp_path), "disk_budget": "4MiB",
             "model_key": "tiny"}  # fmt: skip
    rig = Rig(GEOMETRY, extra, group_layers=(2,))
    rig.manager.events = []  # what enable_events=True sets up
    try:
        assert rig.store_blocks(KEYS, [([1, 2, 3], 0)]) == KEYS
        rig.store.drain()  # the write-through finished
        rig.manager.on_schedule_end(None)
        events = list(rig.manager.take_events())
        stored = [(e.medium, e.locality, set(e.keys)) for e in events if not e.removed]
        assert stored[0] == (Medium.CPU, None, set(KEYS))
        assert (Medium.STORAGE, Locality.LOCAL, set(KEYS)) in stored
        storage = next(e for e in events if e.medium is Medium.STORAGE)
        assert storage.removal_expected  # vLLM keeps the hashes for its removal
        assert not [e for e in events if e.removed]
        # the host copies go (the disk ones stay): CPU removals only
        entries = [rig.store.index.get(rig.plan.key(k, 0)) for k in KEYS]
        for entry in entries:
            rig.store._drop(entry, "host")
        rig.manager.on_schedule_end(None)
        removed = [(e.medium, set(e.keys)) for e in rig.manager.take_events() if e.removed]
        assert removed == [(Medium.CPU, set(KEYS))]
        for entry in entries:
            rig.store._drop(entry, "disk")
        rig.manager.on_schedule_end(None)
        removed = [
            (e.medium, e.locality, set(e.keys)) for e in rig.manager.take_events() if e.removed
        ]
        assert removed == [(Medium.STORAGE, Locality.LOCAL, set(KEYS))]
    finally:
        rig.close()


@pytest.mark.skipif(REDIS_SERVER is None, reason="needs redis-server")
def test_blocks_the_shared_tier_stored_are_announced_remote(tmp_path: Path) -> None:
    """Once the server stored a block written behind, it is announced on STORAGE with
    locality REMOTE (every engine sharing the server reaches it), and only then."""
    srv = RedisServer(tmp_path).start()
    extra = {"host_budget": "1MiB", "remote_url": srv.url, "model_key": "tiny"}
    rig = Rig(GEOMETRY, extra, group_layers=(2,))
    rig.manager.events = []
    try:
        assert rig.store_blocks(KEYS, [([1, 2, 3], 0)]) == KEYS
        assert rig.store.remote.flush()  # the writer thread sent them and heard back
        rig.manager.on_schedule_end(None)
        events = list(rig.manager.take_events())
        stored = [(e.medium, e.locality, set(e.keys)) for e in events if not e.removed]
        assert stored == [
            (Medium.CPU, None, set(KEYS)),
            (Medium.STORAGE, Locality.REMOTE, set(KEYS)),
        ]
        rig.manager.on_schedule_end(None)  # announced once
        assert not list(rig.manager.take_events())
    finally:
        rig.close()
        srv.stop()
