"""The backend's parts without an engine: settings, plan and namespaces, the model
identity, the shared host arena's roles, the index's eviction order, vLLM's page layout,
and the scheduler-side store over real tiers (disk failures and slow disks included)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from tests.integrations.vllm.tiny import read_back

from kvstrata.core.errors import ConfigError, KvstrataError, TierIOError, UnsupportedModelError
from kvstrata.core.layout import BlockLayout
from kvstrata.integrations.vllm import disk_reads, kv_transfer_config
from kvstrata.integrations.vllm.backend_plan import (
    DIGEST_CACHE,
    BackendPlan,
    VllmSide,
    make_plan,
    model_identity,
    weights_identity,
)
from kvstrata.integrations.vllm.index import BlockIndex
from kvstrata.integrations.vllm.options import VllmOptions
from kvstrata.integrations.vllm.pages import Pages
from kvstrata.integrations.vllm.region import HEADER_BYTES, MAGIC
from kvstrata.integrations.vllm.remote import RETRY
from kvstrata.integrations.vllm.store import HIT, MISS, PENDING, OffloadStore
from kvstrata.model.geometry import KVGeometry
from kvstrata.tiers.disk import DiskTier

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
        (
            {
                "host_budget": "1GiB",
                "disk_dir": "/tmp/x",
                "disk_budget": "1MiB",
                "disk_delta": True,
            },
            "disk_delta=True is invalid: it codes blocks for disk compression",
        ),
        ({"host_budget": "1GiB", "block_size": 6.5}, "block_size=6.5 is invalid"),
        ({"host_budget": "1GiB", "model_key": ""}, "model_key='' is invalid"),
        ({"host_budget": "1GiB", "canonical_layout": True}, "canonical_layout=True is invalid"),
        ({"host_budget": "1GiB", "blocks_per_chunk": 2.7}, "blocks_per_chunk=2.7 is invalid"),
        ({"host_budget": "1GiB", "blocks_per_chunk": 0}, "blocks_per_chunk=0 is invalid"),
        ({"host_budget": "1GiB", "blocks_per_chunk": 2, "block_size": 64}, "not both"),
        ({"host_budget": "1GiB", "offload_prompt_only": "false"}, "offload_prompt_only='false'"),
        ({"host_budget": "1GiB", "self_describing_kv_events": 1}, "true or false"),
        ({"host_budget": "1GiB", "disk_codec": "int8"}, "disk_codec='int8' is invalid: set disk"),
        ({"host_budget": "1GiB", "stats_file": "/no/such/dir/s.json"}, "does not exist"),
        ({"host_budget": "1GiB", "remote_url": "http://h"}, "remote_url='http://h' is invalid"),
        ({"host_budget": "1GiB", "remote_codec": "int8"}, "remote_codec='int8' is invalid: set"),
    ],
)
def test_settings_are_refused_in_one_line(extra: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        kv_transfer_config(**extra)
    assert "\n" not in str(info.value)


def test_remote_settings_are_parsed() -> None:
    options = VllmOptions.from_extra_config(
        {"host_budget": "1GiB", "remote_url": "redis://h:6379/0", "remote_ttl": 60}
    )
    assert (options.cache.remote_url, options.cache.remote_ttl) == ("redis://h:6379/0", 60)
    lossy = {"host_budget": "1GiB", "remote_url": "redis://h", "remote_codec": "int8"}
    with pytest.raises(ConfigError, match="remote_codec='int8' is invalid: a lossy codec"):
        make_plan(VllmOptions.from_extra_config(lossy), side(page_layout="opaque"), GEOMETRY)


def test_settings_pass_vllm_keys_and_default_to_lru() -> None:
    config = kv_transfer_config(host_budget="1GiB", offload_prompt_only=False, blocks_per_chunk=2)
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


def _named(model: str, options: VllmOptions, vllm_config: Any = None) -> str:
    """The namespace digest the scheduler ends with for `model` (worker's identity)."""
    identity = model_identity(options, model, vllm_config)
    return make_plan(options, side(model), GEOMETRY).named(identity).digest


def test_namespaces_separate_models_weights_and_codecs(tmp_path: Path) -> None:
    a, b = _model_dir(tmp_path / "a", 1), _model_dir(tmp_path / "b", 2)
    disk = {"host_budget": "1MiB", "disk_dir": str(tmp_path / "disk"), "disk_budget": "1MiB"}
    options = VllmOptions.from_extra_config(disk)
    assert _named(a, options) == _named(a, options) != _named(b, options)
    Path(b, "model.safetensors").write_bytes(bytes([1]) * 1000)  # same weights, other path
    assert _named(a, options) != _named(b, options)  # the model name is part of the key
    shared = VllmOptions.from_extra_config({**disk, "model_key": "tiny"})
    assert _named(a, shared) == _named(b, shared)  # model_key names the weights
    int8 = VllmOptions.from_extra_config({**disk, "host_codec": "int8"})
    assert _named(a, int8) != _named(a, options)


def fake_vllm_config(hf: dict | None = None, **model: Any) -> Any:
    """What model_identity reads of vLLM's VllmConfig."""
    config = {"model_type": "llama", "rope_theta": 10000.0, "_name_or_path": "x", **(hf or {})}
    fields = dict(revision=None, quantization=None, quantization_config=None,
                  dtype=torch.float32, hf_overrides={},
                  hf_config=SimpleNamespace(to_dict=lambda: dict(config)))  # fmt: skip
    return SimpleNamespace(
        model_config=SimpleNamespace(**{**fields, **model}),
        load_config=SimpleNamespace(download_dir=None),
    )


def test_identity_names_revision_quantization_rope_overrides_and_dtype(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "m", 1)
    options = VllmOptions.from_extra_config(
        {"host_budget": "1MiB", "disk_dir": str(tmp_path / "disk"), "disk_budget": "1MiB"}
    )
    base = _named(model, options, fake_vllm_config())
    assert base == _named(model, options, fake_vllm_config(hf={"_name_or_path": "elsewhere"}))
    variants = [
        fake_vllm_config(revision="v2"),
        fake_vllm_config(quantization="fp8"),
        fake_vllm_config(hf={"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
        fake_vllm_config(hf={"rope_theta": 500000.0}),
        fake_vllm_config(hf_overrides={"rope_theta": 500000.0}),
        fake_vllm_config(dtype=torch.bfloat16),
    ]
    digests = {_named(model, options, c) for c in variants}
    assert base not in digests and len(digests) == len(variants)
    keyed = VllmOptions.from_extra_config({**options_fields(options), "model_key": "m"})
    identity = model_identity(keyed, model, fake_vllm_config(quantization="fp8"))
    assert identity["quantization"] == "fp8" and "weights" not in identity  # model_key names them


def options_fields(options: VllmOptions) -> dict[str, Any]:
    cache = options.cache
    return {"host_budget": cache.host_budget, "disk_dir": cache.disk_dir,
            "disk_budget": cache.disk_budget}  # fmt: skip


def test_weights_are_hashed_whole_once(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    weights = model / "model-00001.safetensors"
    data = bytearray(b"\1" * (1 << 18))
    weights.write_bytes(data)
    cache = tmp_path / "disk" / DIGEST_CACHE
    first = weights_identity(str(model), cache_file=cache)
    data[1 << 17] ^= 0xFF  # a byte in the middle: 128 KiB from either end
    weights.write_bytes(data)
    os.utime(weights, ns=(time.time_ns(), time.time_ns() + 10**9))
    second = weights_identity(str(model), cache_file=cache)
    assert first != second and str(weights.resolve()) in json.loads(cache.read_text())
    # the digest comes from the cache while size and mtime are unchanged (no re-read)
    st = weights.stat()
    data[1 << 17] ^= 0xFF
    weights.write_bytes(data)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights_identity(str(model), cache_file=cache) == second


def test_hub_weights_follow_the_revision(tmp_path: Path) -> None:
    repo = tmp_path / "hub" / "models--org--tiny"
    for ref, commit in (("main", "a" * 40), ("v2", "b" * 40)):
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
        (repo / "snapshots" / commit).mkdir(parents=True)
        (repo / "snapshots" / commit / "config.json").write_text("{}")
    hub = str(tmp_path / "hub")
    assert weights_identity("org/tiny", None, hub) == "hub:" + "a" * 40
    assert weights_identity("org/tiny", "v2", hub) == "hub:" + "b" * 40
    assert weights_identity("org/tiny", "c" * 40, hub) == ""
    options = VllmOptions.from_extra_config(
        {"host_budget": "1MiB", "disk_dir": str(tmp_path / "disk"), "disk_budget": "1MiB"}
    )
    with pytest.raises(ConfigError, match="model_key=None is invalid: kvstrata cannot identify"):
        model_identity(options, "org/unknown", fake_vllm_config())
    host_only = VllmOptions.from_extra_config({"host_budget": "1MiB"})
    assert "weights" not in model_identity(host_only, "org/unknown", fake_vllm_config())


def test_plan_refuses_what_it_cannot_read() -> None:
    options = VllmOptions.from_extra_config({"host_budget": "1MiB", "host_codec": "int8"})
    with pytest.raises(UnsupportedModelError, match="do not match the model's config"):
        make_plan(options, side(worker_kv_bytes_per_block=L * PAGE_BYTES * 2), GEOMETRY)
    with pytest.raises(UnsupportedModelError, match="runs tensor parallel only; this engine has 2"):
        make_plan(options, side(world_size=2), GEOMETRY)  # pipeline parallel
    with pytest.raises(ConfigError, match="host_codec='int8' is invalid: a lossy codec needs"):
        make_plan(options, side(page_layout="opaque"), GEOMETRY)
    with pytest.raises(ConfigError, match="kv_cache_dtype='nvfp4' is invalid"):
        make_plan(options, side(dtype="nvfp4"), GEOMETRY)  # fp8 is read: test_vllm_fp8.py


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
    # K of layer 1, head 0, token 3 of the second vLLM block (id 2): K is column-major
    assert torch.equal(k[1, 0, N + 3], typed[1][2, 0, 0].reshape(D, N)[:, 3])
    assert torch.equal(v[0, 1, 2 * N + 5], typed[0][7, 1, 1, 5])
    out = [torch.zeros(num_blocks, H, 2, N, D) for _ in range(L)]
    back = Pages([t.view(num_blocks, -1).view(torch.int8) for t in out], plan)
    back.scatter(ids[1:], k, v, skip=1)  # a load that starts at the chunk's second block
    for t, o in zip(typed, out, strict=True):
        assert torch.equal(o[ids[1:]], t[ids[1:]]) and not o[ids[0]].any()


# -- store ----------------------------------------------------------------------------------
class Worker:
    """The worker's side of the shared host arena (what worker.py writes and reads)."""

    def __init__(self, plan: BackendPlan, identity: dict | None = None) -> None:
        self.host = plan.host_tier(create=True, identity=identity or {})
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


@pytest.mark.parametrize(
    ("disk", "codec"),
    [({}, "none"), ({"disk_compress": True, "disk_delta": True}, "none+delta+zstd")],
)
def test_store_hits_pins_and_writes_through(tmp_path: Path, disk: dict, codec: str) -> None:
    store, worker = _store(tmp_path, host_budget=f"{3 * 32768}", **disk)  # three host slots
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
        assert read_back(store, [b"b"]) == [HIT] and store.source(b"b") == "disk"  # verified
        store.end_step()
        assert torch.equal(worker.read(store.prepare_load([b"b"])), data[:, :, N:])
        assert store.stats()["hits_disk"] == 1 and store.stats()["disk_written"] == 2
        assert store.stats()["codecs"]["disk"] == codec
        # disk_delta reaches the disk tier: its frames are the delta-coded kind (KVZ2)
        assert (b"KVZ2" in store.disk.tier.path.read_bytes()) == bool(disk)
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
        assert read_back(store, keys) == [HIT, HIT, MISS, HIT]
        assert store.stats()["corrupt_refused"] == 1 and store.index.get(keys[2]) is None
    finally:
        store.close()


def test_partial_store_when_the_host_tier_cannot_take_the_batch(tmp_path: Path) -> None:
    store, worker = _store(tmp_path, host_budget=f"{3 * 32768}")  # three host slots
    try:
        keys = [bytes([i]) for i in range(5)]
        to_store, slots = store.prepare_store(keys, keys)
        assert to_store == keys[:3] and len(slots) == 3  # the prefix that fits
        assert store.prepare_store(keys[3:], keys[3:]) is None  # every slot is being stored
        worker.write(slots, seed=0)
        store.complete_store(to_store, success=True)
        assert store.stats()["store_refused"] == 4
    finally:
        store.close()


# -- the shared host arena --------------------------------------------------------------------
def _rewrite_header(path: str, **fields: Any) -> None:
    with open(path, "r+b") as f:
        raw = f.read(HEADER_BYTES).split(b"\0", 1)[0]
        header = {**json.loads(raw[len(MAGIC) :]), **fields}
        line = MAGIC + json.dumps(header).encode() + b"\n"
        f.seek(0)
        f.write(line.ljust(HEADER_BYTES, b"\0"))


def test_a_stale_arena_file_is_never_adopted(tmp_path: Path) -> None:
    options, plan = plan_for(tmp_path)
    path = plan.region_path
    stale = Worker(plan)  # a crashed start's worker: its file stays behind, then it dies
    stale.write([0], seed=5)
    dead = subprocess.Popen(["true"])
    dead.wait()
    _rewrite_header(path, pid=dead.pid)
    with pytest.raises(KvstrataError, match="stale host arena .* never adopts it"):
        OffloadStore(plan, options)  # the manager alone: refused, not adopted
    _rewrite_header(path, pid=os.getpid(), nonce="not-this-process-nonce")
    with pytest.raises(KvstrataError, match="stale host arena"):
        OffloadStore(plan, options)  # this pid ("uni" executor), another start's nonce
    stale_inode = os.stat(path).st_ino
    other = os.path.join(os.path.dirname(path), f"kvstrata-vllm-crashed-{uuid.uuid4().hex}.host")
    with open(other, "wb") as f:  # another engine_id's crashed start
        f.write(MAGIC + json.dumps({"pid": dead.pid}).encode() + b"\n")
    worker = Worker(plan)  # the worker always comes first: it replaces the stale file
    assert os.stat(path).st_ino != stale_inode and not os.path.exists(other)
    assert not worker.read([0]).any()  # a fresh arena, not the stale one's blocks
    store = OffloadStore(plan, options)
    try:
        assert not os.path.exists(path)  # the manager removed the name once mapped
        data = _put(store, worker, [b"a"], seed=1)
        k = torch.empty_like(data)
        store.host.read_blocks(store.prepare_load([b"a"]), k, torch.empty_like(k))
        assert torch.equal(k, data)  # one arena: what the worker wrote, the manager reads
    finally:
        store.close()


def test_the_manager_needs_the_worker_and_reads_its_identity(tmp_path: Path) -> None:
    options, plan = plan_for(tmp_path)
    with pytest.raises(KvstrataError, match="no host arena at .* worker creates it"):
        OffloadStore(plan, options)
    Worker(plan, identity={"weights": "files:abc", "quantization": "fp8"})
    store = OffloadStore(plan, options)
    try:
        named = plan.named({"weights": "files:abc", "quantization": "fp8"})
        assert store.plan.digest == named.digest != plan.digest
        assert store.plan.disk_path == named.disk_path != plan.disk_path
    finally:
        store.close()


def test_an_arena_larger_than_shared_memory_is_a_config_error(monkeypatch: Any) -> None:
    _, plan = plan_for()

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(
        ConfigError, match=r"host_budget='1.00 MiB' is invalid: .* does not fit"
    ) as info:
        Worker(plan)
    assert "\n" not in str(info.value) and "free)" in str(info.value)
    assert not os.path.exists(plan.region_path)


# -- a slow or failing disk -------------------------------------------------------------------
def _returns_while_stuck(call: Any, gate: threading.Event) -> None:
    """`call()` finishes while the disk thread is held at `gate` (a call that waited on
    the disk would only return once the gate opens: the bound is a hang guard, not a
    speed target)."""
    runner = threading.Thread(target=call, daemon=True)
    runner.start()
    runner.join(60)
    assert not runner.is_alive() and not gate.is_set()


def test_disk_frees_never_wait_and_a_slow_read_is_a_miss(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(disk_reads, "READ_TIMEOUT_S", 0.2)
    block = 32768
    store, worker = _store(tmp_path, host_budget=f"{6 * block}", disk_budget=f"{4 * block}")
    gate = threading.Event()
    try:
        a, b, c, d, e, f, g, h = (bytes([i]) for i in range(8))
        data = _put(store, worker, [a, b, c, d], seed=2)  # host 4/6, disk 4/4
        inside = threading.Event()

        def stuck() -> None:
            inside.set()
            gate.wait()

        store.disk.submit(stuck)  # the disk thread is stuck (a slow disk)
        # ... really inside it: a read queued ahead of it would otherwise still run first
        assert inside.wait(10)
        to_store, slots = store.prepare_store([e, f], [e, f])
        worker.write(slots, seed=3)
        # evicts two disk copies: their frees are queued behind the stuck call, and the
        # call returns while the disk thread is still stuck (it never waits on them)
        _returns_while_stuck(lambda: store.complete_store([e, f], success=True), gate)
        assert store.index.get(a).disk_slot is None and store.index.get(c).disk_ready
        store.touch([a, b])
        store.prepare_store([g, h], [g, h])  # evicts the host copies of c, d (kept on disk)
        assert store.index.get(c).host_slot is None
        assert store.lookup(c) == RETRY  # queued for the step's batched read
        # its read waits behind the stuck call: the step does not
        _returns_while_stuck(store.end_step, gate)
        assert store.lookup(c) == RETRY
        time.sleep(0.3)  # past READ_TIMEOUT_S
        assert store.lookup(c) == MISS and store.stats()["disk_read_timeouts"] == 1
        assert store.lookup(d) == MISS  # nothing is queued behind a stuck read
        assert store.lookup(c) == MISS and store.stats()["disk_read_timeouts"] == 1
        gate.set()
        assert store.drain()
        assert store.lookup(c) == HIT and store.source(c) == "disk"  # the read landed
        assert torch.equal(worker.read(store.prepare_load([c])), data[:, :, 2 * N : 3 * N])
    finally:
        gate.set()
        store.close()


def test_a_failing_disk_free_degrades_to_host_only(tmp_path: Path) -> None:
    store, worker = _store(tmp_path)
    keys = [bytes([i]) for i in range(3)]
    _put(store, worker, keys, seed=4)
    store.close()
    store, worker = _store(tmp_path)  # restarted: the blocks are on disk only
    try:
        disk = store.disk.tier
        with open(disk.path, "r+b") as f:  # corrupt the second block
            f.seek(store.index.get(keys[1]).disk_slot * disk.slot_bytes + 123)
            f.write(b"\xff\x00\xff")

        def broken(slots: list[int]) -> None:
            raise TierIOError("EIO while dropping an index row")

        disk.free = broken
        assert read_back(store, [keys[1]]) == [MISS]  # corrupt: dropped; its free fails
        store.drain()
        assert store.degraded and store.stats()["disk_degraded"] == 1
        assert store.lookup(keys[0]) == MISS  # the disk copies are forgotten
        _put(store, worker, [b"new"], seed=5)  # host only from now on
        assert store.lookup(b"new") == HIT and store.index.get(b"new").disk_slot is None
        assert store.stats()["disk_written"] == 0
    finally:
        store.close()


# -- one disk budget per disk_dir -------------------------------------------------------------
def test_other_namespaces_are_removed_to_fit_the_disk_budget(tmp_path: Path) -> None:
    layout = BlockLayout(L, H, D, N, torch.float32)
    old = tmp_path / "old-model-0123456789abcdef"
    DiskTier(layout, 8, old).close()
    foreign = tmp_path / "notes-0123456789abcdef"  # a namespace's name, other files
    foreign.mkdir()
    (foreign / "readme.txt").write_text("not a disk tier")
    held_dir = tmp_path / "held-model-fedcba9876543210"
    held = DiskTier(layout, 8, held_dir)  # another server's namespace, in use
    try:
        options, plan = plan_for(tmp_path)
        Worker(plan)
        with pytest.raises(ConfigError, match="disk_budget=.* in use by other processes .*held"):
            OffloadStore(plan, options)
        assert not old.exists() and foreign.exists()  # the unused one went first
    finally:
        held.close()
    Worker(plan)
    store = OffloadStore(plan, options)
    try:
        assert store.removed_namespaces == [str(held_dir)] and foreign.exists()
    finally:
        store.close()


def test_blocks_written_but_never_keyed_are_freed_at_open(tmp_path: Path) -> None:
    """A crash between a block's write and its key leaves a written slot nothing can
    find: the disk tier drops unkeyed rows when it reopens, so the next start has that
    slot free again instead of losing it from the budget for good."""
    store, worker = _store(tmp_path)
    try:
        _put(store, worker, [b"a", b"b"], seed=0)
        disk = store.disk
        orphan = disk.slots.free_slots()[0]

        def crash_before_the_key() -> None:  # what `DiskWriter.write` does, minus put_keys
            disk.tier.allocator.take([orphan])
            k = torch.zeros(store.plan.layout.raw_shape("k", 1))
            disk.tier.write_blocks([orphan], k, k)

        disk.call(crash_before_the_key)
        total = store.plan.disk_slots
    finally:
        store.close()
    store, worker = _store(tmp_path)  # a restarted scheduler
    try:
        assert store.stats()["found_on_disk"] == 2
        assert store.disk.slots.num_free == total - 2  # the two keyed blocks only
        assert read_back(store, [b"a"]) == [HIT]
    finally:
        store.close()
