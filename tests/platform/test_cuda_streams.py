"""The CUDA staging path's logic on the CPU: copy streams and events simulated.

`SimStreams` implements kvstrata.platform.streams' interface with a clock per stream:
an op on a stream advances its clock, `wait_event` moves it to the event's time, an
event records its stream's clock. Driving the Stager's CUDA path (loads issued on
the h2d stream, `StagingGuards` ordering the streams with events) through it checks,
without a GPU: the data staged, which event guards which buffer, that attention never
starts before its chunk arrived nor a load before the buffer's last reader is done,
the layer-ahead prefetch, the stall / hidden-fraction numbers, no host
synchronisation and no worker thread in the decode loop — and, end to end, the same
tokens as DynamicCache.
"""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch

import kvstrata.attention.staging
from kvstrata.attention.staging import Stager, StagingGuards
from kvstrata.attention.transfer import TransferEngine
from kvstrata.blocks.runs import Run
from kvstrata.codecs.registry import get_codec
from kvstrata.core.layout import BlockLayout
from kvstrata.platform.streams import copy_direction, streams_for
from kvstrata.tiers import memory
from kvstrata.tiers.memory import MemoryTier

_ids = itertools.count()


class SimEvent:
    def __init__(self, sim: SimStreams) -> None:
        self.sim = sim
        self.id = next(_ids)
        self.t: float | None = None
        self.done = False

    def record(self, stream=None) -> None:
        self.t = (stream or self.sim.current).clock
        self.done = not self.sim.lagging

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.sim.host_syncs += 1
        self.done = True

    def elapsed_time(self, end: SimEvent) -> float:
        return (end.t - self.t) * 1e3  # milliseconds, as torch.cuda.Event


class SimStream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.clock = 0.0
        self.last_waited: SimEvent | None = None
        self.syncs = 0  # host waits for the whole stream

    def wait_event(self, event: SimEvent) -> None:
        assert event.t is not None, f"{self.name} waits for an event never recorded"
        self.clock = max(self.clock, event.t)
        self.last_waited = event

    def synchronize(self) -> None:
        self.syncs += 1


class SimStreams:
    """kvstrata.platform.streams.DeviceStreams, simulated."""

    def __init__(self) -> None:
        self.h2d, self.d2h, self.main = SimStream("h2d"), SimStream("d2h"), SimStream("main")
        self._stack = [self.main]
        self.host_syncs = 0
        self.lagging = False  # True: events complete only when synchronised

    @property
    def current(self) -> SimStream:
        return self._stack[-1]

    def compute(self) -> SimStream:
        return self.main

    def event(self) -> SimEvent:
        return SimEvent(self)

    @contextlib.contextmanager
    def use(self, stream: SimStream):
        self._stack.append(stream)
        try:
            yield
        finally:
            self._stack.pop()


LAYOUT = BlockLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)


def _host(codec: str = "none", slots: int = 8) -> MemoryTier:
    tier = MemoryTier("host", LAYOUT, slots, get_codec(codec))
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(LAYOUT.raw_shape("k", slots), generator=gen)
    v = torch.randn(LAYOUT.raw_shape("v", slots), generator=gen)
    tier.write_blocks(list(range(slots)), k, v)
    return tier


def _expected(tier: MemoryTier, layer: int, first: int, count: int):
    return tier.layer_view(layer, first, count)  # the raw arena, not a (timed) read


@pytest.fixture
def sim(monkeypatch) -> SimStreams:
    sim = SimStreams()
    monkeypatch.setattr(kvstrata.attention.staging, "streams_for", lambda device: sim)
    return sim


def _timed_tier(tier: MemoryTier, sim: SimStreams, stager: Stager, log: list, copy_s: float):
    """Make the tier's reads take `copy_s` on the stream they are issued on, and check
    each copy is ordered after the work issued on the compute stream so far, which
    must include the attention of the chunk its buffer held before."""
    inner = tier.read_layer
    occupant: dict[int, tuple] = {}  # staging buffer -> the chunk loaded into it last

    def timed(layer, slots, k_out, v_out):
        assert sim.current is sim.h2d, "a staging copy was issued off the copy stream"
        waited = sim.h2d.last_waited
        assert waited is not None and waited.t == sim.main.clock, "copy not after compute"
        buf = next(i for i, (k, _) in enumerate(stager.buffers) if k.data_ptr() == k_out.data_ptr())
        previous = occupant.get(buf)
        consumed = [tuple(e[:3]) for e in log if e[0] == "consumed"]
        assert previous is None or ("consumed", *previous) in consumed, "buffer reused early"
        occupant[buf] = (layer, slots[0])
        inner(layer, slots, k_out, v_out)
        sim.h2d.clock += copy_s
        log.append(("load", layer, slots[0], sim.h2d.clock))

    tier.read_layer = timed


def _run_two_layers(stager: Stager, sim: SimStreams, log: list, compute_s: float, tier):
    run = Run("host", 0, 8, 0, 32)  # 4 chunks of 2 blocks per layer
    then = (1, "host", 0, 2)
    for layer in (0, 1):
        for i, (k, v) in enumerate(stager.parts(layer, run, 0, 32, then if layer == 0 else None)):
            ready = [
                t for kind, lay, first, t in log if (kind, lay, first) == ("load", layer, 2 * i)
            ]
            assert ready and sim.main.clock >= ready[-1], "attention before its chunk arrived"
            ek, ev = _expected(tier, layer, 2 * i, 2)
            assert torch.equal(k, ek) and torch.equal(v, ev)
            sim.main.clock += compute_s  # the attention of this chunk
            log.append(("consumed", layer, 2 * i, sim.main.clock))


@pytest.mark.parametrize(
    ("compute_s", "stall_s", "stalled"),
    [
        # compute 2 > copy 1: only the very first load is exposed, the other 7 (the
        # next layer's first chunk included) load behind the previous chunk's attention
        (2.0, 1.0, 1),
        # copy-bound (compute 0.5 < copy 1): each later load is exposed by 0.5
        (0.5, 1.0 + 7 * 0.5, 8),
    ],
)
def test_event_path_orders_streams_and_counts_stalls(sim, monkeypatch, compute_s, stall_s, stalled):
    tier = _host()
    stager = Stager({"host": tier}, LAYOUT, torch.device("cpu"), 16, "device")
    assert stager.guards is not None and stager.tokens_per_buffer == 8
    monkeypatch.setattr(stager.engine, "submit", _no_worker)
    log: list = []
    _timed_tier(tier, sim, stager, log, copy_s=1.0)
    _run_two_layers(stager, sim, log, compute_s, tier)
    # layer-ahead prefetch: layer 1's first chunk was loading before layer 0's last
    # chunk had been attended
    order = [(kind, lay, first) for kind, lay, first, _ in log]
    assert order.index(("load", 1, 0)) < order.index(("consumed", 0, 6))
    assert sim.host_syncs == 0
    stats = stager.engine.stats
    assert stats.num_transfers == 8 and stats.num_waits == 8
    assert stats.bytes_per_link == {"host->device": 8 * 2 * tier.block_bytes // 2}
    assert stats.seconds_per_link["host->device"] == pytest.approx(8.0)
    assert stats.stall_s == pytest.approx(stall_s)
    assert stats.num_stalled == stalled
    assert stats.hidden_fraction == pytest.approx(1 - stalled / 8)
    assert stats.overlap_ratio == pytest.approx(1 - stall_s / 8.0)


def _no_worker(*args, **kwargs):
    raise AssertionError("a memory-tier load went to a worker thread on the CUDA path")


@pytest.mark.parametrize("codec", ["int8", "int4-g32", "fp8"])
def test_event_path_moves_encoded_fields_and_decodes_on_the_device(sim, monkeypatch, codec):
    tier = MemoryTier("host", BlockLayout(2, 2, 32, 32), 4, get_codec(codec))
    lay = tier.layout
    gen = torch.Generator().manual_seed(1)
    tier.write_blocks(
        [0, 1, 2, 3],
        torch.randn(lay.raw_shape("k", 4), generator=gen),
        torch.randn(lay.raw_shape("v", 4), generator=gen),
    )
    stager = Stager({"host": tier}, lay, torch.device("cpu"), 128, "device")
    monkeypatch.setattr(stager.engine, "submit", _no_worker)
    # the encoded buffers: one chunk (2 blocks) of every field, per staging buffer
    fields = stager.fields["host"]
    assert len(fields) == 2 and set(fields[0]) == {
        f"{kind}.{f}" for kind in "kv" for f in tier.field_specs[kind]
    }
    raw = sum(t.numel() * t.element_size() for pair in stager.buffers for t in pair)
    encoded = 2 * 2 * tier.block_bytes // lay.num_layers
    assert stager.nbytes == raw + encoded
    moved = []
    inner = tier.read_layer_fields
    tier.read_layer_fields = lambda layer, slots, outs: (
        moved.append(outs),
        inner(layer, slots, outs),
    )
    run = Run("host", 0, 4, 0, 128)
    for layer in (0, 1):
        for i, (k, v) in enumerate(stager.parts(layer, run, 0, 128)):
            n = 64
            ek = torch.empty(2, n, 32)
            ev = torch.empty(2, n, 32)
            tier.read_layer(layer, [2 * i, 2 * i + 1], ek, ev)  # the codec's own decode
            assert torch.equal(k, ek) and torch.equal(v, ev)
    assert len(moved) == 4  # encoded fields crossed, once per chunk
    stats = stager.engine.stats
    # bytes over the link are the stored (compressed) bytes
    assert stats.bytes_per_link == {"host->device": 4 * 2 * tier.block_bytes // lay.num_layers}
    assert sim.host_syncs == 0


def test_stale_prefetch_is_counted_without_a_wait(sim):
    tier = _host()
    stager = Stager({"host": tier}, LAYOUT, torch.device("cpu"), 16, "device")
    stager.prefetch((1, "host", 4, 2))  # a guess that turns out wrong
    run = Run("host", 0, 2, 0, 8)
    (k, v), = list(stager.parts(0, run, 0, 8))  # fmt: skip
    ek, ev = _expected(tier, 0, 0, 2)
    assert torch.equal(k, ek) and torch.equal(v, ev)
    stats = stager.engine.stats
    assert stats.num_transfers == 2 and stats.num_waits == 1


def test_worker_loads_are_ordered_on_the_copy_stream(sim, tmp_path):
    """Disk blocks load on the worker thread (file I/O), their copies on the copy stream
    after the buffer's last reader; the engine accounts them (host wait)."""
    from kvstrata.tiers.disk import DiskTier

    disk = DiskTier(LAYOUT, 8, tmp_path)
    src = _host()
    k = torch.empty(LAYOUT.raw_shape("k", 8))
    v = torch.empty(LAYOUT.raw_shape("v", 8))
    src.read_blocks(list(range(8)), k, v)
    disk.write_blocks(list(range(8)), k, v)
    stager = Stager({"disk": disk}, LAYOUT, torch.device("cpu"), 16, "device")
    try:
        run = Run("disk", 0, 8, 0, 32)
        for i, (sk, sv) in enumerate(stager.parts(0, run, 0, 32)):
            ek, ev = _expected(src, 0, 2 * i, 2)
            assert torch.equal(sk, ek) and torch.equal(sv, ev)
        stats = stager.engine.stats
        assert stats.num_transfers == 4 and stats.num_waits == 4
        assert stager.guards.loads == [None, None]  # each load acquired once
    finally:
        disk.close()


def test_guards_poll_without_waiting_and_drain_with_a_sync():
    """Timings of loads still running on the device stay pending through `poll` (the
    decode loop never waits for them); `drain` (stats) synchronises."""
    sim = SimStreams()
    sim.lagging = True  # events complete only when synchronised
    engine = TransferEngine()
    guards = StagingGuards(sim, engine, 2)
    with guards.loading(1, "host->device", 64):
        sim.h2d.clock += 0.5
    guards.acquire(1)
    assert engine.stats.num_transfers == 0 and sim.host_syncs == 0
    with pytest.raises(AssertionError, match="without a load"):
        guards.acquire(1)  # each load is consumed once
    guards.drain()
    assert sim.host_syncs == 3  # start, ready, wait_at
    stats = engine.stats
    assert stats.num_transfers == 1 and stats.num_waits == 1
    assert stats.stall_s == pytest.approx(0.5) and stats.num_stalled == 1
    # a load starts after the work issued on the compute stream before it
    sim.main.clock = 7.0
    with guards.loading(0, "host->device", 64):
        assert sim.h2d.clock == 7.0 and sim.h2d.last_waited.t == 7.0
    engine.close()


def test_stager_close_waits_for_the_copy_stream(sim):
    """A stale prefetch may still be writing a staging buffer (or reading a host arena)
    on the copy stream: closing the stager waits for it, and for the worker."""
    stager = Stager({"host": _host()}, LAYOUT, torch.device("cpu"), 16, "device")
    stager.prefetch((1, "host", 4, 2))
    stager.close()
    assert sim.h2d.syncs == 1
    with pytest.raises(RuntimeError):  # the worker pool is shut down
        stager.engine.submit(lambda: None, link="x", nbytes=0)


# -- device -> host writes (demotions) on the d2h copy stream ---------------------------------
def test_device_to_host_writes_run_on_the_d2h_stream_after_the_compute_stream(monkeypatch):
    """A GPU tensor written into a host arena: its copies are issued on the d2h stream,
    after an event recorded on the compute stream (which produced the data), one per
    run; the arena's readers wait for the event after them — CPU readers on the host
    (then it is cleared), device readers on their stream (no host wait)."""
    sim = SimStreams()
    monkeypatch.setattr(memory, "streams_for", lambda device: sim)
    tier = MemoryTier("host", LAYOUT, 8, get_codec("none"))
    issued = []
    real = memory.copy_async

    def spy(dst, src):
        issued.append((sim.current.name, sim.d2h.last_waited.t))
        real(dst, src)

    monkeypatch.setattr(memory, "copy_async", spy)
    sim.main.clock = 3.0
    gen = torch.Generator().manual_seed(2)
    k = torch.randn(LAYOUT.raw_shape("k", 3), generator=gen)
    tier._scatter_from_device("k.data", [5, 6, 1], LAYOUT.block_size, k, None)
    assert issued == [("d2h", 3.0), ("d2h", 3.0)]  # two runs: slots 5-6, slot 1
    bs = LAYOUT.block_size
    arena = tier.arenas["k.data"]
    assert torch.equal(arena[:, :, 5 * bs : 7 * bs], k[:, :, : 2 * bs])
    assert torch.equal(arena[:, :, bs : 2 * bs], k[:, :, 2 * bs :])
    # one event per copy stream: the latest (a stream runs in order)
    first = tier._device_writes[sim.d2h][1]
    sim.main.clock = 5.0
    tier._scatter_from_device("k.data", [0], bs, k[:, :, :bs], None)
    (streams, last), = tier._device_writes.values()  # fmt: skip
    assert streams is sim and last is not first and sim.d2h.last_waited.t == 5.0
    tier._order_device_reads()  # a device-side reader: its stream waits, the host does not
    assert sim.main.last_waited is last and sim.host_syncs == 0
    ko = torch.empty(LAYOUT.raw_shape("k", 1))
    vo = torch.empty(LAYOUT.raw_shape("v", 1))
    tier.read_blocks([0], ko, vo)  # a CPU reader waits on the host
    assert sim.host_syncs == 1 and tier._device_writes == {}
    assert torch.equal(ko, k[:, :, :bs])


def test_cpu_readers_and_writers_wait_for_pending_device_writes(monkeypatch):
    sim = SimStreams()
    monkeypatch.setattr(memory, "streams_for", lambda device: sim)
    tier = MemoryTier("host", LAYOUT, 4, get_codec("none"))
    k = torch.randn(LAYOUT.raw_shape("k", 1))
    for reader in (
        lambda: tier.layer_view(0, 0, 1),  # attention in place on the CPU
        lambda: tier.read_encoded([0]),
        lambda: tier.write_blocks([0], k, k),  # a CPU write into a maybe-reused slot
    ):
        tier._scatter_from_device("k.data", [0], LAYOUT.block_size, k, None)
        syncs = sim.host_syncs
        reader()
        assert sim.host_syncs == syncs + 1 and tier._device_writes == {}


def test_slices_of_strided_arena_views_are_contiguous_pairs():
    """Host <-> device copies of an arena run go slice by slice: every (layer, head)
    slice is contiguous on both sides (one DMA each), and together they are the copy."""
    arena = torch.zeros(2, 3, 40, 8)
    dst = arena.narrow(2, 8, 16)  # a run of slots: heads apart by the whole arena
    src = torch.randn(2, 3, 32, 8).narrow(2, 4, 16)
    pairs = memory._slice_pairs(dst, src)
    assert len(pairs) == 6
    assert all(d.is_contiguous() and s.is_contiguous() for d, s in pairs)
    for d, s in pairs:
        d.copy_(s)
    assert torch.equal(dst, src)
    whole = torch.empty(2, 3, 16, 8)
    assert memory._slice_pairs(whole, torch.empty(2, 3, 16, 8)) is None  # one copy does
    assert memory._slice_pairs(dst, src.transpose(-1, -2).contiguous().transpose(-1, -2)) is None


def test_streams_for_and_copy_direction():
    assert streams_for(torch.device("cpu")) is None
    cpu = torch.empty(1)
    meta = torch.empty(1, device="meta")
    assert copy_direction(meta, cpu) == "h2d"
    assert copy_direction(cpu, meta) == "d2h"
    assert copy_direction(meta, meta) == "d2d"


# -- end to end: TieredCache decode through the simulated CUDA path ---------------------------


def _greedy(model, ids, cache, n):
    return model.generate(ids, cache=cache, max_new_tokens=n, min_new_tokens=n, do_sample=False)


@pytest.fixture(scope="module")
def llama():
    from hf_models import tiny_model

    return tiny_model("llama", "sdpa")


@pytest.mark.parametrize(
    ("host_codec", "fused"), [("none", False), ("int8", False), ("int8", True)]
)
def test_tokens_through_the_event_path(llama, host_codec, fused, monkeypatch):
    """Decode with 25 % on the device and the host staged through the CUDA path's
    logic: the tokens equal those of the worker-thread stager (and, lossless,
    DynamicCache's). `fused`: int8 blocks decoded by the Triton kernel (interpreted),
    as on a GPU."""
    from transformers import DynamicCache

    from kvstrata.codecs import triton_dequant
    from kvstrata.integrations.hf import TieredCache, enable

    kernel_runs = []
    n = 5 if fused else 16  # the interpreter runs the kernel in numpy: a few steps
    if fused:
        pytest.importorskip("triton", reason="the fused dequant kernel needs the `cuda` extra")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        real = triton_dequant.decode
        monkeypatch.setattr(
            triton_dequant, "decode", lambda *a: kernel_runs.append(real(*a)) or kernel_runs[-1]
        )

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 97, (1, 200), generator=g)
    kw = dict(
        block_size=32, max_tokens=256, resident_fraction=0.25, host_budget="4MiB",
        cold_attention="stage", staging_tokens=64, host_codec=host_codec, residual_tokens=0,
    )  # fmt: skip
    ref = _greedy(llama, ids, DynamicCache(config=llama.config), n)
    enable(llama)
    try:
        threaded = _greedy(llama, ids, TieredCache(llama.config, **kw), n)
        assert not kernel_runs  # the worker-thread path decodes with the codec itself
        sim = SimStreams()
        monkeypatch.setattr(kvstrata.attention.staging, "streams_for", lambda device: sim)
        cache = TieredCache(llama.config, **kw)
        evented = _greedy(llama, ids, cache, n)
        full = cache.stats()
        stats = full["transfers"]
        stager = cache.store.runtime.stager
    finally:
        llama.set_attn_implementation("sdpa")
    assert torch.equal(evented, threaded)
    if host_codec == "none":
        assert torch.equal(evented, ref)
    assert full["tiers"]["host"]["used_blocks"] > 0 and stager.guards is not None
    assert set(stager.fields) == (set() if host_codec == "none" else {"host"})
    assert stats["bytes_per_link"]["host->device"] > 0 and stats["num_waits"] > 0
    assert {"num_stalled", "hidden_fraction", "overlap_ratio"} <= set(stats)
    assert sim.host_syncs == 0
    if fused:
        assert kernel_runs and all(kernel_runs)
