"""The host tier under memory pressure (store/pressure.py), with a reader the test
controls: it shrinks to disk below the headroom, grows back above twice it, holds
between, gives its free slots' pages back, and every sequence reads back the same."""

from __future__ import annotations

import pytest
import torch

from blockstore_harness import read_sequence
from kvstrata import CacheConfig, KVStore
from kvstrata.attention.writes import write_layer, write_plan
from kvstrata.model.geometry import KVGeometry
from kvstrata.platform.memory_pressure import MemoryReading
from kvstrata.store.pressure import INTERVAL_S, HostPressure
from kvstrata.tiers.memory import MemoryTier

MIB = 1 << 20
BS = 64  # tokens per block: one 4 KiB page per (layer, head) row of a slot
KIB = 1024
HEADROOM = 128 * KIB  # 8 blocks of 16 KiB


class FakeReader:
    source = "fake"

    def __init__(self) -> None:
        self.available = 10_000 * MIB
        self.psi_full = 0.0

    def read(self) -> MemoryReading:
        return MemoryReading("fake", 16_000 * MIB, 0, self.available, 0.0, self.psi_full)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += INTERVAL_S  # every reading is due
        return self.t


def _store(tmp_path, host_blocks=32, disk_blocks=256, **kw) -> KVStore:
    geometry = KVGeometry(
        model_type="toy", num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
        v_head_dim=16, dtype="fp32",
    )  # fmt: skip
    block = BS * 16 * 4 * 2 * 2  # tokens x dim x fp32 x (K, V) x layers
    cfg = CacheConfig(
        block_size=BS, max_tokens=64 * BS, device_budget=4 * block,
        host_budget=host_blocks * block, disk_dir=str(tmp_path / "disk"),
        disk_budget=disk_blocks * block, sink_tokens=0, **kw,
    )  # fmt: skip
    store = KVStore(geometry, cfg)
    store.build(torch.float32)
    return store


def _fill(store: KVStore, num_seqs: int, tokens: int) -> list[int]:
    seqs = []
    for i in range(num_seqs):
        seq, _ = store.add_sequence(None)
        ids = [(7 * i + j) % 90 + 3 for j in range(tokens)]
        writes = store.extend([seq], tokens, [ids])
        plan = write_plan(store.runtime, writes[0], 1)
        base = torch.tensor(ids, dtype=torch.float32) / 100 + torch.arange(tokens) / 1000 + i
        for layer in range(2):
            k = (base + layer)[None, None, :, None].expand(1, 1, tokens, 16).contiguous()
            write_layer(plan, layer, k, -k)
        store.step_done([seq])
        seqs.append(seq)
    return seqs


def _contents(store: KVStore, seqs: list[int]) -> list[torch.Tensor]:
    return [
        torch.cat([t.clone() for t in read_sequence(store.manager, (s, 0), layer)])
        for s in seqs
        for layer in range(2)
    ]


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_the_host_tier_shrinks_to_disk_under_pressure_and_grows_back(tmp_path, codec):
    store = _store(tmp_path, host_pressure="auto", host_headroom=HEADROOM, host_codec=codec)
    seqs = _fill(store, 4, 7 * BS)  # 28 blocks: 4 on the device, the rest on the host
    before = _contents(store, seqs)
    occ = store.usage().occupancy
    host_used = occ["host"]["used_blocks"]
    assert host_used >= 20 and occ["disk"]["used_blocks"] == 0
    bb = occ["host"]["block_bytes"]
    headroom = 8 * bb  # in host blocks, whatever the codec
    reader = FakeReader()
    store.pressure = HostPressure(store.manager, headroom, reader, Clock())

    assert store.adapt() == INTERVAL_S  # plenty of room: nothing moves
    assert store.stats()["host_pressure"]["decisions"] == {"shrink": 0, "grow": 0, "refused": 0}

    reader.available = 4 * bb  # below the headroom: lift the room to twice it
    store.adapt()
    occ = store.usage().occupancy
    cut = 2 * 8 - 4
    assert occ["host"]["budget_blocks"] == host_used - cut
    assert occ["host"]["used_blocks"] <= host_used - cut
    assert occ["disk"]["used_blocks"] >= cut
    p = store.stats()["host_pressure"]
    assert p["decisions"]["shrink"] == 1 and p["blocks_moved"] >= cut
    assert p["released_bytes"] > 0
    for a, b in zip(_contents(store, seqs), before, strict=True):
        assert torch.equal(a, b)  # the blocks on disk and the kept ones read the same

    reader.available = 12 * bb  # between the headroom and twice it: hold
    budget = store.usage().occupancy["host"]["budget_blocks"]
    store.adapt()
    assert store.usage().occupancy["host"]["budget_blocks"] == budget

    reader.available = 2 * headroom + 3 * bb  # memory freed: grow by what leaves twice it
    store.adapt()
    assert store.usage().occupancy["host"]["budget_blocks"] == budget + 3
    reader.available = 10_000 * MIB  # ...never past host_budget
    store.adapt()
    configured = store.pressure.configured
    assert store.usage().occupancy["host"]["budget_blocks"] == configured >= 32
    p = store.stats()["host_pressure"]
    assert p["decisions"] == {"shrink": 1, "grow": 2, "refused": 0}
    budgets = [h[1] // bb for h in p["history"]]
    assert min(budgets) == host_used - cut and budgets[-1] == configured
    for a, b in zip(_contents(store, seqs), before, strict=True):
        assert torch.equal(a, b)
    store.close()


def test_psi_stalls_shrink_it_whatever_the_room(tmp_path):
    store = _store(tmp_path, host_pressure="auto", host_headroom=HEADROOM)
    reader = FakeReader()
    store.pressure = HostPressure(store.manager, store.config.host_headroom, reader, Clock())
    _fill(store, 4, 7 * BS)
    used = store.usage().occupancy["host"]["used_blocks"]
    reader.psi_full = 25.0
    store.adapt()
    assert store.usage().occupancy["host"]["budget_blocks"] == used - 32 // 8
    for _ in range(10):  # its 10 s average trails: no second cut within the window
        store.adapt()
    assert store.usage().occupancy["host"]["budget_blocks"] == used - 32 // 8
    reader.available = 0  # the room is another matter
    store.adapt()
    assert store.usage().occupancy["host"]["budget_blocks"] < used - 32 // 8
    store.close()


def test_no_room_below_refuses_and_leaves_the_budget(tmp_path):
    store = _store(tmp_path, disk_blocks=1, host_pressure="auto", host_headroom=HEADROOM)
    reader = FakeReader()
    store.pressure = HostPressure(store.manager, store.config.host_headroom, reader, Clock())
    seqs = _fill(store, 4, 7 * BS)
    before = _contents(store, seqs)
    reader.available = 0
    store.adapt()
    p = store.stats()["host_pressure"]
    assert p["decisions"] == {"shrink": 1, "grow": 0, "refused": 1}
    occ = store.usage().occupancy  # as low as the one free disk slot allows
    assert occ["host"]["budget_blocks"] == occ["host"]["used_blocks"] == 24 - 1
    assert occ["disk"]["used_blocks"] == 1
    for a, b in zip(_contents(store, seqs), before, strict=True):
        assert torch.equal(a, b)
    store.close()


def test_fixed_budgets_are_not_adapted(tmp_path):
    store = _store(tmp_path)
    assert store.adapt() is None
    assert store.stats()["host_pressure"] is None
    store.close()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_released_slots_give_their_pages_back():
    from kvstrata.core.layout import BlockLayout

    layout = BlockLayout(
        num_layers=2, num_kv_heads=2, block_size=BS, head_dim=64, dtype=torch.float32
    )
    tier = MemoryTier("host", layout, 256)  # 64 MiB, committed as written
    k = torch.ones(2, 2, 256 * BS, 64)
    tier.write_blocks(list(range(256)), k, k)
    full = _rss()
    released = tier.release_slots(list(range(128, 256)))
    assert released == 128 * tier.block_bytes
    assert full - _rss() >= released * 0.9
    kk = torch.empty(2, 2, BS, 64)
    tier.read_blocks([200], kk, kk.clone())
    tier.read_blocks([3], kk, kk.clone())  # the kept slots are intact
    assert torch.equal(kk, torch.ones_like(kk))


def test_the_decisions_reach_the_engines_metrics(tmp_path):
    from kvstrata.engine.metrics import EngineMetrics

    store = _store(tmp_path, host_pressure="auto", host_headroom=HEADROOM)
    reader = FakeReader()
    store.pressure = HostPressure(store.manager, store.config.host_headroom, reader, Clock())
    _fill(store, 4, 7 * BS)
    reader.available = 0
    store.adapt()
    metrics = EngineMetrics(lambda: {"store": store.stats()})
    occ = store.usage().occupancy["host"]
    assert metrics.value("kvstrata_host_pressure_decisions_total", choice="shrink") == 1
    assert metrics.value("kvstrata_host_pressure_available_bytes") == 0
    assert metrics.value("kvstrata_host_pressure_headroom_bytes") == HEADROOM
    assert metrics.value("kvstrata_host_pressure_blocks_moved_total") > 0
    assert metrics.value("kvstrata_host_pressure_released_bytes_total") > 0
    budget = metrics.value("kvstrata_tier_budget_bytes", tier="host")
    assert budget == occ["budget_blocks"] * occ["block_bytes"] < 32 * occ["block_bytes"]
    store.close()


def test_an_empty_host_tier_stops_refilling(tmp_path):
    store = _store(tmp_path, host_pressure="auto", host_headroom=HEADROOM)
    reader = FakeReader()
    store.pressure = HostPressure(store.manager, HEADROOM, reader, Clock())
    reader.available = 0
    store.adapt()
    assert store.usage().occupancy["host"]["budget_blocks"] == 0
    assert store.stats()["host_pressure"]["decisions"]["shrink"] == 1
    store.close()
