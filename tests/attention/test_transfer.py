"""TransferEngine, LinkModel, stall accounting and the Prefetcher double buffer."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvstrata.attention.transfer import LinkModel, Prefetcher, TransferEngine, TransferStats
from kvstrata.core.errors import ConfigError
from kvstrata.platform.hardware import LINK_LATENCY_S, LINKS

MB = 1 << 20


def test_link_model_and_presets():
    link = LinkModel(1e9, latency_s=1e-3)
    assert link.seconds(8_000_000) == pytest.approx(0.009)
    assert LinkModel.preset("pcie4") == LinkModel(25e9, 10e-6)
    assert LinkModel.preset("pcie3") == LinkModel(12e9, 10e-6)
    assert LinkModel.preset("pcie5") == LinkModel(50e9, 10e-6)
    # one table with the planner's links (kvstrata.platform.hardware.LINKS)
    for name, spec in LINKS.items():
        assert LinkModel.preset(name) == LinkModel(spec.bandwidth, LINK_LATENCY_S)
    with pytest.raises(ConfigError, match=r"^link='pcie9' is invalid: one of pcie3, pcie3-x8"):
        LinkModel.preset("pcie9")
    with pytest.raises(ConfigError, match="bandwidth"):
        LinkModel(0)


def test_copies_complete_with_correct_data():
    src = [torch.arange(i * 1000, (i + 1) * 1000, dtype=torch.float32) for i in range(6)]
    dst = [torch.zeros(1000) for _ in range(6)]
    with TransferEngine(max_workers=2) as engine:
        futures = [engine.copy(d, s, link="host->host") for d, s in zip(dst, src, strict=True)]
        results = engine.wait_all(futures)
        stats = engine.stats
    assert all(r is d for r, d in zip(results, dst, strict=True))
    assert all(torch.equal(d, s) for d, s in zip(dst, src, strict=True))
    assert stats.num_transfers == 6 and stats.num_waits == 6
    assert stats.bytes_per_link == {"host->host": 6 * 4000}


def test_submit_returns_result_and_propagates_errors():
    with TransferEngine(max_workers=1) as engine:
        assert engine.wait(engine.submit(lambda: 42, link="x", nbytes=0)) == 42

        def boom() -> None:
            raise OSError("disk on fire")

        with pytest.raises(OSError, match="on fire"):
            engine.wait(engine.submit(boom, link="x", nbytes=0))


def test_link_model_sets_a_floor_on_copy_time():
    src, dst = torch.ones(2 * MB, dtype=torch.float32), torch.zeros(2 * MB)  # 8 MiB
    with TransferEngine(links={"h2d": LinkModel(1e9)}) as engine:
        engine.wait(engine.copy(dst, src, link="h2d"))
        stats = engine.stats
    assert torch.equal(dst, src)
    assert stats.seconds_per_link["h2d"] >= 8 * MB / 1e9  # the sleep guarantees it


def test_stall_is_small_when_compute_outlasts_transfer():
    src, dst = torch.ones(2 * MB), torch.zeros(2 * MB)
    with TransferEngine(links={"h2d": LinkModel(1e9)}) as engine:
        f = engine.copy(dst, src, link="h2d")
        while not f.done():  # "compute" until the transfer is over
            time.sleep(0.001)
        engine.wait(f)
        hidden = engine.stats
        engine.reset_stats()
        engine.wait(engine.copy(dst, src, link="h2d"))  # wait at once: fully exposed
        exposed = engine.stats
    assert hidden.stall_s < hidden.transfer_s
    assert hidden.overlap_ratio > 0.5
    assert exposed.stall_s > 0.0
    assert exposed.overlap_ratio < 1.0


def test_stats_overlap_ratio_and_dict():
    s = TransferStats({"a": 10}, {"a": 0.5, "b": 0.5}, 2, 2, 0.25)
    assert s.transfer_s == 1.0
    assert s.overlap_ratio == 0.75
    assert TransferStats().overlap_ratio == 1.0
    assert TransferStats(stall_s=5.0, seconds_per_link={"a": 1.0}).overlap_ratio == 0.0
    d = s.as_dict()
    assert d["overlap_ratio"] == 0.75 and d["bytes_per_link"] == {"a": 10}


def test_hidden_fraction_counts_waits_that_found_their_transfer_done():
    gate = threading.Event()
    with TransferEngine(max_workers=1) as engine:
        done = engine.submit(lambda: 1, link="l", nbytes=1)
        while not done.done():
            time.sleep(0.001)
        engine.wait(done)  # already over: hidden
        blocked = engine.submit(gate.wait, link="l", nbytes=1)
        threading.Timer(0.05, gate.set).start()
        engine.wait(blocked)  # not over yet: stalled
        stats = engine.stats
    assert (stats.num_waits, stats.num_stalled) == (2, 1)
    assert stats.hidden_fraction == 0.5
    assert stats.as_dict()["hidden_fraction"] == 0.5 and stats.as_dict()["num_stalled"] == 1
    assert TransferStats().hidden_fraction == 1.0


def test_account_and_stats_hooks():
    """Transfers timed elsewhere (device events) are accounted; hooks run before every
    snapshot and reset, e.g. to resolve pending device timings."""
    calls = []
    with TransferEngine() as engine:
        engine.add_stats_hook(lambda: calls.append(1))
        engine.account("host->device", 100, 0.5, stall_s=0.25)
        engine.account("host->device", 50, 0.5)  # hidden
        engine.account("disk->host", 10, 0.1, waited=False)  # a prefetch never used
        s = engine.stats
        assert len(calls) == 1
        engine.reset_stats()
        assert len(calls) == 2 and engine.stats.num_transfers == 0
    assert s.bytes_per_link == {"host->device": 150, "disk->host": 10}
    assert s.seconds_per_link == {"host->device": 1.0, "disk->host": 0.1}
    assert (s.num_transfers, s.num_waits, s.num_stalled) == (3, 2, 1)
    assert s.stall_s == 0.25 and s.hidden_fraction == 0.5
    assert s.overlap_ratio == pytest.approx(1 - 0.25 / 1.1)


def test_prefetcher_loads_next_item_while_current_is_consumed():
    n = 5
    started = [threading.Event() for _ in range(n)]
    loaded: list[int] = []

    def load(i: int, buf: torch.Tensor) -> None:
        started[i].set()
        buf.fill_(i)
        loaded.append(i)

    buffers = [torch.empty(4), torch.empty(4)]
    seen = []
    with TransferEngine(max_workers=2) as engine:
        pf = Prefetcher(engine, load, buffers, n, link="disk->host", nbytes=16)
        for i, buf in pf:
            assert torch.equal(buf, torch.full((4,), float(i)))
            assert buf is buffers[i % 2]
            if i + 1 < n:  # item i+1 is in flight while we hold item i
                assert started[i + 1].wait(timeout=10)
            seen.append(i)
        stats = engine.stats
    assert seen == [0, 1, 2, 3, 4]
    assert sorted(loaded) == [0, 1, 2, 3, 4]
    assert stats.num_transfers == 5 and stats.bytes_per_link == {"disk->host": 80}


def test_prefetcher_stops_cleanly_and_needs_two_buffers():
    calls: list[int] = []
    with TransferEngine() as engine:
        pf = Prefetcher(engine, lambda i, b: calls.append(i), [0, 1, 2], 10, link="l", nbytes=1)
        for i, _ in pf:
            if i == 1:
                break
        after_break = sorted(calls)  # the generator closed: pending loads finished or cancelled
        with pytest.raises(ConfigError, match="buffers"):
            Prefetcher(engine, lambda i, b: None, [0], 3, link="l", nbytes=1)
    # depth 2: items 2 and 3 were queued; each either ran or was cancelled, none runs later
    assert after_break in ([0, 1, 2], [0, 1, 2, 3])
    assert sorted(calls) == after_break


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_side_stream_copy():
    src = torch.arange(MB, dtype=torch.float32).pin_memory()
    dst = torch.empty(MB, device="cuda")
    back = torch.empty(MB).pin_memory()
    with TransferEngine(links={"h2d": "pcie4"}) as engine:
        engine.wait(engine.copy(dst, src, link="h2d"))
        dst.mul_(2)  # on the current stream, after the copy
        engine.wait(engine.copy(back, dst, link="d2h"))
        directions = sorted(direction for _, direction in engine._streams)
    assert torch.equal(back, src * 2)
    assert directions == ["d2h", "h2d"]  # one side stream per direction
