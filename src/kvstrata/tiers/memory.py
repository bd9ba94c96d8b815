"""Memory tiers: DeviceTier (compute device) and HostTier (CPU RAM, pinned with CUDA).

Each keeps, per kind (K/V) and codec field, one preallocated arena

    [num_layers, num_kv_heads, num_slots * rows, cols]

(see kvstrata.layout). With the `none` codec a run of consecutive slots of one
layer is a zero-copy `[Hkv, run_tokens, D]` view that attention kernels take as is.
Reads and writes of arbitrary slot lists are one `index_select` / `index_copy_` per
arena, never a Python loop per block.
"""

from __future__ import annotations

import torch

from kvstrata.codecs.base import Codec, NoneCodec
from kvstrata.layout import KINDS, BlockLayout
from kvstrata.slots import slot_runs
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
    ) -> None:
        codec = codec or NoneCodec()
        super().__init__(name, layout, num_slots, codec)
        self.device = torch.device(device)
        self.pinned = pin_memory
        self.field_specs = {kind: codec.fields(kind, layout) for kind in KINDS}
        self.arenas: dict[str, torch.Tensor] = {}
        for kind, specs in self.field_specs.items():
            for fname, spec in specs.items():
                shape = (layout.num_layers, layout.num_kv_heads, num_slots * spec.rows, spec.cols)
                self.arenas[f"{kind}.{fname}"] = torch.empty(
                    shape, dtype=spec.dtype, device=self.device, pin_memory=pin_memory
                )
        self.zero_copy = isinstance(codec, NoneCodec)
        # Raw arenas for the `none` codec: attention and token writes go straight here.
        self.k_arena = self.arenas["k.data"] if self.zero_copy else None
        self.v_arena = self.arenas["v.data"] if self.zero_copy else None

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
        bs = self.layout.block_size
        lo, hi = first_slot * bs, (first_slot + num_slots) * bs
        return self.k_arena[layer, :, lo:hi], self.v_arena[layer, :, lo:hi]

    # -- Tier protocol ---------------------------------------------------------------------
    def write_blocks(self, slots: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        n = len(slots)
        if n == 0:
            return
        for kind, raw in (("k", k), ("v", v)):
            raw = raw.to(self.device, non_blocking=True)
            specs = self.field_specs[kind]
            if self.zero_copy:
                self._scatter(f"{kind}.data", slots, specs["data"].rows, raw)
                continue
            enc = {
                fname: torch.empty(
                    (self.layout.num_layers, self.layout.num_kv_heads, n * spec.rows, spec.cols),
                    dtype=spec.dtype,
                    device=self.device,
                )
                for fname, spec in specs.items()
            }
            self.codec.encode(kind, raw, enc)
            for fname, spec in specs.items():
                self._scatter(f"{kind}.{fname}", slots, spec.rows, enc[fname])
        self.stats.blocks_written += n
        self.stats.bytes_written += n * self.block_bytes

    def write_layer(self, layer: int, slots: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        if not slots:
            return
        n = len(slots)
        for kind, raw in (("k", k), ("v", v)):
            raw = raw.to(self.device, non_blocking=True)
            specs = self.field_specs[kind]
            if self.zero_copy:
                enc = {"data": raw}
            else:
                enc = {
                    fname: torch.empty(
                        (self.layout.num_kv_heads, n * spec.rows, spec.cols),
                        dtype=spec.dtype,
                        device=self.device,
                    )
                    for fname, spec in specs.items()
                }
                self.codec.encode(kind, raw, enc)
            for fname, spec in specs.items():
                arena = _indexable(self.arenas[f"{kind}.{fname}"][layer])
                arena.index_copy_(1, self._rows_index(slots, spec.rows), _indexable(enc[fname]))
        self.stats.bytes_written += n * self.block_bytes // self.layout.num_layers

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
        gather moves ~10x fewer bytes per second). False, having copied nothing, when
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
            (a if into_arena else o).copy_(o if into_arena else a, non_blocking=True)
        return True

    def _scatter(self, key: str, slots: list[int], rows: int, data: torch.Tensor) -> None:
        if not self._copy_runs(key, slots, rows, data, into_arena=True):
            idx = self._rows_index(slots, rows)
            _indexable(self.arenas[key]).index_copy_(2, idx, _indexable(data))

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

    def read_encoded(self, slots: list[int]) -> Encoded:
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
                self._scatter(key, slots, spec.rows, data[key].to(self.device, non_blocking=True))
        self.stats.blocks_written += len(slots)
        self.stats.bytes_written += len(slots) * self.block_bytes


def _indexable(t: torch.Tensor) -> torch.Tensor:
    """index_copy_/index_select have no float8 kernels on the CPU: move such
    tensors as bytes (same element size, so the view is free)."""
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(torch.uint8)
    return t


class DeviceTier(MemoryTier):
    """The compute device's arena (`cuda` when present, else `cpu`)."""

    def __init__(
        self, layout: BlockLayout, num_slots: int, codec: Codec | None = None, device: str = "auto"
    ) -> None:
        super().__init__("device", layout, num_slots, codec, resolve_device(device))


class HostTier(MemoryTier):
    """Host RAM. With CUDA the arena is pinned once, at construction (never per copy)."""

    def __init__(self, layout: BlockLayout, num_slots: int, codec: Codec | None = None) -> None:
        pin = torch.cuda.is_available()
        super().__init__("host", layout, num_slots, codec, "cpu", pin_memory=pin)
