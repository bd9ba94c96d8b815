"""Memory tiers: DeviceTier (compute device) and HostTier (CPU RAM, pinned with CUDA).

Each keeps, per kind (K/V) and codec field, one preallocated arena

    [num_layers, num_kv_heads, num_slots * rows, cols]

(see kvstrata.core.layout). With the `none` codec a run of consecutive slots of one
layer is a zero-copy `[Hkv, run_tokens, D]` view that attention kernels take as is.
Reads and writes of arbitrary slot lists are one `index_select` / `index_copy_` per
arena, never a Python loop per block.

Pinned host arenas: with CUDA the host tier's arenas are page-locked once, at
construction, so copies to and from the device are DMA transfers that run
asynchronously on a copy stream (`non_blocking=True`) at the link's full rate. Each
arena is ordinary pageable memory of exactly its size, registered with
`cudaHostRegister` (`pinned_empty`, kvstrata.platform.host_memory; torch's pinned
allocator would round it up to a power of two: a 70 GiB budget would lock 128 GiB)
and unregistered before it is freed. When CUDA refuses to lock that much memory the
tier falls back to pageable arenas (correct, but such copies are synchronous and
slower) and says so in `pinned`.

NUMA: a host arena (and a CPU device's) may be bound to NUMA nodes, `numa=(nodes,
policy)` (kvstrata.platform.numa, chosen by the store's `numa` setting): its pages come
from there whoever touches them first.

Writes from a GPU into a host tier: quantizing codecs encode where the data is (on
the GPU: only the encoded bytes cross PCIe), then the copies into the arena run on
the device's d2h copy stream, after an event recorded on the caller's (compute)
stream: one asynchronous DMA per (run, layer, head) slice, since each slice of an
arena run is contiguous where the run as a whole is not (see `copy_async`). A
non-blocking copy to the host returns before the bytes have landed, so the tier keeps
the last event recorded after such writes on each copy stream: its CPU-side reads
wait for all of them (`_await_device_writes`), its device-side reads order the
reader's stream after them without blocking the host (`_order_device_reads`).
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import torch

from kvstrata.codecs.base import Codec, NoneCodec
from kvstrata.core.layout import KINDS, BlockLayout, FieldSpec
from kvstrata.core.slots import slot_runs
from kvstrata.platform.host_memory import Numa, cpu_empty, pinned_empty
from kvstrata.platform.memory_pressure import release_pages
from kvstrata.platform.streams import DeviceEvent, DeviceStreams, streams_for
from kvstrata.tiers.base import Encoded, Tier

# Up to this many runs of consecutive slots, a raw read/write is one strided copy per
# run; beyond, one index_select / index_copy_ (slower per byte, but one call).
MAX_RUN_COPIES = 256


def resolve_device(device: str = "auto") -> torch.device:
    """ "auto" -> cuda when present, else cpu."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class MemoryTier(Tier):
    """A tier whose arenas are torch tensors on one device."""

    def __init__(
        self,
        name: str,
        layout: BlockLayout,
        num_slots: int,
        codec: Codec | None = None,
        device: torch.device | str = "cpu",
        pin_memory: bool = False,
        numa: Numa | None = None,
    ) -> None:
        codec = codec or NoneCodec()
        super().__init__(name, layout, num_slots, codec)
        self.device = torch.device(device)
        self.numa = numa if self.device.type == "cpu" else None  # (nodes, policy) or None
        self.field_specs = {kind: codec.fields(kind, layout) for kind in KINDS}
        self.arenas: dict[str, torch.Tensor] = {}
        self.pinned = pin_memory
        # copy stream -> (its DeviceStreams, the event after the last GPU -> arena copy
        # issued on it): see _scatter_from_device. Empty without CUDA.
        self._device_writes: dict[Any, tuple[DeviceStreams, DeviceEvent]] = {}
        self._copy_streams: dict[torch.device, DeviceStreams] = {}
        try:
            self._allocate(num_slots, pin_memory)
        except RuntimeError as err:
            if not pin_memory:
                raise
            # cudaHostRegister refused (locked-memory limit, or no driver): pageable
            # arenas still work, only their device copies are synchronous.
            warnings.warn(
                f"{name} tier: could not pin {num_slots * self.block_bytes:,} bytes of host "
                f"memory ({str(err).splitlines()[0]}); using pageable memory: transfers to "
                "the device will be synchronous and slower",
                RuntimeWarning,
                stacklevel=3,
            )
            self.arenas.clear()
            self.pinned = False
            self._allocate(num_slots, False)
        self.zero_copy = isinstance(codec, NoneCodec)
        # Raw arenas for the `none` codec: attention and token writes go straight here.
        self.k_arena = self.arenas["k.data"] if self.zero_copy else None
        self.v_arena = self.arenas["v.data"] if self.zero_copy else None

    def _allocate(self, num_slots: int, pin_memory: bool) -> None:
        layout = self.layout
        for kind, specs in self.field_specs.items():
            for fname, spec in specs.items():
                shape = (layout.num_layers, layout.num_kv_heads, num_slots * spec.rows, spec.cols)
                self.arenas[f"{kind}.{fname}"] = (
                    pinned_empty(shape, spec.dtype, self.numa)
                    if pin_memory
                    else cpu_empty(shape, spec.dtype, self.device, self.numa)
                )

    def release_slots(self, slots: list[int]) -> int:
        """Give the memory of these (free) slots back to the kernel: the whole pages of
        each slot run in every (layer, head) row of every arena. A CPU arena's only
        (pinned ones stay locked; a GPU's stay with its allocator). Returns the bytes
        released; the slots read as zeros until written again."""
        if self.pinned or self.device.type != "cpu" or not slots:
            return 0
        released = 0
        for key, arena in self.arenas.items():
            if not arena.is_contiguous() or arena.numel() == 0:
                continue
            kind, _, fname = key.partition(".")
            slot_bytes = self.field_specs[kind][fname].rows * arena.shape[-1] * arena.itemsize
            strip_bytes = arena.stride(1) * arena.itemsize  # one (layer, head) row
            base = arena.data_ptr()
            for _, first, count in slot_runs(sorted(slots)):
                for strip in range(arena.shape[0] * arena.shape[1]):
                    start = base + strip * strip_bytes + first * slot_bytes
                    released += release_pages(start, count * slot_bytes)
        return released

    # -- index helpers -------------------------------------------------------------------
    def _rows_index(self, slots: list[int], rows: int) -> torch.Tensor:
        """Row indices of `slots` in an arena with `rows` rows per slot, in slot order."""
        base = torch.as_tensor(slots, dtype=torch.long).unsqueeze(1) * rows
        return (base + torch.arange(rows)).reshape(-1).to(self.device)

    # -- zero-copy access (codec `none` only) ----------------------------------------------
    def layer_view(
        self, layer: int, first_slot: int, num_slots: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a run of consecutive slots of one layer: [Hkv, n*bs, D] views."""
        if self._device_writes:  # a CPU reader (attention in place): the bytes must be there
            self._await_device_writes()
        bs = self.layout.block_size
        lo, hi = first_slot * bs, (first_slot + num_slots) * bs
        return self.k_arena[layer, :, lo:hi], self.v_arena[layer, :, lo:hi]

    # -- Tier protocol ---------------------------------------------------------------------
    def write_blocks(self, slots: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        n = len(slots)
        if n == 0:
            return
        lead = (self.layout.num_layers, self.layout.num_kv_heads)
        for kind, raw in (("k", k), ("v", v)):
            for fname, spec, data in self._stored(kind, raw, lead):
                self._scatter(f"{kind}.{fname}", slots, spec.rows, data)
        self.stats.blocks_written += n
        self.stats.bytes_written += n * self.block_bytes

    def write_layer(self, layer: int, slots: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        if not slots:
            return
        n = len(slots)
        for kind, raw in (("k", k), ("v", v)):
            for fname, spec, data in self._stored(kind, raw, (self.layout.num_kv_heads,)):
                key = f"{kind}.{fname}"
                if data.device != self.device:  # a GPU's data into a host arena
                    self._scatter(key, slots, spec.rows, data, layer)
                    continue
                arena = _indexable(self.arenas[key][layer])
                arena.index_copy_(1, self._rows_index(slots, spec.rows), _indexable(data))
        self.stats.bytes_written += n * self.block_bytes // self.layout.num_layers

    def _stored(
        self, kind: str, raw: torch.Tensor, lead: tuple[int, ...]
    ) -> list[tuple[str, FieldSpec, torch.Tensor]]:
        """(field, spec, tensor) of raw K or V [*lead, n*bs, D] as this tier stores it.

        Encoded where the data is when that is a GPU (a host tier then receives the
        encoded bytes), else on the tier's device. Data bound from a GPU to this
        (host) tier stays on the GPU here: `_scatter` copies it into the arena."""
        specs = self.field_specs[kind]
        to_host = raw.is_cuda and self.device.type == "cpu"
        if self.zero_copy:
            data = raw if to_host else raw.to(self.device, non_blocking=True)
            return [("data", specs["data"], data)]
        where = raw.device if to_host else self.device
        raw = raw.to(where, non_blocking=True)  # a no-op or host -> device: safe
        blocks = raw.shape[-2] // self.layout.block_size
        enc = {
            fname: torch.empty(
                (*lead, blocks * spec.rows, spec.cols), dtype=spec.dtype, device=where
            )
            for fname, spec in specs.items()
        }
        self.codec.encode(kind, raw, enc)
        return [(fname, spec, enc[fname]) for fname, spec in specs.items()]

    def _await_device_writes(self) -> None:
        """Block until every copy from a GPU into the arenas has landed (CPU readers and
        writers: a late DMA would otherwise overwrite what they write)."""
        if not self._device_writes:
            return
        pending = list(self._device_writes.values())
        self._device_writes.clear()
        for _, event in pending:
            event.synchronize()

    def _order_device_reads(self) -> None:
        """A device-side reader of the arenas (a copy into a GPU tensor, issued on the
        caller's current stream: the compute stream, or the stager's copy stream) runs
        after the pending copies from a GPU; the host does not wait."""
        for streams, event in self._device_writes.values():
            streams.compute().wait_event(event)

    def _streams_of(self, device: torch.device) -> DeviceStreams:
        streams = self._copy_streams.get(device)
        if streams is None:
            streams = self._copy_streams[device] = streams_for(device)
            assert streams is not None, f"{device} has no copy streams"
        return streams

    def _copy_runs(
        self,
        key: str,
        slots: list[int],
        rows: int,
        other: torch.Tensor,
        layer: int | None = None,
        into_arena: bool = False,
    ) -> bool:
        """Copy between the arena rows of `slots` and `other` (rows in slot order): one
        strided copy per run of consecutive slots (an index_select / index_copy_
        gather moves far fewer bytes per second). False, having copied nothing, when
        there are more than MAX_RUN_COPIES runs (the caller then uses index ops)."""
        runs = slot_runs(slots)
        if len(runs) > MAX_RUN_COPIES:
            return False
        arena = _indexable(self.arenas[key] if layer is None else self.arenas[key][layer])
        other = _indexable(other)
        dim = 2 if layer is None else 1
        for j, first, count in runs:
            a = arena.narrow(dim, first * rows, count * rows)
            o = other.narrow(dim, j * rows, count * rows)
            if into_arena:
                copy_async(a, o)
            else:
                copy_async(o, a)
        return True

    def _scatter(
        self, key: str, slots: list[int], rows: int, data: torch.Tensor, layer: int | None = None
    ) -> None:
        """Arena rows of `slots` (all layers, or one `layer`) <- data, from any device."""
        if data.is_cuda and self.device.type == "cpu":
            self._scatter_from_device(key, slots, rows, data, layer)
            return
        if self._device_writes:  # a CPU write after pending GPU writes (a reused slot)
            self._await_device_writes()
        if not self._copy_runs(key, slots, rows, data, layer, into_arena=True):
            self._index_scatter(key, slots, rows, data, layer)

    def _index_scatter(
        self, key: str, slots: list[int], rows: int, data: torch.Tensor, layer: int | None
    ) -> None:
        idx = self._rows_index(slots, rows)
        arena = self.arenas[key] if layer is None else self.arenas[key][layer]
        # .to() blocks for a device -> host copy: index_copy_ reads it at once
        src = _indexable(data.to(self.device))
        _indexable(arena).index_copy_(2 if layer is None else 1, idx, src)

    def _scatter_from_device(
        self, key: str, slots: list[int], rows: int, data: torch.Tensor, layer: int | None
    ) -> None:
        """`_scatter` of a GPU tensor into this host tier, without blocking the host or
        the compute stream: on the device's d2h copy stream, after an event recorded
        on the caller's (compute) stream, which produced `data`, one non-blocking copy
        per slice into the pinned arena. The event recorded after them is what the
        arena's readers wait for. `data` must not be overwritten by later work on the
        compute stream (callers pass temporaries: encoded fields, gathered blocks);
        the caching allocator is told not to reuse its memory before the copies ran."""
        streams = self._streams_of(data.device)
        ready = streams.event()
        ready.record(streams.compute())
        d2h = streams.d2h
        with streams.use(d2h):
            d2h.wait_event(ready)
            if not self._copy_runs(key, slots, rows, data, layer, into_arena=True):
                self._index_scatter(key, slots, rows, data, layer)  # many runs: blocking
            if data.is_cuda:
                data.record_stream(d2h)
            done = streams.event()
            done.record(d2h)
        self._device_writes[d2h] = (streams, done)

    def _gather(
        self, key: str, slots: list[int], rows: int, layer: int | None = None
    ) -> torch.Tensor:
        arena = self.arenas[key] if layer is None else self.arenas[key][layer]
        runs = slot_runs(slots)
        if len(runs) > 1 and arena.dtype != _indexable(arena).dtype:
            picked = _indexable(arena).index_select(
                2 if layer is None else 1, self._rows_index(slots, rows)
            )
            return picked.view(arena.dtype)
        dim = 2 if layer is None else 1
        if len(runs) == 1:
            _, first, count = runs[0]
            return arena.narrow(dim, first * rows, count * rows)
        return arena.index_select(dim, self._rows_index(slots, rows))

    def _copy_out(self, key: str, slots: list[int], out: torch.Tensor, layer: int | None) -> None:
        """Raw arena rows of `slots` into `out`."""
        bs = self.layout.block_size
        if not self._copy_runs(key, slots, bs, out, layer):
            out.copy_(self._gather(key, slots, bs, layer), non_blocking=True)

    def read_blocks(self, slots: list[int], k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        self._read(slots, k_out, v_out, layer=None)

    def read_layer(
        self, layer: int, slots: list[int], k_out: torch.Tensor, v_out: torch.Tensor
    ) -> None:
        self._read(slots, k_out, v_out, layer=layer)

    def _read(
        self, slots: list[int], k_out: torch.Tensor, v_out: torch.Tensor, layer: int | None
    ) -> None:
        if not slots:
            return
        if self._device_writes:
            if k_out.device.type == "cpu" or not self.zero_copy:  # CPU-side reads or decode
                self._await_device_writes()
            else:
                self._order_device_reads()
        for kind, out in (("k", k_out), ("v", v_out)):
            if self.zero_copy:
                self._copy_out(f"{kind}.data", slots, out, layer)
                continue
            specs = self.field_specs[kind]
            enc = {
                fname: self._gather(f"{kind}.{fname}", slots, spec.rows, layer)
                for fname, spec in specs.items()
            }
            self.codec.decode(kind, {f: t.to(out.device) for f, t in enc.items()}, out)
        n = len(slots)
        frac = 1 if layer is None else self.layout.num_layers
        self.stats.blocks_read += n
        self.stats.bytes_read += n * self.block_bytes // frac

    def read_layer_fields(self, layer: int, slots: list[int], outs: Encoded) -> None:
        """One layer's stored fields of `slots`, as they are (still encoded), into
        `outs[f"{kind}.{field}"]` [Hkv, n*rows, cols] on any device: one strided
        non-blocking copy per run of consecutive slots. This is how quantized blocks
        cross PCIe compressed, to be decoded on the device where they are used."""
        if not slots:
            return
        if self._device_writes:
            if any(t.device.type == "cpu" for t in outs.values()):
                self._await_device_writes()
            else:
                self._order_device_reads()
        for kind, specs in self.field_specs.items():
            for fname, spec in specs.items():
                key = f"{kind}.{fname}"
                out = outs[key]
                if not self._copy_runs(key, slots, spec.rows, out, layer):
                    out.copy_(self._gather(key, slots, spec.rows, layer), non_blocking=True)
        self.stats.blocks_read += len(slots)
        self.stats.bytes_read += len(slots) * self.block_bytes // self.layout.num_layers

    def read_encoded(self, slots: list[int]) -> Encoded:
        self._await_device_writes()
        out: Encoded = {}
        for kind, specs in self.field_specs.items():
            for fname, spec in specs.items():
                key = f"{kind}.{fname}"
                out[key] = self._gather(key, slots, spec.rows).clone()
        self.stats.blocks_read += len(slots)
        self.stats.bytes_read += len(slots) * self.block_bytes
        return out

    def write_encoded(self, slots: list[int], data: Encoded) -> None:
        for kind, specs in self.field_specs.items():
            for fname, spec in specs.items():
                key = f"{kind}.{fname}"
                src = data[key]
                if not (src.is_cuda and self.device.type == "cpu"):  # see _stored
                    src = src.to(self.device, non_blocking=True)
                self._scatter(key, slots, spec.rows, src)
        self.stats.blocks_written += len(slots)
        self.stats.bytes_written += len(slots) * self.block_bytes


def copy_async(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src, non_blocking=True), with copies between the host and a device of
    strided views split into their 2-D [rows, cols] slices (one per layer and head).

    torch copies a non-contiguous tensor across the link through a contiguous pageable
    temporary: a CPU memcpy, and a transfer that blocks the host (to the host, it also
    synchronises the stream). A run of slots in an arena is such a view (heads apart by
    the whole arena), but each head's rows are contiguous, so slice by slice every copy
    is one asynchronous DMA to or from the pinned arena (Hkv copies per field and run;
    still no Python loop per block). Host-to-host copies are never split."""
    if (dst.device.type == "cpu") != (src.device.type == "cpu") and dst.dim() > 2:
        pairs = _slice_pairs(dst, src)
        if pairs is not None:
            for d, s in pairs:
                d.copy_(s, non_blocking=True)
            return
    dst.copy_(src, non_blocking=True)


def _slice_pairs(
    dst: torch.Tensor, src: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """The contiguous [rows, cols] slices of dst and src, pairwise; None when one copy
    does (both contiguous) or the slices are not contiguous."""
    if (dst.is_contiguous() and src.is_contiguous()) or not (
        _rows_contiguous(dst) and _rows_contiguous(src)
    ):
        return None
    return [(dst[i], src[i]) for i in itertools.product(*map(range, dst.shape[:-2]))]


def _rows_contiguous(t: torch.Tensor) -> bool:
    """Each [rows, cols] slice of t is one contiguous block."""
    return (t.stride(-1) == 1 or t.shape[-1] == 1) and (
        t.stride(-2) == t.shape[-1] or t.shape[-2] == 1
    )


def _indexable(t: torch.Tensor) -> torch.Tensor:
    """index_copy_/index_select have no float8 kernels on the CPU: move such
    tensors as bytes (same element size, so the view is free)."""
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(torch.uint8)
    return t


class DeviceTier(MemoryTier):
    """The compute device's arena (`cuda` when present, else `cpu`)."""

    def __init__(
        self,
        layout: BlockLayout,
        num_slots: int,
        codec: Codec | None = None,
        device: str = "auto",
        numa: Numa | None = None,
    ) -> None:
        super().__init__("device", layout, num_slots, codec, resolve_device(device), numa=numa)


class HostTier(MemoryTier):
    """Host RAM. With CUDA the arena is pinned once, at construction (never per copy).
    `name="cxl"`: the same on CXL memory (a CPU-less NUMA node, bound by `numa`)."""

    def __init__(
        self,
        layout: BlockLayout,
        num_slots: int,
        codec: Codec | None = None,
        numa: Numa | None = None,
        name: str = "host",
    ) -> None:
        pin = torch.cuda.is_available()
        super().__init__(name, layout, num_slots, codec, "cpu", pin_memory=pin, numa=numa)
