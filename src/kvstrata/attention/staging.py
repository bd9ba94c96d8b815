"""Staging of cold blocks for attention: two fixed buffers, double-buffered.

Blocks that cannot be attended where they live (a lossy codec on the host, the disk
tier, or host RAM across PCIe with CUDA) are decoded/copied one layer at a time into
a staging buffer on the compute device. Two buffers of `tokens_per_buffer` tokens:
while the attention works on chunk i in one, chunk i+1 (or the next layer's first
chunk) loads into the other.

    layer l:   [load c0 → buf A] [attend A | load c1 → B] [attend B | load c2 → A] ...
    end of l:  [prefetch layer l+1 c0 → free buffer]

Device memory for cold data is therefore 2 × tokens_per_buffer (plus, with CUDA, two
chunk-sized buffers of each quantized tier's encoded fields), whatever the context.

Two ways to run a load:

- CPU (no copy streams): on the TransferEngine's worker thread; the caller waits for
  its Future (host-side, counted as stall).
- CUDA (`kvstrata.platform.streams`): loads from memory tiers are issued by the caller
  on the h2d copy stream and return at once — raw blocks as non-blocking copies from
  the pinned host arena, quantized blocks as their encoded fields (compressed over
  PCIe) then one fused dequant kernel (`codecs.triton_dequant`) into the buffer.
  `StagingGuards` orders the two streams with events, the host never waits: a load
  waits for an event recorded on the compute stream when it is issued, attention on
  a buffer waits for the event recorded after its load. Disk loads still run on the
  worker (file I/O), their device copies on the same copy stream.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from kvstrata.attention.transfer import TransferEngine
from kvstrata.blocks.manager import Run
from kvstrata.codecs.triton_dequant import decode_fields
from kvstrata.core.layout import BlockLayout
from kvstrata.platform.host_memory import cpu_empty
from kvstrata.platform.streams import DeviceEvent, DeviceStreams, streams_for
from kvstrata.tiers.base import Tier
from kvstrata.tiers.memory import MemoryTier

ChunkKey = tuple[int, str, int, int]
"""(layer, tier name, first slot, number of slots)."""

MAX_PENDING_TIMINGS = 4096  # unresolved load timings kept before forcing a device sync


@dataclass
class StagedLoad:
    """One load into a staging buffer on the copy stream: its start and ready events,
    and what it moved. `timed`: accounted from its events (inline loads); worker
    loads are accounted by the TransferEngine itself."""

    start: DeviceEvent
    ready: DeviceEvent
    link: str
    nbytes: int
    timed: bool = True


class StagingGuards:
    """Which event guards which staging buffer, on a device with copy streams.

    `loading(b)`: the load's ops run on the copy stream after an `issued` event
    recorded on the compute stream at that moment, i.e. after everything the compute
    stream has been given so far. That covers both hazards: the last attention that
    read buffer b (the stager loads into a buffer only once the work reading its
    previous chunk has been issued, see `Stager.parts`) and any copy that wrote the
    source tier (a demotion from the device into the host arena runs on the compute
    stream). `loads[b]` then holds the load, whose `ready` event is recorded on the
    copy stream after it.

    `acquire(b)`: the compute stream waits for loads[b].ready before attention reads
    b. Neither blocks the host.

    Stall accounting without synchronising: `acquire` records `wait_at` on the compute
    stream just before its wait. Once the events have completed (polled, never waited
    for, at each acquire; all at once by `drain`, which does wait):

        transfer time = start -> ready          stall = max(0, wait_at -> ready)

    and they go to the engine's `account`: a load is hidden when its stall is 0.
    """

    def __init__(self, streams: DeviceStreams, engine: TransferEngine, num_buffers: int) -> None:
        self.streams = streams
        self.engine = engine
        self.loads: list[StagedLoad | None] = [None] * num_buffers
        self._pending: deque[tuple[StagedLoad, DeviceEvent | None]] = deque()
        self._lock = threading.Lock()

    def issued(self) -> DeviceEvent:
        """An event after the work issued so far on the compute stream (recorded on
        the caller's thread: a worker thread's current stream is another one)."""
        event = self.streams.event()
        event.record(self.streams.compute())
        return event

    @contextlib.contextmanager
    def loading(
        self,
        buf: int,
        link: str,
        nbytes: int,
        timed: bool = True,
        issued: DeviceEvent | None = None,
    ) -> Iterator[None]:
        """Issue a load into `buf` inside this context: its ops run on the copy
        stream, after the work issued on the compute stream so far (or by the time
        `issued` was recorded)."""
        s = self.streams
        if issued is None:
            issued = self.issued()
        with s.use(s.h2d):
            s.h2d.wait_event(issued)
            start = s.event()
            start.record(s.h2d)
            yield
            ready = s.event()
            ready.record(s.h2d)
        self.loads[buf] = StagedLoad(start, ready, link, nbytes, timed)

    def acquire(self, buf: int) -> None:
        """Order the compute stream after the load in `buf`."""
        load = self.loads[buf]
        assert load is not None, f"staging buffer {buf} acquired without a load"
        self.loads[buf] = None
        compute = self.streams.compute()
        if load.timed:
            wait_at = self.streams.event()
            wait_at.record(compute)
            self._track(load, wait_at)
        compute.wait_event(load.ready)
        self.poll()

    def drop(self, buf: int) -> None:
        """The load in `buf` will not be used (a stale prefetch): its bytes still
        count, with no wait."""
        load, self.loads[buf] = self.loads[buf], None
        if load is not None and load.timed:
            self._track(load, None)

    def _track(self, load: StagedLoad, wait_at: DeviceEvent | None) -> None:
        with self._lock:
            self._pending.append((load, wait_at))
            overflow = len(self._pending) > MAX_PENDING_TIMINGS
        if overflow:
            self.drain()

    def poll(self) -> None:
        """Account the loads whose events have completed (never waits)."""
        self._resolve(block=False)

    def drain(self) -> None:
        """Account every pending load, waiting for the device (for stats, not the
        decode loop)."""
        self._resolve(block=True)

    def _resolve(self, block: bool) -> None:
        with self._lock:
            while self._pending:
                load, wait_at = self._pending[0]
                events = (
                    (load.start, load.ready)
                    if wait_at is None
                    else (load.start, load.ready, wait_at)
                )
                if block:
                    for e in events:
                        e.synchronize()
                elif not all(e.query() for e in events):
                    return
                self._pending.popleft()
                seconds = load.start.elapsed_time(load.ready) / 1e3
                stall = 0.0 if wait_at is None else wait_at.elapsed_time(load.ready) / 1e3
                self.engine.account(
                    load.link,
                    load.nbytes,
                    max(0.0, seconds),
                    stall_s=max(0.0, stall),
                    waited=wait_at is not None,
                )


class Stager:
    """Two staging buffers and the transfers that fill them."""

    def __init__(
        self,
        tiers: dict[str, Tier],
        layout: BlockLayout,
        device: torch.device,
        staging_tokens: int,
        device_name: str,
    ) -> None:
        bs = layout.block_size
        per_buffer = max(staging_tokens // 2, bs)
        self.tokens_per_buffer = per_buffer - per_buffer % bs
        self.tiers = tiers
        self.layout = layout
        self.device_name = device_name
        self.buffers = [
            (
                cpu_empty(
                    (layout.num_kv_heads, self.tokens_per_buffer, layout.head_dim),
                    layout.dtype,
                    device,
                ),
                cpu_empty(
                    (layout.num_kv_heads, self.tokens_per_buffer, layout.dim_v),
                    layout.dtype,
                    device,
                ),
            )
            for _ in range(2)
        ]
        self.engine = TransferEngine(max_workers=1)
        self._current = 1
        self._inflight: dict[ChunkKey, tuple[Future | None, int]] = {}
        self.streams = streams_for(torch.device(device))
        self.guards: StagingGuards | None = None
        # per quantized memory tier and buffer: its encoded fields, chunk-sized
        self.fields: dict[str, list[dict[str, torch.Tensor]]] = {}
        if self.streams is not None:
            self.guards = StagingGuards(self.streams, self.engine, len(self.buffers))
            self.engine.add_stats_hook(self.guards.drain)
            self.fields = self._field_buffers(device)
            # Allocated on the compute stream, written on the copy stream: when freed,
            # the caching allocator must not hand them out again before the copy
            # stream's work issued by then is done (once per buffer is enough).
            for t in self._device_tensors():
                if t.is_cuda:
                    t.record_stream(self.streams.h2d)

    def _device_tensors(self) -> list[torch.Tensor]:
        tensors = [t for pair in self.buffers for t in pair]
        return tensors + [t for per in self.fields.values() for f in per for t in f.values()]

    def close(self) -> None:
        """Finish the loads in flight: the worker's, and on a device those issued on the
        copy stream (a stale prefetch may still be writing a staging buffer or reading
        a host arena); neither may outlive the cache."""
        self.engine.close()
        if self.streams is not None:
            self.streams.h2d.synchronize()

    def _field_buffers(self, device: torch.device) -> dict[str, list[dict[str, torch.Tensor]]]:
        blocks = self.tokens_per_buffer // self.layout.block_size
        return {
            name: [
                {
                    f"{kind}.{fname}": cpu_empty(
                        (self.layout.num_kv_heads, blocks * spec.rows, spec.cols),
                        spec.dtype,
                        device,
                    )
                    for kind, specs in tier.field_specs.items()
                    for fname, spec in specs.items()
                }
                for _ in self.buffers
            ]
            for name, tier in self.tiers.items()
            if isinstance(tier, MemoryTier) and not tier.zero_copy
        }

    @property
    def nbytes(self) -> int:
        """Device bytes of the staging buffers (and encoded field buffers)."""
        return sum(t.numel() * t.element_size() for t in self._device_tensors())

    def chunks(self, run: Run, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """Chunks of a cold run clipped to tokens [lo, hi): (first_slot, count, base)."""
        bs = self.layout.block_size
        first_block = (lo - run.token_start) // bs
        last_block = (hi - 1 - run.token_start) // bs
        per_chunk = self.tokens_per_buffer // bs
        return [
            (run.first_slot + c0, min(per_chunk, last_block + 1 - c0), run.token_start + c0 * bs)
            for c0 in range(first_block, last_block + 1, per_chunk)
        ]

    def parts(
        self, layer: int, run: Run, lo: int, hi: int, then: ChunkKey | None = None
    ) -> Iterator[tuple[torch.Tensor, ...]]:
        """(k, v) views of the staged keys [lo, hi) of a cold run, chunk by chunk; the
        next chunk loads while the caller attends the current one, and after the last
        chunk `then` (e.g. the next layer's first chunk) starts loading. A view is
        valid until the generator resumes: all work reading it must be issued by then
        (a load into its buffer may start as soon as the generator resumes)."""
        bs = self.layout.block_size
        chunks = self.chunks(run, lo, hi)
        for i, (first, count, base) in enumerate(chunks):
            buf = self._load((layer, run.tier, first, count))
            if i + 1 < len(chunks):
                nxt = chunks[i + 1]
                self.prefetch((layer, run.tier, nxt[0], nxt[1]))
            elif then is not None:
                self.prefetch(then)
            sk, sv = self.buffers[buf]
            a, b = max(lo, base) - base, min(hi, base + count * bs) - base
            yield sk[:, a:b], sv[:, a:b]

    def prefetch(self, key: ChunkKey) -> None:
        """Start loading a chunk into the buffer the attention is not using."""
        if key in self._inflight:
            return
        target = 1 - self._current
        self._drop_inflight(target)
        self._inflight[key] = (self._submit(key, target), target)

    def _submit(self, key: ChunkKey, buf: int) -> Future | None:
        """Start loading chunk `key` into `buf`: a Future of a worker's load, or None
        for a load already issued on the copy stream."""
        layer, tier_name, first, count = key
        tier = self.tiers[tier_name]
        n = count * self.layout.block_size
        bk, bv = self.buffers[buf]
        slots = list(range(first, first + count))
        link = f"{tier_name}->{self.device_name}"
        nbytes = count * tier.block_bytes // self.layout.num_layers
        guards = self.guards
        if guards is not None and isinstance(tier, MemoryTier):
            with guards.loading(buf, link, nbytes):
                self._load_memory(tier, layer, slots, buf)
            return None
        # Worker threads do not inherit inference mode; writing the (inference-mode)
        # staging buffers from one outside it is an error.
        inference = torch.is_inference_mode_enabled()
        issued = guards.issued() if guards is not None else None

        def load() -> None:
            with torch.inference_mode(inference):
                if guards is None:
                    tier.read_layer(layer, slots, bk[:, :n], bv[:, :n])
                    return
                with guards.loading(buf, link, nbytes, timed=False, issued=issued):
                    tier.read_layer(layer, slots, bk[:, :n], bv[:, :n])

        return self.engine.submit(load, link=link, nbytes=nbytes)

    def _load_memory(self, tier: MemoryTier, layer: int, slots: list[int], buf: int) -> None:
        """Issue (on the current stream) the copies of one layer of `slots` into `buf`:
        raw blocks straight into the staging buffer; quantized ones as their fields
        into the encoded buffers, then decoded on the device."""
        n = len(slots) * self.layout.block_size
        bk, bv = self.buffers[buf]
        if tier.zero_copy:
            tier.read_layer(layer, slots, bk[:, :n], bv[:, :n])
            return
        bufs = self.fields[tier.name][buf]
        views = {
            f"{kind}.{fname}": bufs[f"{kind}.{fname}"][:, : len(slots) * spec.rows]
            for kind, specs in tier.field_specs.items()
            for fname, spec in specs.items()
        }
        tier.read_layer_fields(layer, slots, views)
        for kind, out in (("k", bk[:, :n]), ("v", bv[:, :n])):
            enc = {fname: views[f"{kind}.{fname}"] for fname in tier.field_specs[kind]}
            decode_fields(tier.codec, kind, enc, out)

    def _drop_inflight(self, buf: int) -> None:
        """Let a stale (unused) prefetch into `buf` finish before the buffer is reused.
        Its errors are moot: a real load of the same blocks reports them."""
        for other, (fut, target) in list(self._inflight.items()):
            if target == buf:
                del self._inflight[other]
                if fut is not None:
                    with contextlib.suppress(Exception):
                        self.engine.wait(fut)
                if self.guards is not None:
                    self.guards.drop(buf)

    def _load(self, key: ChunkKey) -> int:
        """The buffer holding chunk `key`, waiting for its prefetch if there is one
        (on the host for a worker's load; on the device for a copy-stream load)."""
        hit = self._inflight.pop(key, None)
        if hit is not None:
            fut, buf = hit
        else:
            buf = 1 - self._current
            self._drop_inflight(buf)
            fut = self._submit(key, buf)
        if fut is not None:
            self.engine.wait(fut)
        if self.guards is not None:
            self.guards.acquire(buf)
        self._current = buf
        return buf
