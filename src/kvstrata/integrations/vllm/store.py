"""The scheduler side's store: host arena + durable disk tier + index, in kvstrata terms.

`manager.py` adapts it to vLLM's OffloadingManager. Every call comes from vLLM's
scheduler thread; the disk tier lives on its writer thread (disk_writer.py).

Safety (what a hit promises): `lookup` answers "hit" only for a block whose host copy
is complete and which stays pinned until vLLM has loaded it (or the step ends). A
block only on disk is first read back into a host slot — with the rest of its prefix,
in one batch between two steps (disk_reads.py: the lookup answers RETRY meanwhile) —
which verifies its XXH3 checksums; a block that fails (corrupt, missing, unreadable)
is dropped and answered "miss": vLLM recomputes it, and never sees a failed load.

The scheduler never hangs on the disk: its calls run on a writer thread, and the
scheduler waits only a few milliseconds per step for a batched read (past
READ_TIMEOUT_S its blocks are misses) or for a drain (DRAIN_TIMEOUT_S,
CLOSE_TIMEOUT_S). When the disk tier fails as a whole (a slot cannot be freed, an
unexpected error) it is logged once and the store goes on from the host tier alone
(`degraded`).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvstrata.core.errors import TierIOError
from kvstrata.integrations.vllm.backend_plan import BackendPlan
from kvstrata.integrations.vllm.disk_reads import COUNTERS as READ_COUNTERS
from kvstrata.integrations.vllm.disk_reads import DiskReads
from kvstrata.integrations.vllm.disk_writer import DiskWriter, make_room
from kvstrata.integrations.vllm.index import BlockIndex, Entry
from kvstrata.integrations.vllm.options import VllmOptions
from kvstrata.integrations.vllm.remote import ABSENT, RETRY, VllmRemote

log = logging.getLogger(__name__)
HIT, PENDING, MISS = "hit", "pending", "miss"  # and RETRY: a disk / remote read is under way
COUNTERS = (
    "lookups", "hits_host", "hits_disk", "misses", "pending", "corrupt_refused", "stored",
    "disk_written", "disk_write_errors", "evicted_host", "evicted_disk", "store_refused",
    "found_on_disk", "disk_read_timeouts", "disk_degraded", "hits_remote", "remote_retries",
    "remote_no_room", *READ_COUNTERS,
)  # fmt: skip
DRAIN_TIMEOUT_S = 60.0
CLOSE_TIMEOUT_S = 60.0


class OffloadStore:
    """Blocks by key on a shared host tier and an optional disk tier.

    Args:
        plan: the engine's BackendPlan (layout, codecs, slots, paths); named here with
            the model identity the worker published in the host arena's header.
        options: the validated settings (disk flags, stats file).
    """

    def __init__(self, plan: BackendPlan, options: VllmOptions) -> None:
        self.options = options
        self.index = BlockIndex(options.cache.policy)
        self.host = plan.host_tier(create=False)
        self.plan = plan.named(self.host.region.identity)
        self.disk: DiskWriter | None = None
        self.reads: DiskReads | None = None  # disk hits, read back in batches
        self.degraded = False  # the disk tier failed: host only from then on
        self._writes: dict[int, list[Entry]] = {}  # disk writes in flight, by token
        self._tokens = itertools.count()
        self._leased: dict[bytes, str] = {}  # this step's hits -> tier they came from
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.evicted_vllm_keys: list[tuple[str, bytes]] = []  # (tier, key) for vLLM events
        self.disk_stored_vllm_keys: list[bytes] = []  # written through to disk, for events
        self._dirty = True
        self._closed = False
        self.removed_namespaces: list[str] = []  # other namespaces make_room removed
        if self.plan.disk_path is not None:
            self.removed_namespaces = make_room(self.plan, options.cache.disk_budget)
            self.disk = DiskWriter(self.plan, options)
            self.reads = DiskReads(self.disk, self.host, self.index, self.counters)
            for slot, key in sorted(self.disk.keyed_slots().items()):
                entry = self.index.add(key, None)
                entry.disk_slot, entry.disk_ready = slot, True
                self.index.refresh(entry)
            self.counters["found_on_disk"] = len(self.index)
        self.remote = VllmRemote(self.plan, options) if options.cache.remote_url else None

    # -- lookups and loads ---------------------------------------------------------------
    def lookup(self, key: bytes, vllm_key: bytes | None = None) -> str:
        """HIT (deliverable and pinned until loaded or the step ends), PENDING (being
        stored), RETRY (being read from the disk or the remote tier: ask again next
        step) or MISS."""
        self._reap()
        self.counters["lookups"] += 1
        entry = self.index.get(key)
        if key in self._leased:
            return HIT
        tier = "host"
        if entry is None and self.remote is not None and vllm_key is not None:
            found = self._from_remote(key, vllm_key)
            if not isinstance(found, Entry):
                return found or self._count(MISS)
            entry, tier = found, "remote"
        if entry is None or entry.doomed:
            return self._count(MISS)
        if entry.host_slot is not None and not entry.host_ready and not entry.reading:
            return self._count(PENDING)
        if not entry.host_ready:
            if self.reads is None or self.degraded or not (entry.disk_ready or entry.reading):
                return self._count(MISS)
            result = self.reads.lookup(entry)  # RETRY while its batched read is under way
            return self._count(MISS) if result == MISS else result
        if self.reads is not None and self.reads.take(entry):
            tier = "disk"  # read in for this lookup: its landing pin is the lease
        else:
            entry.pins += 1
        self._leased[key] = tier
        self.index.touch(entry)
        self.counters[f"hits_{tier}"] += 1
        self._dirty = True
        return HIT

    def _from_remote(self, key: bytes, vllm_key: bytes) -> Entry | str | None:
        """A block of the remote tier installed in a host slot (its entry), RETRY while
        it is being asked for, or None (a miss)."""
        assert self.remote is not None
        result, fields = self.remote.lookup(key, vllm_key)
        if result == RETRY:
            self.counters["remote_retries"] += 1
            return RETRY
        if result == ABSENT or fields is None:
            return None
        slots = self._host_slots(1, {key})
        if slots is None:
            self.counters["remote_no_room"] += 1
            return None
        try:
            self.remote.write_into(self.host, slots[0], fields)
        except Exception:  # noqa: BLE001 - a block that cannot be installed is recomputed
            log.exception("kvstrata: a remote block could not be installed: recomputed")
            self.host.free(slots)
            return None
        entry = self.index.add(key, vllm_key)
        entry.host_slot, entry.host_ready = slots[0], True
        self.index.refresh(entry)
        if self.disk is not None and not self.degraded:
            self._write_through([entry])
        return entry

    def source(self, key: bytes) -> str:
        """The tier this step's hit on `key` came from ("host", "disk" or "remote")."""
        return self._leased.get(key, "host")

    def prepare_load(self, keys: Sequence[bytes]) -> list[int]:
        """Host slots of `keys` (all hits of this step), pinned until complete_load."""
        slots = []
        for key in keys:
            entry = self.index.entries[key]
            assert entry.host_ready, "prepare_load of a block that was not a hit"
            entry.pins += 1
            self.index.refresh(entry)
            slots.append(entry.host_slot)
        return slots

    def complete_load(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            entry = self.index.entries.get(key)
            if entry is not None and entry.pins > 0:
                entry.pins -= 1
                self.index.refresh(entry)

    def touch(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            entry = self.index.get(key)
            if entry is not None:
                self.index.touch(entry)

    def end_step(self) -> None:
        """Start this step's batched disk read (the leases still protect this step's
        hits from its evictions), release the leases and the unclaimed landing pins;
        write the stats file when something changed."""
        self._reap()
        if self.reads is not None and not self.degraded:
            self.reads.start(self._read_room)
        for key in self._leased:
            entry = self.index.get(key)
            if entry is not None:
                entry.pins -= 1
                self.index.refresh(entry)
        self._leased.clear()
        if self.reads is not None:
            for entry in self.reads.end_step():
                entry.pins -= 1
                self.index.refresh(entry)
            self.reads.wait()
            self._reap()  # what lands now is pinned through the next step's lookups
        if self.remote is not None and self.remote.end_step():
            self._dirty = True
        if self._dirty:
            self.write_stats()

    def _read_room(self, entries: list[Entry]) -> list[int]:
        """Host slots for the first of `entries` that fit (evicting other copies)."""
        protect = {e.key for e in entries}
        fit = self.index.room("host", len(entries), self.host.num_free, protect)
        return (self._host_slots(fit, protect) or []) if fit else []

    def _read_done(self, entry: Entry, error: BaseException | None) -> None:
        """Apply a finished read: the block is on the host (pinned until looked up), or
        dropped."""
        entry.reading = False
        if error is None and not entry.doomed:
            entry.host_ready = True
            self.index.refresh(entry)
            assert self.reads is not None
            self.reads.land(entry)
            return
        if isinstance(error, TierIOError):
            log.warning("kvstrata: a disk block was not served, it is recomputed: %s", error)
            self.counters["corrupt_refused"] += 1
        elif error is not None:
            self._degrade(f"reading a block failed: {error!r}")
        self._drop(entry, "host")
        self._drop(entry, "disk")

    # -- stores --------------------------------------------------------------------------
    def prepare_store(
        self, keys: Sequence[bytes], vllm_keys: Sequence[bytes]
    ) -> tuple[list[bytes], list[int]] | None:
        """(keys to store, their host slots) for the keys not stored yet — the first
        ones that fit when the host tier cannot take them all (vLLM stores the rest
        never: a prefix stored is what a later lookup can use) — or None when no host
        slot can be had (every copy pinned)."""
        self._reap()
        new = [(k, v) for k, v in zip(keys, vllm_keys, strict=True) if k not in self.index.entries]
        new = list(dict(new).items())  # a key offered twice is stored once
        if not new:
            return [], []
        protect = set(keys)
        room = self.index.room("host", len(new), self.host.num_free, protect)
        if self.remote is not None:  # the remote cost rule times prefill steps
            self.remote.computed([v for _, v in new])
        if room < len(new):
            self.counters["store_refused"] += len(new) - room
            new = new[:room]
        if not new:
            return None
        slots = self._host_slots(len(new), protect)
        assert slots is not None
        for (key, vllm_key), slot in zip(new, slots, strict=True):
            entry = self.index.add(key, vllm_key)
            entry.host_slot = slot
        return [k for k, _ in new], slots

    def complete_store(self, keys: Sequence[bytes], success: bool) -> list[bytes]:
        """Mark stored blocks ready (and write them through to disk); on failure drop
        them. Returns the vLLM keys now stored."""
        stored: list[Entry] = []
        for key in keys:
            entry = self.index.get(key)
            if entry is None or entry.host_slot is None or entry.host_ready or entry.reading:
                continue
            if success:
                entry.host_ready = True
                self.index.refresh(entry)
                stored.append(entry)
            else:
                self._drop(entry, "host")
        self.counters["stored"] += len(stored)
        self._dirty = True
        if stored and self.disk is not None and not self.degraded:
            self._write_through(stored)
        if stored and self.remote is not None:
            self.remote.offer(self.host, [(e.host_slot, e.vllm_key) for e in stored if e.vllm_key])
        return [e.vllm_key for e in stored if e.vllm_key is not None]

    def _write_through(self, entries: list[Entry]) -> None:
        assert self.disk is not None
        entries = [e for e in entries if e.disk_slot is None]
        shortfall = len(entries) - self.disk.num_free
        protect = {e.key for e in entries}
        # as many copies as can go (their frees are queued, never waited for); the
        # blocks that still find no disk slot stay on the host only
        self.index.evict("disk", shortfall, protect, self._drop, partial=True)
        entries = entries[: self.disk.num_free]
        slots = self.disk.allocate(len(entries))
        if not slots:
            return
        for entry, slot in zip(entries, slots, strict=True):
            entry.disk_slot, entry.writing = slot, True
            self.index.refresh(entry)
        token = next(self._tokens)
        self._writes[token] = entries
        self.disk.write(
            self.host, [e.host_slot for e in entries], slots, [e.key for e in entries], token
        )

    def _reap(self) -> None:
        """Apply the disk calls that finished (on the writer thread): writes, failed
        frees, reads that had timed out."""
        if self.disk is None:
            return
        for token, error in self.disk.finished():
            if token is None:  # a slot's index row could not be dropped
                self._degrade(f"freeing a disk slot failed: {error}")
                continue
            entries = self._writes.pop(token)
            if error is not None:
                log.warning("kvstrata: blocks were not written to disk: %s", error)
                self.counters["disk_write_errors"] += len(entries)
            else:
                self.counters["disk_written"] += len(entries)
            for entry in entries:
                entry.writing = False
                if error is None and not self.degraded:
                    entry.disk_ready = True
                    self.index.refresh(entry)
                    if entry.vllm_key is not None:
                        self.disk_stored_vllm_keys.append(entry.vllm_key)
                else:
                    self._drop(entry, "disk")
                if entry.doomed:
                    self._drop(entry, "host")
                    self._drop(entry, "disk")
            self._dirty = True
        assert self.reads is not None
        for entry, _, error in self.reads.finished():
            self._read_done(entry, error)
            self._dirty = True

    def _degrade(self, reason: str) -> None:
        """The disk tier failed: log it once and serve from the host tier only (the
        disk copies are forgotten, no disk call is made again but closing)."""
        if self.degraded:
            return
        self.degraded = True
        self.counters["disk_degraded"] = 1
        log.error(
            "kvstrata: the disk tier %s failed (%s); serving from the host tier only from now on",
            self.plan.disk_path,
            reason,
        )
        for entry in list(self.index.on("disk")):
            if not entry.writing:  # a write in flight is forgotten when it finishes
                self._drop(entry, "disk")

    # -- room ----------------------------------------------------------------------------
    def _host_slots(self, count: int, protect: set[bytes]) -> list[int] | None:
        """`count` host slots, evicting the lowest-ranked host copies; None when not
        enough can be evicted."""
        if not self.index.evict("host", count - self.host.num_free, protect, self._drop):
            return None
        return self.host.allocate(count)

    def _drop(self, entry: Entry, tier: str) -> None:
        """Drop one copy of a block (and the entry when it was the last). A disk slot
        is freed without waiting (not at all once the disk tier is degraded)."""
        if tier == "host":
            if entry.host_slot is None:
                return
            if self.reads is not None and self.reads.forget(entry):
                entry.pins -= 1  # its landing pin
            self.host.free([entry.host_slot])
            entry.host_slot, entry.host_ready = None, False
        else:
            if entry.disk_slot is None:
                return
            slot, entry.disk_slot, entry.disk_ready = entry.disk_slot, None, False
            if self.disk is not None and not self.degraded:
                try:
                    self.disk.free(slot)
                except TierIOError as exc:  # defensive: frees are queued, never raised here
                    self._degrade(f"freeing a disk slot failed: {exc}")
        self.counters[f"evicted_{tier}"] += 1
        if entry.vllm_key is not None:
            self.evicted_vllm_keys.append((tier, entry.vllm_key))
        if entry.host_slot is None and entry.disk_slot is None:
            self.index.remove(entry)
        else:
            self.index.refresh(entry)

    def _count(self, result: str) -> str:
        self.counters["misses" if result == MISS else "pending"] += 1
        self._dirty = True
        return result

    # -- lifecycle -----------------------------------------------------------------------
    def reset(self) -> None:
        """Drop every block, host and disk (vLLM's reset_prefix_cache with the connector).
        A block with disk I/O in flight (past DRAIN_TIMEOUT_S) is dropped when it ends."""
        self.drain()
        if self.reads is not None:
            self.reads.reset()  # before the pins are: the landing pins go with them
        for entry in list(self.index.entries.values()):
            entry.pins = 0
            if entry.writing or entry.reading:
                entry.doomed = True
                self.index.refresh(entry)
                continue
            self._drop(entry, "host")
            self._drop(entry, "disk")
        self._leased.clear()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait for the disk calls in flight (up to `timeout`, default DRAIN_TIMEOUT_S)
        and apply them; False when they did not finish in time."""
        done = True
        if self.disk is not None:
            done = self.disk.drain(DRAIN_TIMEOUT_S if timeout is None else timeout)
            if not done:
                log.warning("kvstrata: the disk writes did not finish within the timeout")
        self._reap()
        return done

    def close(self) -> None:
        """Finish the disk writes, close the disk tier (its index is committed), remove
        the shared file's name, write the stats (idempotent). Never waits on the disk
        longer than CLOSE_TIMEOUT_S."""
        if self.disk is not None and not self._closed:
            deadline = time.monotonic() + CLOSE_TIMEOUT_S
            self.drain(CLOSE_TIMEOUT_S)
            self.disk.close(max(0.0, deadline - time.monotonic()))
        if self.remote is not None and not self._closed:
            self.remote.close()
        self._closed = True
        self.host.close()
        self.write_stats()

    def stats(self) -> dict[str, Any]:
        """Counters, tier occupancy and bytes per block (raw, and as stored per tier)."""
        layout = self.plan.layout
        out: dict[str, Any] = {
            "namespace": self.plan.digest,
            "disk_path": self.plan.disk_path,
            "codecs": {"host": self.plan.host_codec.name, "disk": self._disk_codec_name()},
            "block_tokens": layout.block_size,
            "bytes_per_block": {
                "raw": layout.raw_block_bytes,
                "host": self.host.block_bytes,
                "disk": self._disk_bytes_per_block(),
            },
            "blocks": {
                "host": self.host.num_used,
                "disk": self.plan.disk_slots - self._disk_free(),
            },
            "slots": {"host": self.host.num_slots, "disk": self.plan.disk_slots},
            **self.counters,
        }
        if self.remote is not None:
            out["remote"] = self.remote.stats()
        return out

    def _disk_codec_name(self) -> str | None:
        if self.plan.disk_codec is None:
            return None
        name = self.plan.disk_codec.name
        cache = self.options.cache
        if not cache.disk_compress:
            return name
        return f"{name}+delta+zstd" if cache.disk_delta else f"{name}+zstd"

    def _disk_bytes_per_block(self) -> float | None:
        return None if self.disk is None else self.disk.bytes_per_block()

    def _disk_free(self) -> int:
        return self.plan.disk_slots if self.disk is None else self.disk.num_free

    def write_stats(self) -> None:
        """Rewrite the stats file atomically (when one was asked for)."""
        self._dirty = False
        path = self.options.stats_file
        if path is None:
            return
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(self.stats(), f, indent=1)
            os.replace(tmp, path)
        except OSError as exc:  # statistics never stop serving
            log.warning("kvstrata: cannot write stats_file %s: %s", path, exc)
