"""Disk hits in the vLLM backend: a whole prefix's blocks read back in one batch, off
the scheduler's path.

vLLM asks `OffloadingManager.lookup` about one block at a time while it scans a
request's prefix; on RETRY it goes on scanning (so the backend can start its reads)
and then defers the request a step — vLLM's asynchronous lookup, which the remote tier
uses the same way. Here:

    step s    lookups: a block only on disk answers RETRY and is queued (`lookup`)
              end of step (`start`): the queued blocks get host slots (the prefix
              that fits; the rest answer MISS next step) and ONE batched read on
              the disk thread copies them in: vectored reads, XXH3 verified,
              compressed slots decompressed across threads, codecs converted in
              torch's threads; the step's end waits for it at most STEP_WAIT_S
    step s+1  lookups: a block read in is a hit (a disk hit: its host copy stays
              pinned until then, `land`), a block that failed its checksum (or was
              missing / unreadable) a miss — dropped and recomputed, never served

The scheduler never blocks on the disk beyond STEP_WAIT_S per step. A read not done
READ_TIMEOUT_S after it started turns its blocks' lookups into misses (the request is
computed instead; the blocks reach the host when the read ends), counted once per
read, and no read is queued behind it while it is stuck.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

from kvstrata.integrations.vllm.disk_writer import DiskWriter
from kvstrata.integrations.vllm.index import BlockIndex, Entry
from kvstrata.integrations.vllm.remote import RETRY, STEP_WAIT_S
from kvstrata.tiers.base import Tier

MISS = "miss"
# A request waits at most this long (seconds) for its disk blocks: then they are misses.
READ_TIMEOUT_S = 10.0
COUNTERS = ("disk_read_batches", "disk_read_blocks", "disk_retries", "disk_no_room")


@dataclass(eq=False)
class Batch:
    """One batched read in flight: `entries[i]` from disk slot `disk_slots[i]`."""

    future: Future
    entries: list[Entry]
    disk_slots: list[int]
    deadline: float
    late: bool = False  # past the deadline (counted once)


class DiskReads:
    """The disk reads of one OffloadStore (scheduler thread only).

    Args:
        disk: the store's disk tier, on its thread.
        host: the host tier the blocks are read into.
        index: the store's index (entries are re-ranked as their state changes).
        counters: the store's counters (with COUNTERS and disk_read_timeouts).
    """

    def __init__(
        self, disk: DiskWriter, host: Tier, index: BlockIndex, counters: dict[str, int]
    ) -> None:
        self.disk, self.host, self.index, self.counters = disk, host, index, counters
        self._wanted: dict[bytes, Entry] = {}  # this step's disk-only lookups, in order
        self._batches: list[Batch] = []
        self._batch_of: dict[bytes, Batch] = {}  # key -> its read in flight
        self._no_room: set[bytes] = set()  # not read for lack of host slots: misses
        self._landed: dict[bytes, tuple[Entry, int]] = {}  # read in, pinned: key -> step
        self._step = 0

    # -- lookups ---------------------------------------------------------------------------
    def lookup(self, entry: Entry) -> str:
        """RETRY or MISS for a block whose host copy is not ready: being read in, or
        on disk only (queued for this step's batch)."""
        batch = self._batch_of.get(entry.key)
        if batch is not None:  # (one that just ended lands at the next reap)
            late = not batch.future.done() and self._is_late(batch)
            return MISS if late else self._retry()
        if entry.key in self._no_room or self.stuck():
            return MISS
        self._wanted[entry.key] = entry
        return self._retry()

    def _retry(self) -> str:
        self.counters["disk_retries"] += 1
        return RETRY

    def _is_late(self, batch: Batch) -> bool:
        if not batch.late and time.monotonic() >= batch.deadline:
            batch.late = True
            self.counters["disk_read_timeouts"] += 1
        return batch.late

    def stuck(self) -> bool:
        """Whether a read is past its deadline (nothing is queued behind it)."""
        return any(self._is_late(b) for b in self._batches if not b.future.done())

    def take(self, entry: Entry) -> bool:
        """Whether a hit on `entry` is on a block just read in from disk: its landing
        pin then becomes the hit's lease (the caller does not pin it again)."""
        return self._landed.pop(entry.key, None) is not None

    # -- the step's batch ------------------------------------------------------------------
    def start(self, room: Callable[[list[Entry]], list[int]]) -> None:
        """Read this step's queued blocks in one batch. `room(entries)` gives host slots
        for the first of them that fit (evicting other host copies)."""
        if not self._batches:
            self._no_room.clear()  # the read that refused them has been looked at
        wanted, self._wanted = list(self._wanted.values()), {}
        wanted = [
            e
            for e in wanted
            if e.disk_ready
            and e.disk_slot is not None
            and e.host_slot is None
            and not (e.reading or e.doomed or e.writing)
        ]
        if not wanted or self.stuck():
            return
        slots = room(wanted)
        entries, rest = wanted[: len(slots)], wanted[len(slots) :]
        self._no_room.update(e.key for e in rest)
        self.counters["disk_no_room"] += len(rest)
        if not entries:
            return
        disk_slots = []
        for entry, slot in zip(entries, slots, strict=True):
            assert entry.disk_slot is not None
            entry.host_slot, entry.reading = slot, True
            self.index.refresh(entry)
            disk_slots.append(entry.disk_slot)
        future = self.disk.read_batch(self.host, disk_slots, slots)
        batch = Batch(future, entries, disk_slots, time.monotonic() + READ_TIMEOUT_S)
        self._batches.append(batch)
        for entry in entries:
            self._batch_of[entry.key] = batch
        self.counters["disk_read_batches"] += 1
        self.counters["disk_read_blocks"] += len(entries)

    def wait(self, timeout: float = STEP_WAIT_S) -> None:
        """Give the reads in flight up to `timeout` seconds: vLLM steps again at once
        while a request waits on them, so let the read have the CPU instead of spinning
        (returns as soon as they are done)."""
        pending = [b.future for b in self._batches if not (b.late or b.future.done())]
        if pending:
            wait_futures(pending, timeout)

    def finished(self) -> list[tuple[Entry, int, BaseException | None]]:
        """The blocks of the reads that ended: (entry, disk slot, error or None)."""
        out: list[tuple[Entry, int, BaseException | None]] = []
        for batch in [b for b in self._batches if b.future.done()]:
            self._batches.remove(batch)
            for entry in batch.entries:
                self._batch_of.pop(entry.key, None)
            error = batch.future.exception()
            bad = {} if error is not None else batch.future.result()
            for i, (entry, slot) in enumerate(zip(batch.entries, batch.disk_slots, strict=True)):
                out.append((entry, slot, error if error is not None else bad.get(i)))
        return out

    # -- landed blocks -----------------------------------------------------------------------
    def land(self, entry: Entry) -> None:
        """A block read in is on the host: pinned until a lookup takes it or a whole
        step's lookups have passed since (so it is not evicted before the request that
        asked for it sees it)."""
        entry.pins += 1
        self.index.refresh(entry)
        self._landed[entry.key] = (entry, self._step)

    def end_step(self) -> list[Entry]:
        """Begin the next step. Returns the blocks that landed before this step's
        lookups began and none of them took: their pins are the caller's to release."""
        expired = [e for e, step in self._landed.values() if step < self._step]
        for entry in expired:
            del self._landed[entry.key]
        self._step += 1
        return expired

    def forget(self, entry: Entry) -> bool:
        """Drop `entry` from what is queued or landed (reset, a dropped copy); True when
        it held a landing pin."""
        self._wanted.pop(entry.key, None)
        return self._landed.pop(entry.key, None) is not None

    def reset(self) -> None:
        """Forget the queue and the landed blocks (their pins are reset by the caller)."""
        self._wanted.clear()
        self._landed.clear()
        self._no_room.clear()
