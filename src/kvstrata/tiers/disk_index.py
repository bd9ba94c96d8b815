"""DiskTier's index: index.sqlite and its in-memory mirror.

    index.sqlite   meta (layout, codec, checksum) + one row per written slot:
                   (slot, checksum per layer, stored bytes per layer, key, token ids)

Every read is verified against the checksums held here, and a slot without a row
holds no block. DiskTier orders the changes around its data writes (a row is dropped
before its slot is rewritten and committed only after the new data), which is what
makes the arena crash safe.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path

import numpy as np

from kvstrata.errors import ConfigError


class DiskIndex:
    """The sqlite index of one arena, mirrored in arrays and dicts for fast lookups.

    Args:
        path: the index.sqlite file (created if needed).
        num_slots: slots in the arena.
        num_layers: layers per block (one checksum and stored length each).
        fsync: synchronous=FULL (power-loss durability) instead of NORMAL.

    Attributes:
        sums: [num_slots, L] uint64 checksum of each stored layer.
        lens: [num_slots, L] int64 stored bytes of each layer (less than a layer's
            bytes: compressed).
        written: [num_slots] bool, the slot has a committed row.
        missing: [num_slots] bool, the row survived but the arena lost its bytes.
    """

    def __init__(self, path: Path, num_slots: int, num_layers: int, fsync: bool) -> None:
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.lock = threading.RLock()
        self.sums = np.zeros((num_slots, num_layers), dtype=np.uint64)
        self.lens = np.zeros((num_slots, num_layers), dtype=np.int64)
        self.written = np.zeros(num_slots, dtype=bool)
        self.missing = np.zeros(num_slots, dtype=bool)
        self._hash_of: dict[int, bytes] = {}
        self._keys: dict[bytes, tuple[int, list[int]]] = {}
        self.db: sqlite3.Connection | None = sqlite3.connect(path, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute(f"PRAGMA synchronous={'FULL' if fsync else 'NORMAL'}")
        self.db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)")
        self.db.execute(
            "CREATE TABLE IF NOT EXISTS blocks (slot INTEGER PRIMARY KEY, sums BLOB NOT NULL,"
            " lens BLOB NOT NULL, hash BLOB UNIQUE, token_ids BLOB)"
        )

    def check_meta(self, want: dict[str, object], directory: Path) -> None:
        """Refuse (ConfigError) an index written with other meta; record `want`."""
        row = self.db.execute("SELECT value FROM meta WHERE key='config'").fetchone()
        if row is not None:
            have = json.loads(row[0])
            for key, value in want.items():
                if have.get(key) != value:
                    raise ConfigError(
                        f"disk tier directory {str(directory)!r} holds {key}="
                        f"{have.get(key)!r}, this tier has {key}={value!r}: use another "
                        "directory or delete that one"
                    )
        with self.db:
            self.db.execute("INSERT OR REPLACE INTO meta VALUES ('config', ?)", (json.dumps(want),))

    def load(self, slot_bytes: int, arena_size: int) -> list[int]:
        """Read the rows back on reopen and return the slots they hold. Unkeyed rows
        (and rows past the arena's slots) are dropped: those slots are free. A keyed
        slot beyond `arena_size` (the arena's size before it was opened) is missing."""
        L = self.num_layers
        with self.db:
            self.db.execute("DELETE FROM blocks WHERE hash IS NULL OR slot >= ?", (self.num_slots,))
        taken = []
        for slot, sums, lens, key, tokens in self.db.execute("SELECT * FROM blocks"):
            self.sums[slot] = np.frombuffer(sums, dtype="<u8", count=L)
            self.lens[slot] = np.frombuffer(lens, dtype="<i8", count=L)
            self.written[slot] = True
            # The file was deleted or truncated under the index: the block is gone.
            self.missing[slot] = (slot + 1) * slot_bytes > arena_size
            ids = np.frombuffer(tokens, dtype="<i8").tolist()
            self._hash_of[slot] = key
            self._keys[key] = (slot, ids)
            taken.append(slot)
        return taken

    # -- keys -------------------------------------------------------------------------
    def put_keys(self, entries: list[tuple[int, bytes, list[int]]]) -> None:
        """Key written slots by block hash, in one transaction: (slot, hash, token ids).
        A key held by another slot moves to the new one."""
        with self.lock, self.db:
            for slot, block_hash, token_ids in entries:
                old = self._keys.get(block_hash)
                if old is not None and old[0] != slot:  # the key moves to the new copy
                    self.db.execute("UPDATE blocks SET hash=NULL WHERE slot=?", (old[0],))
                    self._hash_of.pop(old[0], None)
                prev = self._hash_of.pop(slot, None)
                if prev is not None:
                    self._keys.pop(prev, None)
                blob = np.asarray(token_ids, dtype="<i8").tobytes()
                self.db.execute(
                    "UPDATE blocks SET hash=?, token_ids=? WHERE slot=?", (block_hash, blob, slot)
                )
                self._hash_of[slot] = block_hash
                self._keys[block_hash] = (slot, list(token_ids))

    def lookup(self, block_hash: bytes) -> tuple[int, list[int]] | None:
        """(slot, token_ids) of the block stored under `block_hash`, or None."""
        hit = self._keys.get(block_hash)
        return None if hit is None else (hit[0], list(hit[1]))

    def keyed_slots(self) -> dict[int, bytes]:
        """slot -> block hash, for every keyed slot."""
        return dict(self._hash_of)

    # -- rows -------------------------------------------------------------------------
    def drop_rows(self, slots: list[int]) -> None:
        """Forget the blocks in `slots` (rows and keys); unwritten slots are skipped."""
        idx = np.asarray(slots, dtype=np.int64)
        stale = idx[self.written[idx]].tolist()  # no Python loop per block
        if not stale:
            return
        with self.lock, self.db:
            self.db.executemany("DELETE FROM blocks WHERE slot=?", [(s,) for s in stale])
            for s in stale:
                self.written[s] = self.missing[s] = False
                key = self._hash_of.pop(s, None)
                if key is not None:
                    self._keys.pop(key, None)

    def commit_rows(self, slots: list[int], sums: np.ndarray, lens: np.ndarray) -> None:
        """Record freshly written, unkeyed blocks: per-layer checksums and stored
        lengths [len(slots), L]."""
        rows = [
            (s, sums[i].astype("<u8").tobytes(), lens[i].astype("<i8").tobytes())
            for i, s in enumerate(slots)
        ]
        with self.lock, self.db:
            self.db.executemany("INSERT OR REPLACE INTO blocks VALUES (?, ?, ?, NULL, NULL)", rows)
            idx = np.asarray(slots)
            self.sums[idx], self.lens[idx] = sums, lens
            self.written[idx], self.missing[idx] = True, False

    def close(self) -> None:
        """Commit and close the database (idempotent)."""
        if self.db is not None:
            self.db.commit()
            self.db.close()
            self.db = None
