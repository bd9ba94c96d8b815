"""The backend's disk tier (kvstrata's DiskTier), used from one writer thread.

Stored blocks are written through to disk in the background, so vLLM's scheduler never
waits on a disk write; the few disk calls it does wait for (a block read back on a hit,
a slot freed to make room) run on the same thread, so the tier's I/O never
interleaves. Finished writes are queued and applied by the scheduler thread.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

from kvstrata.integrations.vllm.options import VllmOptions
from kvstrata.integrations.vllm.plan import BackendPlan
from kvstrata.tiers.base import Tier
from kvstrata.tiers.disk import DiskTier

T = TypeVar("T")


class DiskWriter:
    """Opens the plan's disk tier (its index found again after a restart) on a thread.

    Args:
        plan: gives the layout, slots, codec and namespaced directory.
        options: disk_compress / disk_o_direct.
    """

    def __init__(self, plan: BackendPlan, options: VllmOptions) -> None:
        self._io = ThreadPoolExecutor(1, thread_name_prefix="kvstrata-disk")
        self._done: deque[tuple[int, BaseException | None]] = deque()
        cache = options.cache
        self.compress = cache.disk_compress
        self.tier: DiskTier = self.call(
            lambda: DiskTier(
                plan.layout,
                plan.disk_slots,
                plan.disk_path,
                codec=plan.disk_codec,
                compress=cache.disk_compress,
                o_direct=cache.disk_o_direct,
            )
        )

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the disk thread and wait for its result."""
        return self._io.submit(fn).result()

    def keyed_slots(self) -> dict[int, bytes]:
        """slot -> key of every block the directory holds (after a restart too)."""
        return self.tier.keyed_slots()

    @property
    def num_free(self) -> int:
        return self.tier.num_free

    def allocate(self, count: int) -> list[int]:
        return self.tier.allocate(count) or []

    def free(self, slot: int) -> None:
        self.call(lambda: self.tier.free([slot]))

    def read_into(self, host: Tier, disk_slot: int, host_slot: int) -> None:
        """Read one block into a host slot, verifying its checksums (TierIOError —
        BlockCorruptError, BlockMissingError — when it cannot be served)."""
        self.call(lambda: copy_blocks(self.tier, [disk_slot], host, [host_slot]))

    def write(
        self,
        host: Tier,
        host_slots: list[int],
        slots: list[int],
        keys: list[bytes],
        token: int,
    ) -> None:
        """Copy host blocks to disk slots and key them, in the background; `token` and
        the error (or None) come back from `finished()`."""

        def write() -> None:
            copy_blocks(host, host_slots, self.tier, slots)
            self.tier.put_keys([(s, k, []) for s, k in zip(slots, keys, strict=True)])

        future = self._io.submit(write)
        future.add_done_callback(lambda f: self._done.append((token, f.exception())))

    def finished(self) -> list[tuple[int, BaseException | None]]:
        """The writes that finished since the last call: (token, error or None)."""
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    def drain(self) -> None:
        """Wait until every write submitted so far has finished."""
        self.call(lambda: None)

    def bytes_per_block(self) -> float:
        """Bytes a block takes on disk (measured when compressed: they vary)."""
        stats = self.tier.stats
        if self.compress and stats.blocks_written:
            return stats.bytes_written / stats.blocks_written
        return self.tier.block_bytes

    def close(self) -> None:
        """Finish the writes, close the tier (index committed, lock released), stop."""
        self.drain()
        self.call(self.tier.close)
        self._io.shutdown(wait=True)


def copy_blocks(src: Tier, src_slots: list[int], dst: Tier, dst_slots: list[int]) -> None:
    """Copy blocks between tiers: encoded as is when the codecs match (a block is
    quantized once), else decoded to the model dtype and encoded again."""
    if src.codec.name == dst.codec.name:
        dst.write_encoded(dst_slots, src.read_encoded(src_slots))
        return
    n = len(src_slots)
    layout = src.layout
    k = torch.empty(layout.raw_shape("k", n), dtype=layout.dtype)
    v = torch.empty(layout.raw_shape("v", n), dtype=layout.dtype)
    src.read_blocks(src_slots, k, v)
    dst.write_blocks(dst_slots, k, v)
