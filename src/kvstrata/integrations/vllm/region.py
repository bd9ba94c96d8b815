"""The host tier both vLLM processes map: kvstrata's HostTier over a shared file.

vLLM runs the offloading manager in its scheduler process and the worker in a worker
process. The worker encodes pages into host slots and decodes them back; the manager
allocates and evicts the slots, reads them to write the disk tier, and writes blocks
it promotes from disk. So the host tier's arenas live in one file in shared memory
(/dev/shm), mapped by both:

    [ header 4 KiB: magic, plan digest ][ arena k.<field> ][ arena v.<field> ] ...
    arena = [num_layers, num_kv_heads, num_slots * rows, cols] (kvstrata.layout), each
    starting on a 64-byte boundary, in sorted field order

Whichever process comes second removes the file's name once it has mapped it, so
nothing is left in /dev/shm after start-up (the first also removes it when it
closes, in case the second never came). The digest in the header makes two
processes that planned different arenas fail at once instead of reading garbage.
"""

from __future__ import annotations

import contextlib
import mmap
import os

import torch

from kvstrata.codecs.base import Codec
from kvstrata.errors import KvstrataError
from kvstrata.layout import KINDS, BlockLayout
from kvstrata.tiers.base import Tier
from kvstrata.tiers.memory import MemoryTier

HEADER_BYTES = 4096
MAGIC = b"kvstrata-vllm-host-1\n"
ALIGN = 64


class SharedRegion:
    """A file of `nbytes` (plus the header) mapped MAP_SHARED; see the module docstring."""

    def __init__(self, path: str, nbytes: int, digest: str) -> None:
        self.path = path
        size = HEADER_BYTES + nbytes
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            self.created = True
        except FileExistsError:
            fd = os.open(path, os.O_RDWR)
            self.created = False
        try:
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        header = MAGIC + digest.encode() + b"\n"
        have = self._map[: len(header)]
        if have.strip(b"\0") and have != header:
            raise KvstrataError(
                f"{path} holds another host arena ({have!r}, this process planned "
                f"{header!r}): the scheduler and the worker disagree on the kvstrata settings"
            )
        self._map[: len(header)] = header
        if not self.created:
            self.unlink()  # both processes have it mapped: its name is no longer needed
        self.buffer = torch.frombuffer(self._map, dtype=torch.uint8, offset=HEADER_BYTES)

    def unlink(self) -> None:
        """Remove the file's name (the mappings stay valid); a no-op when it is gone."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def arena_bytes(layout: BlockLayout, num_slots: int, codec: Codec) -> int:
    """Bytes of the arenas of a host tier (alignment included)."""
    total = 0
    for _, shape, dtype in _arena_shapes(layout, num_slots, codec):
        total = _aligned(total) + _numel(shape) * torch.empty((), dtype=dtype).element_size()
    return _aligned(total)


def _arena_shapes(
    layout: BlockLayout, num_slots: int, codec: Codec
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    out = []
    for kind in KINDS:
        for fname, spec in sorted(codec.fields(kind, layout).items()):
            shape = (layout.num_layers, layout.num_kv_heads, num_slots * spec.rows, spec.cols)
            out.append((f"{kind}.{fname}", shape, spec.dtype))
    return out


def _aligned(offset: int) -> int:
    return (offset + ALIGN - 1) // ALIGN * ALIGN


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class SharedHostTier(MemoryTier):
    """kvstrata's host tier (codec, slots, reads and writes) with its arenas in a
    SharedRegion. Each process keeps its own slot allocator: only the manager's
    allocates; the worker is told which slots to fill or read.

    Args:
        layout: the block layout (BackendPlan.layout).
        num_slots: host slots (BackendPlan.host_slots).
        codec: the host codec.
        path: the region's file (BackendPlan.region_path).
        digest: the plan digest written into, and checked against, the header.
    """

    def __init__(
        self, layout: BlockLayout, num_slots: int, codec: Codec, path: str, digest: str
    ) -> None:
        super().__init__("host", layout, 0, codec, "cpu")  # empty arenas, replaced below
        Tier.__init__(self, "host", layout, num_slots, codec)
        self.region = SharedRegion(path, arena_bytes(layout, num_slots, codec), digest)
        offset = 0
        self.arenas = {}
        for key, shape, dtype in _arena_shapes(layout, num_slots, codec):
            offset = _aligned(offset)
            nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
            raw = self.region.buffer[offset : offset + nbytes]
            self.arenas[key] = raw.view(dtype).view(shape)
            offset += nbytes
        self.k_arena = self.arenas["k.data"] if self.zero_copy else None
        self.v_arena = self.arenas["v.data"] if self.zero_copy else None

    def close(self) -> None:
        self.region.unlink()
