"""The tier protocol: a preallocated arena of fixed-size block slots.

Tiers speak raw (model-dtype) tensors at their boundary and apply their codec
inside; blocks moved between two tiers with the same codec travel encoded
(`read_encoded` / `write_encoded`) so a lossy block is quantized once, never twice.

Tiers know nothing of policies or sequences: they own slots, bytes, and I/O stats.
"""

from __future__ import annotations

import functools
import threading
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field

import torch

from kvstrata.core.layout import BlockLayout
from kvstrata.platform.numa import NumaPlan

Encoded = dict[str, torch.Tensor]
"""Encoded blocks: key f"{kind}.{field}" -> tensor [L, Hkv, n*rows, cols]."""


@dataclass
class TierStats:
    """Counters a tier keeps; the TransferEngine keeps per-link ones."""

    bytes_written: int = 0
    bytes_read: int = 0
    blocks_written: int = 0
    blocks_read: int = 0
    peak_used_slots: int = 0
    read_errors: int = 0
    extra: dict[str, float] = field(default_factory=dict)


class SlotAllocator:
    """Free slots of one arena.

    Order of the free list (the allocation order, pinned by tests): initially
    ascending slot ids; freed slots go to the back, in the order given. `allocate`
    first tries to continue a run (`after`+1, +2, ...) so a growing sequence keeps
    consecutive slots; otherwise it takes the lowest-numbered run of free slots that
    fits, else the front of the free list.
    """

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._is_free = bytearray(b"\x01") * num_slots
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def free_slots(self) -> list[int]:
        """The free list in allocation order."""
        return list(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int, after: int | None = None) -> list[int] | None:
        """Take `n` slots, or return None when fewer than `n` are free."""
        with self._lock:
            if n > len(self._free):
                return None
            if n == 0:
                return []
            chosen: list[int] = []
            if after is not None:
                s = after + 1
                while len(chosen) < n and s < self.num_slots and self._is_free[s]:
                    chosen.append(s)
                    s += 1
                if len(chosen) < n:
                    chosen = []
            if not chosen and n > 1:
                chosen = self._find_run(n)
            if chosen:
                for s in chosen:
                    self._is_free[s] = 0
                taken = set(chosen)
                self._free = deque(s for s in self._free if s not in taken)
                return chosen
            out = [self._free.popleft() for _ in range(n)]
            for s in out:
                self._is_free[s] = 0
            return out

    def _find_run(self, n: int) -> list[int]:
        run_start, run_len = 0, 0
        for s in range(self.num_slots):
            if self._is_free[s]:
                if run_len == 0:
                    run_start = s
                run_len += 1
                if run_len == n:
                    return list(range(run_start, run_start + n))
            else:
                run_len = 0
        return []

    def take(self, slots: list[int]) -> None:
        """Mark specific slots used (used when reopening a durable tier)."""
        with self._lock:
            for s in slots:
                if not self._is_free[s]:
                    raise AssertionError(f"slot {s} is already in use")
                self._is_free[s] = 0
            taken = set(slots)
            self._free = deque(s for s in self._free if s not in taken)

    def free(self, slots: list[int]) -> None:
        with self._lock:
            for s in slots:
                if self._is_free[s]:
                    raise AssertionError(f"slot {s} freed twice")
                self._is_free[s] = 1
                self._free.append(s)


class Tier(ABC):
    """A preallocated arena of `num_slots` block slots in one kind of memory."""

    name: str
    layout: BlockLayout
    num_slots: int
    numa_plan: NumaPlan | None = None  # the store's NUMA plan, set when the store builds it

    def __init__(self, name: str, layout: BlockLayout, num_slots: int, codec: object) -> None:
        self.name = name
        self.layout = layout
        self.num_slots = num_slots
        self.codec = codec
        self.allocator = SlotAllocator(num_slots)
        self.stats = TierStats()

    # -- slots ------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def num_used(self) -> int:
        return self.allocator.num_used

    @functools.cached_property
    def block_bytes(self) -> int:
        """Stored bytes of one block in this tier (after the codec)."""
        return self.codec.block_nbytes(self.layout)

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.block_bytes

    @property
    def used_bytes(self) -> int:
        return self.num_used * self.block_bytes

    def can_allocate(self, n: int) -> bool:
        return self.allocator.can_allocate(n)

    def allocate(self, n: int, after: int | None = None) -> list[int] | None:
        slots = self.allocator.allocate(n, after)
        if slots is not None:
            self.stats.peak_used_slots = max(self.stats.peak_used_slots, self.num_used)
        return slots

    def free(self, slots: list[int]) -> None:
        self.allocator.free(slots)

    # -- data -------------------------------------------------------------------------
    @abstractmethod
    def write_blocks(self, slots: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Encode and store raw blocks. k, v: [L, Hkv, len(slots)*bs, D] model dtype."""

    @abstractmethod
    def read_blocks(self, slots: list[int], k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        """Decode blocks into k_out, v_out: [L, Hkv, len(slots)*bs, D]."""

    @abstractmethod
    def read_layer(
        self, layer: int, slots: list[int], k_out: torch.Tensor, v_out: torch.Tensor
    ) -> None:
        """Decode one layer of blocks into k_out, v_out: [Hkv, len(slots)*bs, D]."""

    def write_layer(self, layer: int, slots: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Encode and store one layer of full blocks (k, v: [Hkv, len(slots)*bs, D]).

        Used when a long prefill overflows the device: the step's blocks are written
        layer by layer as the model computes them."""
        raise NotImplementedError(f"{self.name} tier cannot be written one layer at a time")

    @abstractmethod
    def read_encoded(self, slots: list[int]) -> Encoded:
        """The stored (encoded) form of blocks, for a move to a tier with the same codec."""

    @abstractmethod
    def write_encoded(self, slots: list[int], data: Encoded) -> None:
        """Store blocks already in this tier's codec format."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release files or handles (durable tiers flush their index)."""
