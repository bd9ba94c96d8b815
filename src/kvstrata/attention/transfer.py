"""TransferEngine: asynchronous tier-to-tier copies, link models and stall accounting.

    caller thread                      worker threads (or a CUDA side stream)
    ─────────────                      ──────────────────────────────────────
    f = engine.copy(dst, src, link=..) ──► copy; sleep to the LinkModel's time
    ... compute layer l ...                 (bytes / bandwidth + latency)
    engine.wait(f)  ◄── blocked time = stall

`TransferStats` keeps bytes and copy seconds per link, the total stall, the overlap
ratio 1 - stall / transfer time (1.0 = every transfer hidden behind compute) and the
hidden fraction: the share of waits whose transfer had already finished. Transfers
that run on a device's copy stream rather than a worker (the CUDA staging path, see
`kvstrata.attention.staging`) are timed with device events and reported through `account`.

With CUDA, `copy` runs device copies on one side stream per direction (h2d, d2h,
d2d) of each device, ordered after the caller's stream with an event.

A `LinkModel` makes a copy take at least as long as it would on a given link (the
presets are `kvstrata.platform.hardware.LINKS`), so the overlap machinery can be exercised and
measured on a CPU-only machine where a host-to-host copy is much faster than a real
link.
`Prefetcher` is the double buffer: item i+1 loads into one buffer while item i
(in the other) is consumed, e.g. layer l+1 fetched while layer l computes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

from kvstrata.core.errors import ConfigError
from kvstrata.platform.hardware import LINK_LATENCY_S, LINKS, lookup_preset
from kvstrata.platform.streams import copy_direction

T = TypeVar("T")


@dataclass(frozen=True)
class LinkModel:
    """A link that moves `bandwidth_bytes_per_s` after a fixed `latency_s`."""

    bandwidth_bytes_per_s: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_per_s > 0:
            raise ConfigError.field(
                "bandwidth_bytes_per_s", self.bandwidth_bytes_per_s, "a positive number"
            )
        if self.latency_s < 0:
            raise ConfigError.field("latency_s", self.latency_s, "zero or a positive number")

    def seconds(self, nbytes: int) -> float:
        """The least time a transfer of `nbytes` takes on this link."""
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s

    @classmethod
    def preset(cls, name: str) -> LinkModel:
        """A GPU<->host link of `kvstrata.platform.hardware.LINKS` (pcie3, pcie3-x8, pcie4,
        pcie5: measured host<->device rates) with the per-copy `LINK_LATENCY_S`.

        Raises:
            ConfigError: unknown name (lists the valid ones).
        """
        return cls(lookup_preset(LINKS, name, "link").bandwidth, LINK_LATENCY_S)


@dataclass
class TransferStats:
    """What the engine moved, how long it took, and how long callers waited for it."""

    bytes_per_link: dict[str, int] = field(default_factory=dict)
    seconds_per_link: dict[str, float] = field(default_factory=dict)
    num_transfers: int = 0
    num_waits: int = 0
    stall_s: float = 0.0
    num_stalled: int = 0  # waits that found their transfer unfinished

    @property
    def hidden_fraction(self) -> float:
        """Share of waits whose transfer was already over (fully hidden behind
        compute), in [0, 1]; 1.0 when nothing was waited for."""
        if self.num_waits <= 0:
            return 1.0
        return 1.0 - min(self.num_stalled, self.num_waits) / self.num_waits

    @property
    def transfer_s(self) -> float:
        """Total copy time over all links (parallel copies count separately)."""
        return sum(self.seconds_per_link.values())

    @property
    def overlap_ratio(self) -> float:
        """1 - stall / transfer time, in [0, 1]; 1.0 when nothing was transferred."""
        total = self.transfer_s
        if total <= 0:
            return 1.0
        return min(1.0, max(0.0, 1.0 - self.stall_s / total))

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready copy, derived fields included."""
        return {
            "bytes_per_link": dict(self.bytes_per_link),
            "seconds_per_link": dict(self.seconds_per_link),
            "num_transfers": self.num_transfers,
            "num_waits": self.num_waits,
            "stall_s": self.stall_s,
            "num_stalled": self.num_stalled,
            "transfer_s": self.transfer_s,
            "overlap_ratio": self.overlap_ratio,
            "hidden_fraction": self.hidden_fraction,
        }


def _sleep_until(deadline: float) -> None:
    # time.sleep may wake early on some platforms; loop on the monotonic clock.
    while (remaining := deadline - time.perf_counter()) > 0:
        time.sleep(remaining)


class TransferEngine:
    """Runs copies off the caller's thread and accounts for them per link.

    Args:
        max_workers: worker threads (copies in flight at once).
        links: link name -> LinkModel (or a preset name such as "pcie4"). Links not
            named here run at the hardware's own speed.
    """

    def __init__(
        self, max_workers: int = 2, links: dict[str, LinkModel | str] | None = None
    ) -> None:
        if max_workers < 1:
            raise ConfigError.field("max_workers", max_workers, "at least 1")
        self.links: dict[str, LinkModel] = {
            name: LinkModel.preset(m) if isinstance(m, str) else m
            for name, m in (links or {}).items()
        }
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="kvstrata-xfer")
        self._lock = threading.Lock()
        self._stats = TransferStats()
        self._streams: dict[tuple[int, str], torch.cuda.Stream] = {}
        self._stats_hooks: list[Callable[[], None]] = []

    # -- submission -------------------------------------------------------------------
    def submit(self, fn: Callable[[], T], *, link: str, nbytes: int) -> Future[T]:
        """Run `fn()` on a worker as a transfer of `nbytes` over `link`.

        Returns:
            A Future of fn's result; it completes no sooner than the link allows.
        """
        model = self.links.get(link)
        return self._pool.submit(self._run, fn, link, nbytes, model)

    def _run(self, fn: Callable[[], T], link: str, nbytes: int, model: LinkModel | None) -> T:
        start = time.perf_counter()
        result = fn()
        if model is not None:
            _sleep_until(start + model.seconds(nbytes))
        self.account(link, nbytes, time.perf_counter() - start, waited=False)
        return result

    def account(
        self,
        link: str,
        nbytes: int,
        seconds: float,
        *,
        stall_s: float = 0.0,
        waited: bool = True,
    ) -> None:
        """Count a transfer that ran elsewhere (e.g. on a CUDA copy stream, timed with
        events): `nbytes` over `link` in `seconds`; with `waited`, also the consumer's
        wait for it, of which `stall_s` it was blocked (0 = the transfer was hidden)."""
        with self._lock:
            s = self._stats
            s.bytes_per_link[link] = s.bytes_per_link.get(link, 0) + nbytes
            s.seconds_per_link[link] = s.seconds_per_link.get(link, 0.0) + seconds
            s.num_transfers += 1
            if waited:
                s.num_waits += 1
                s.stall_s += stall_s
                s.num_stalled += stall_s > 0

    def copy(
        self, dst: torch.Tensor, src: torch.Tensor, *, link: str, nbytes: int | None = None
    ) -> Future[torch.Tensor]:
        """dst.copy_(src) as a transfer; the Future's result is `dst`.

        With CUDA and a device tensor on either side, the copy runs on the side
        stream of its direction (h2d, d2h, d2d; one per device) after waiting for the
        caller's current stream (so `src` is ready), and the Future completes when the
        copy has finished on the device. Pinned host memory makes it asynchronous.
        """
        if nbytes is None:
            nbytes = src.numel() * src.element_size()
        if torch.cuda.is_available() and (dst.is_cuda or src.is_cuda):
            return self.submit(self._cuda_copy_fn(dst, src), link=link, nbytes=nbytes)

        def run() -> torch.Tensor:
            return dst.copy_(src)

        return self.submit(run, link=link, nbytes=nbytes)

    def _cuda_copy_fn(self, dst: torch.Tensor, src: torch.Tensor) -> Callable[[], torch.Tensor]:
        device = dst.device if dst.is_cuda else src.device
        key = (device.index or 0, copy_direction(dst, src))
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams.setdefault(key, torch.cuda.Stream(device))
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(device))  # in the caller's stream order

        def run() -> torch.Tensor:
            with torch.cuda.stream(stream):
                stream.wait_event(ready)
                dst.copy_(src, non_blocking=True)
                for t in (dst, src):
                    if t.is_cuda:  # keep the caching allocator from reusing them early
                        t.record_stream(stream)
                done = torch.cuda.Event()
                done.record(stream)
            done.synchronize()
            return dst

        return run

    # -- waiting ----------------------------------------------------------------------
    def wait(self, future: Future[T]) -> T:
        """The future's result; the time the caller was blocked counts as stall."""
        stalled = not future.done()
        start = time.perf_counter()
        try:
            return future.result()
        finally:
            blocked = time.perf_counter() - start
            with self._lock:
                self._stats.stall_s += blocked
                self._stats.num_waits += 1
                self._stats.num_stalled += stalled

    def wait_all(self, futures: Sequence[Future[Any]]) -> list[Any]:
        """wait() on each future in order."""
        return [self.wait(f) for f in futures]

    # -- stats and lifecycle ----------------------------------------------------------
    def add_stats_hook(self, hook: Callable[[], None]) -> None:
        """Call `hook()` before every stats snapshot or reset: e.g. a stager resolving
        its pending device timings into `account` (which may wait for the device)."""
        self._stats_hooks.append(hook)

    @property
    def stats(self) -> TransferStats:
        """A snapshot of the counters (after the stats hooks ran)."""
        for hook in self._stats_hooks:
            hook()
        with self._lock:
            s = self._stats
            return TransferStats(
                dict(s.bytes_per_link),
                dict(s.seconds_per_link),
                s.num_transfers,
                s.num_waits,
                s.stall_s,
                s.num_stalled,
            )

    def reset_stats(self) -> None:
        for hook in self._stats_hooks:
            hook()
        with self._lock:
            self._stats = TransferStats()

    def close(self) -> None:
        """Finish queued transfers and stop the workers."""
        self._pool.shutdown(wait=True)

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Prefetcher(Generic[T]):
    """Keeps the next items loading while the current one is consumed.

    With two buffers: item i+1 loads into one buffer while item i, in the other,
    is in the caller's hands; with k buffers, k-1 loads are in flight. A buffer is
    reloaded only after the caller has asked for the item after the one it held.

        pf = Prefetcher(engine, lambda i, buf: tier.read_layer(i, slots, *buf),
                        buffers=[(k0, v0), (k1, v1)], num_items=num_layers,
                        link="disk->host", nbytes=layer_bytes)
        for layer, (k, v) in pf:
            attend(layer, k, v)

    Args:
        engine: the TransferEngine that runs the loads and counts stalls.
        load: load(i, buffer) fills `buffer` with item i.
        buffers: at least 2 buffers, reused round-robin.
        num_items: items 0..num_items-1.
        link: the link name the loads are accounted to.
        nbytes: bytes per load, or a function of the item index.
    """

    def __init__(
        self,
        engine: TransferEngine,
        load: Callable[[int, T], Any],
        buffers: Sequence[T],
        num_items: int,
        *,
        link: str,
        nbytes: int | Callable[[int], int],
    ) -> None:
        if len(buffers) < 2:
            raise ConfigError.field("buffers", len(buffers), "at least 2 (double buffering)")
        self.engine = engine
        self.load = load
        self.buffers = list(buffers)
        self.num_items = num_items
        self.link = link
        self.nbytes = nbytes if callable(nbytes) else (lambda _i: nbytes)

    def _start(self, i: int) -> Future[Any]:
        buf = self.buffers[i % len(self.buffers)]
        return self.engine.submit(lambda: self.load(i, buf), link=self.link, nbytes=self.nbytes(i))

    def __iter__(self) -> Iterator[tuple[int, T]]:
        depth = len(self.buffers) - 1
        pending: dict[int, Future[Any]] = {}
        try:
            for i in range(min(depth, self.num_items)):
                pending[i] = self._start(i)
            for i in range(self.num_items):
                # Item i+depth reuses the buffer of item i-1, which the caller is done
                # with (it asked for item i), so it may start before we wait for i.
                if i + depth < self.num_items:
                    pending[i + depth] = self._start(i + depth)
                self.engine.wait(pending.pop(i))
                yield i, self.buffers[i % len(self.buffers)]
        finally:
            for f in pending.values():  # never leave a load writing into a buffer
                if not f.cancel():
                    f.exception()  # waits; the error, if any, belongs to an unused item
