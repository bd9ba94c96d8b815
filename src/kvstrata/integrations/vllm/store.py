"""The scheduler side's store: host arena + durable disk tier + index, in kvstrata terms.

`manager.py` adapts it to vLLM's OffloadingManager. Every call comes from vLLM's
scheduler thread; the disk tier lives on its writer thread (disk_writer.py).

Safety (what a hit promises): `lookup` answers "hit" only for a block whose host copy
is complete and which stays pinned until vLLM has loaded it (or the step ends). A
block only on disk is first read back into a host slot — which verifies its XXH3
checksums — and a block that fails (corrupt, missing, unreadable) is dropped and
answered "miss": vLLM recomputes it, and never sees a failed load.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

from kvstrata.errors import TierIOError
from kvstrata.integrations.vllm.disk_writer import DiskWriter
from kvstrata.integrations.vllm.index import BlockIndex, Entry
from kvstrata.integrations.vllm.options import VllmOptions
from kvstrata.integrations.vllm.plan import BackendPlan
from kvstrata.integrations.vllm.region import SharedHostTier

log = logging.getLogger(__name__)
HIT, PENDING, MISS = "hit", "pending", "miss"
COUNTERS = (
    "lookups", "hits_host", "hits_disk", "misses", "pending", "corrupt_refused", "stored",
    "disk_written", "disk_write_errors", "evicted_host", "evicted_disk", "store_refused",
    "found_on_disk",
)  # fmt: skip


class OffloadStore:
    """Blocks by key on a shared host tier and an optional disk tier.

    Args:
        plan: the engine's BackendPlan (layout, codecs, slots, paths).
        options: the validated settings (disk flags, stats file).
    """

    def __init__(self, plan: BackendPlan, options: VllmOptions) -> None:
        self.plan = plan
        self.options = options
        self.index = BlockIndex(options.cache.policy)
        self.host = SharedHostTier(
            plan.layout, plan.host_slots, plan.host_codec, plan.region_path, plan.digest
        )
        self.disk: DiskWriter | None = None
        self._writes: dict[int, list[Entry]] = {}  # disk writes in flight, by token
        self._tokens = itertools.count()
        self._leased: dict[bytes, str] = {}  # this step's hits -> tier they came from
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.evicted_vllm_keys: list[tuple[str, bytes]] = []  # (tier, key) for vLLM events
        self._dirty = True
        self._closed = False
        if plan.disk_path is not None:
            self.disk = DiskWriter(plan, options)
            for slot, key in sorted(self.disk.keyed_slots().items()):
                entry = self.index.add(key, None)
                entry.disk_slot, entry.disk_ready = slot, True
                self.index.refresh(entry)
            self.counters["found_on_disk"] = len(self.index)

    # -- lookups and loads ---------------------------------------------------------------
    def lookup(self, key: bytes) -> str:
        """HIT (deliverable and pinned until loaded or the step ends), PENDING (being
        stored) or MISS."""
        self._reap()
        self.counters["lookups"] += 1
        entry = self.index.get(key)
        if key in self._leased:
            return HIT
        if entry is None:
            return self._count(MISS)
        if entry.host_slot is not None and not entry.host_ready:
            return self._count(PENDING)
        tier = "host"
        if not entry.host_ready:
            if not entry.disk_ready or not self._promote(entry):
                return self._count(MISS)
            tier = "disk"
        entry.pins += 1
        self._leased[key] = tier
        self.index.touch(entry)
        self.counters[f"hits_{tier}"] += 1
        self._dirty = True
        return HIT

    def source(self, key: bytes) -> str:
        """The tier this step's hit on `key` came from ("host" or "disk")."""
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
        """Release this step's hit leases; write the stats file when something changed."""
        self._reap()
        for key in self._leased:
            entry = self.index.get(key)
            if entry is not None:
                entry.pins -= 1
                self.index.refresh(entry)
        self._leased.clear()
        if self._dirty:
            self.write_stats()

    def _promote(self, entry: Entry) -> bool:
        """Read a disk-only block into a host slot, verifying its checksums. False (and
        the block dropped) when it cannot be read; False when no host slot is free."""
        slots = self._host_slots(1, {entry.key})
        if slots is None:
            return False
        entry.host_slot = slots[0]
        try:
            self.disk.read_into(self.host, entry.disk_slot, slots[0])
        except TierIOError as exc:
            log.warning("kvstrata: a disk block was not served, it is recomputed: %s", exc)
            self.counters["corrupt_refused"] += 1
            self._drop(entry, "host")
            self._drop(entry, "disk")
            return False
        entry.host_ready = True
        self.index.refresh(entry)
        return True

    # -- stores --------------------------------------------------------------------------
    def prepare_store(
        self, keys: Sequence[bytes], vllm_keys: Sequence[bytes]
    ) -> tuple[list[bytes], list[int]] | None:
        """(keys to store, their host slots) for the keys not stored yet, or None when
        the host tier has no room (every copy pinned)."""
        self._reap()
        new = [(k, v) for k, v in zip(keys, vllm_keys, strict=True) if k not in self.index.entries]
        new = list(dict(new).items())  # a key offered twice is stored once
        if not new:
            return [], []
        slots = self._host_slots(len(new), set(keys))
        if slots is None:
            self.counters["store_refused"] += 1
            return None
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
            if entry is None or entry.host_slot is None or entry.host_ready:
                continue
            if success:
                entry.host_ready = True
                self.index.refresh(entry)
                stored.append(entry)
            else:
                self._drop(entry, "host")
        self.counters["stored"] += len(stored)
        self._dirty = True
        if stored and self.disk is not None:
            self._write_through(stored)
        return [e.vllm_key for e in stored if e.vllm_key is not None]

    def _write_through(self, entries: list[Entry]) -> None:
        assert self.disk is not None
        entries = [e for e in entries if e.disk_slot is None]
        shortfall = len(entries) - self.disk.num_free
        if shortfall > 0:
            for victim in self.index.victims("disk", shortfall, {e.key for e in entries}):
                self._drop(victim, "disk")
        entries = entries[: self.disk.num_free]  # the rest stay on the host only
        slots = self.disk.allocate(len(entries))
        if not slots:
            return
        for entry, slot in zip(entries, slots, strict=True):
            entry.disk_slot, entry.writing = slot, True
            self.index.refresh(entry)
        token = id(entries)
        self._writes[token] = entries
        self.disk.write(
            self.host, [e.host_slot for e in entries], slots, [e.key for e in entries], token
        )

    def _reap(self) -> None:
        """Apply the disk writes that finished (on the writer thread)."""
        if self.disk is None:
            return
        for token, error in self.disk.finished():
            entries = self._writes.pop(token)
            if error is not None:
                log.warning("kvstrata: blocks were not written to disk: %s", error)
                self.counters["disk_write_errors"] += len(entries)
            else:
                self.counters["disk_written"] += len(entries)
            for entry in entries:
                entry.writing = False
                if error is None:
                    entry.disk_ready = True
                    self.index.refresh(entry)
                else:
                    self._drop(entry, "disk")
            self._dirty = True

    # -- room ----------------------------------------------------------------------------
    def _host_slots(self, count: int, protect: set[bytes]) -> list[int] | None:
        """`count` host slots, evicting the lowest-ranked host copies; None when not
        enough can be evicted."""
        shortfall = count - self.host.num_free
        if shortfall > 0:
            victims = self.index.victims("host", shortfall, protect)
            if len(victims) < shortfall:
                return None
            for victim in victims:
                self._drop(victim, "host")
        return self.host.allocate(count)

    def _drop(self, entry: Entry, tier: str) -> None:
        """Drop one copy of a block (and the entry when it was the last)."""
        if tier == "host":
            if entry.host_slot is None:
                return
            self.host.free([entry.host_slot])
            entry.host_slot, entry.host_ready = None, False
        else:
            if entry.disk_slot is None:
                return
            self.disk.free(entry.disk_slot)
            entry.disk_slot, entry.disk_ready = None, False
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
        """Drop every block, host and disk (vLLM's reset_prefix_cache with the connector)."""
        self.drain()
        for entry in list(self.index.entries.values()):
            entry.pins = 0
            self._drop(entry, "host")
            self._drop(entry, "disk")
        self._leased.clear()

    def drain(self) -> None:
        """Wait for the disk writes in flight and apply them."""
        if self.disk is not None:
            self.disk.drain()
        self._reap()

    def close(self) -> None:
        """Finish the disk writes, close the disk tier (its index is committed), remove
        the shared file's name, write the stats (idempotent)."""
        if self.disk is not None and not self._closed:
            self.drain()
            self.disk.close()
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
        return out

    def _disk_codec_name(self) -> str | None:
        if self.plan.disk_codec is None:
            return None
        name = self.plan.disk_codec.name
        return f"{name}+zstd" if self.options.cache.disk_compress else name

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
