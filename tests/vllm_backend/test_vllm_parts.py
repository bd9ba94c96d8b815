"""The backend's parts without an engine: settings, plan and namespaces, the index's
eviction order, vLLM's page layout, and the scheduler-side store over real tiers."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstrata.errors import ConfigError, UnsupportedModelError
from kvstrata.geometry import KVGeometry
from kvstrata.integrations.vllm import kv_transfer_config
from kvstrata.integrations.vllm.index import BlockIndex
from kvstrata.integrations.vllm.options import VllmOptions
from kvstrata.integrations.vllm.pages import Pages
from kvstrata.integrations.vllm.plan import BackendPlan, VllmSide, make_plan
from kvstrata.integrations.vllm.region import SharedHostTier
from kvstrata.integrations.vllm.store import HIT, MISS, PENDING, OffloadStore

L, H, D, N = 2, 2, 32, 32
GEOMETRY = KVGeometry.from_hf_config(
    {"model_type": "llama", "num_hidden_layers": L, "num_attention_heads": 4,
     "num_key_value_heads": H, "hidden_size": 128, "head_dim": D, "dtype": "float32"}
)  # fmt: skip
PAGE_BYTES = H * 2 * N * D * 4


def side(model: str = "m", blocks_per_chunk: int = 1, **kw: Any) -> VllmSide:
    fields = dict(model_name=model, dtype="float32", num_layers=L, tokens_per_block=N,
                  blocks_per_chunk=blocks_per_chunk, worker_kv_bytes_per_block=L * PAGE_BYTES,
                  engine_id=f"test-{uuid.uuid4().hex}")  # fmt: skip
    return VllmSide(**{**fields, **kw})


def plan_for(tmp_path: Path | None = None, **extra: Any) -> tuple[VllmOptions, BackendPlan]:
    extra.setdefault("host_budget", "1MiB")
    if tmp_path is not None:
        extra.setdefault("disk_dir", str(tmp_path))
        extra.setdefault("disk_budget", "4MiB")
    options = VllmOptions.from_extra_config(extra)
    return options, make_plan(options, side(), GEOMETRY)


# -- settings -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"host_budget": "1GiB", "host_budgte": 1}, "did you mean 'host_budget'"),
        ({"host_budget": "1GiB", "device_budget": "1GiB"}, "device_budget='1GiB' is invalid"),
        ({}, "host_budget=0 is invalid: the vLLM backend moves every block"),
        ({"host_budget": "1GiB", "host_codec": "int9"}, "host_codec='int9' is invalid"),
        ({"host_budget": "1GiB", "disk_dir": "/tmp/x"}, "disk_budget=0 is invalid"),
        ({"host_budget": "1GiB", "block_size": 6.5}, "block_size=6.5 is invalid"),
        ({"host_budget": "1GiB", "model_key": ""}, "model_key='' is invalid"),
        ({"host_budget": "1GiB", "canonical_layout": True}, "canonical_layout=True is invalid"),
    ],
)
def test_settings_are_refused_in_one_line(extra: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        kv_transfer_config(**extra)
    assert "\n" not in str(info.value)


def test_settings_pass_vllm_keys_and_default_to_lru() -> None:
    config = kv_transfer_config(host_budget="1GiB", offload_prompt_only=False)
    assert config["kv_connector"] == "OffloadingConnector"
    extra = config["kv_connector_extra_config"]
    assert extra["spec_module_path"] == "kvstrata.integrations.vllm"
    assert VllmOptions.from_extra_config(extra).cache.policy == "lru"


# -- plan -----------------------------------------------------------------------------------
def test_plan_sizes_and_layout(tmp_path: Path) -> None:
    _, plan = plan_for(tmp_path, host_codec="int8", disk_codec="int4-g32")
    assert plan.layout.block_size == N and plan.page_shape == (H, 2, N, D)
    assert plan.host_slots == (1 << 20) // plan.host_codec.block_nbytes(plan.layout)
    assert Path(plan.disk_path).parent == tmp_path
    assert plan.key(b"x" * 36) == plan.key(b"x" * 36) != plan.key(b"y" * 36)


def _model_dir(path: Path, fill: int) -> str:
    path.mkdir()
    (path / "model.safetensors").write_bytes(bytes([fill]) * 1000)
    return str(path)


def test_namespaces_separate_models_weights_and_codecs(tmp_path: Path) -> None:
    a, b = _model_dir(tmp_path / "a", 1), _model_dir(tmp_path / "b", 2)
    options = VllmOptions.from_extra_config({"host_budget": "1MiB"})
    digest = lambda model, opts=options: make_plan(opts, side(model), GEOMETRY).digest  # noqa: E731
    assert digest(a) == digest(a) != digest(b)
    Path(b, "model.safetensors").write_bytes(bytes([1]) * 1000)  # same weights, other path
    assert digest(a) != digest(b)  # the model name is part of the key
    shared = VllmOptions.from_extra_config({"host_budget": "1MiB", "model_key": "tiny"})
    assert digest(a, shared) == digest(b, shared)  # model_key names the weights
    int8 = VllmOptions.from_extra_config({"host_budget": "1MiB", "host_codec": "int8"})
    assert digest(a, int8) != digest(a)


def test_plan_refuses_what_it_cannot_read() -> None:
    options = VllmOptions.from_extra_config({"host_budget": "1MiB", "host_codec": "int8"})
    with pytest.raises(UnsupportedModelError, match="do not match the model's config"):
        make_plan(options, side(worker_kv_bytes_per_block=L * PAGE_BYTES * 2), GEOMETRY)
    with pytest.raises(UnsupportedModelError, match="one worker per engine"):
        make_plan(options, side(world_size=2), GEOMETRY)
    with pytest.raises(ConfigError, match="host_codec='int8' is invalid: a lossy codec needs"):
        make_plan(options, side(page_layout="opaque"), GEOMETRY)
    with pytest.raises(ConfigError, match="dtype='fp8_e4m3' is invalid"):
        make_plan(options, side(dtype="fp8_e4m3"), GEOMETRY)


# -- index ----------------------------------------------------------------------------------
def test_lru_evicts_the_least_recently_used_unpinned_copy() -> None:
    index = BlockIndex("lru")
    entries = [index.add(bytes([i]), None) for i in range(5)]
    for e in entries:
        e.host_slot, e.host_ready = e.seq, True
        index.refresh(e)
    index.touch(entries[0])
    entries[1].pins = 1
    index.refresh(entries[1])
    order = [e.key[0] for e in index.victims("host", 5, protect={bytes([3])})]
    assert order == [2, 4, 0]


def test_window_evicts_in_store_order_and_lfu_by_count() -> None:
    window, lfu = BlockIndex("window"), BlockIndex("lfu")
    for index in (window, lfu):
        for i in range(3):
            e = index.add(bytes([i]), None)
            e.disk_slot, e.disk_ready = i, True
            index.refresh(e)
    for _ in range(2):
        window.touch(window.get(b"\x00"))
        lfu.touch(lfu.get(b"\x00"))
    lfu.touch(lfu.get(b"\x02"))
    assert [e.key[0] for e in window.victims("disk", 3, set())] == [0, 1, 2]
    assert [e.key[0] for e in lfu.victims("disk", 3, set())] == [1, 2, 0]


# -- pages ----------------------------------------------------------------------------------
@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_pages_round_trip_through_the_cpu_layout(blocks_per_chunk: int) -> None:
    _, plan = plan_for()
    if blocks_per_chunk > 1:
        options = VllmOptions.from_extra_config({"host_budget": "1MiB", "block_size": 64})
        plan = make_plan(options, side(blocks_per_chunk=2), GEOMETRY)
    num_blocks = 8
    torch.manual_seed(0)
    typed = [torch.randn(num_blocks, H, 2, N, D) for _ in range(L)]
    pages = Pages([t.view(num_blocks, -1).view(torch.int8) for t in typed], plan)
    ids = torch.tensor([5, 2, 7, 0])
    k = torch.empty(plan.layout.raw_shape("k", 4 // blocks_per_chunk))
    v = torch.empty_like(k)
    pages.gather(ids, k, v)
    # K of layer 1, head 0, token 3 of the second vLLM block (id 2) in the CPU page layout
    assert torch.equal(k[1, 0, N + 3], typed[1][2, 0, 0, 3])
    assert torch.equal(v[0, 1, 2 * N + 5], typed[0][7, 1, 1, 5])
    out = [torch.zeros(num_blocks, H, 2, N, D) for _ in range(L)]
    back = Pages([t.view(num_blocks, -1).view(torch.int8) for t in out], plan)
    back.scatter(ids[1:], k, v, skip=1)  # a load that starts at the chunk's second block
    for t, o in zip(typed, out, strict=True):
        assert torch.equal(o[ids[1:]], t[ids[1:]]) and not o[ids[0]].any()


# -- store ----------------------------------------------------------------------------------
class Worker:
    """The worker's side of the shared host arena (what worker.py writes and reads)."""

    def __init__(self, plan: BackendPlan) -> None:
        self.host = SharedHostTier(
            plan.layout, plan.host_slots, plan.host_codec, plan.region_path, plan.digest
        )
        self.layout = plan.layout

    def write(self, slots: list[int], seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        k = torch.randn(self.layout.raw_shape("k", len(slots)))
        self.host.write_blocks(slots, k, -k)
        return k

    def read(self, slots: list[int]) -> torch.Tensor:
        k = torch.empty(self.layout.raw_shape("k", len(slots)))
        self.host.read_blocks(slots, k, torch.empty_like(k))
        return k


def _store(tmp_path: Path, **extra: Any) -> tuple[OffloadStore, Worker]:
    options, plan = plan_for(tmp_path, **extra)
    worker = Worker(plan)
    return OffloadStore(plan, options), worker


def _put(store: OffloadStore, worker: Worker, keys: list[bytes], seed: int) -> torch.Tensor:
    to_store, slots = store.prepare_store(keys, keys)
    assert to_store == keys
    assert store.lookup(keys[0]) == PENDING  # stored, not yet complete
    data = worker.write(slots, seed)
    store.complete_store(keys, success=True)
    store.drain()
    return data


def test_store_hits_pins_and_writes_through(tmp_path: Path) -> None:
    store, worker = _store(tmp_path, host_budget=f"{3 * 32768}")  # three host slots
    try:
        data = _put(store, worker, [b"a", b"b"], seed=0)
        assert store.lookup(b"a") == HIT and store.lookup(b"zz") == MISS
        slots = store.prepare_load([b"a"])
        store.end_step()  # the lease ends, the load still pins "a"
        assert store.prepare_store([b"c", b"d"], [b"c", b"d"]) is not None  # evicts "b"
        assert store.index.get(b"b").host_slot is None and store.index.get(b"b").disk_ready
        assert torch.equal(worker.read(slots), data[:, :, :N])  # "a" stayed put
        store.complete_store([b"c", b"d"], success=False)
        store.complete_load([b"a"])
        assert store.lookup(b"b") == HIT and store.source(b"b") == "disk"  # read back, verified
        store.end_step()
        assert torch.equal(worker.read(store.prepare_load([b"b"])), data[:, :, N:])
        assert store.stats()["hits_disk"] == 1 and store.stats()["disk_written"] == 2
    finally:
        store.close()


def test_store_refuses_a_corrupt_disk_block_and_reopens_its_index(tmp_path: Path) -> None:
    store, worker = _store(tmp_path)
    keys = [bytes([i]) for i in range(4)]
    _put(store, worker, keys, seed=1)
    store.close()
    store, worker = _store(tmp_path)  # a restarted scheduler: an empty host arena
    try:
        assert store.stats()["found_on_disk"] == 4
        disk = store.disk.tier
        slot = store.index.get(keys[2]).disk_slot
        with open(disk.path, "r+b") as f:
            f.seek(slot * disk.slot_bytes + 123)
            f.write(b"\xff\x00\xff")
        assert [store.lookup(k) for k in keys] == [HIT, HIT, MISS, HIT]
        assert store.stats()["corrupt_refused"] == 1 and store.index.get(keys[2]) is None
    finally:
        store.close()
