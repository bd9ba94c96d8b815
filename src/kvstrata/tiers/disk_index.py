"""DiskTier's index: index.sqlite and its in-memory mirror.

    index.sqlite   meta (layout, codec, checksum) + one row per written slot:
                   (slot, checksum per layer, stored bytes per layer, key, token ids)

Every read is verified against the checksums held here, and a slot without a row
holds no block. DiskTier orders the changes around its data writes (a row is dropped
before its slot is rewritten and committed only after the new data), which is what
makes the arena crash safe.

Storage errors are typed: any sqlite3.Error or OSError becomes a TierIOError
(TierFullError for a full disk) naming index.sqlite and the fix. The index is watched:
before every write transaction and at close, the file at the path must still be the
one the connection opened (same device and inode; the connection keeps it open, so
its inode number cannot be reused meanwhile). When it was deleted or replaced, it is
rebuilt from the in-memory mirror (atomically: written aside, then renamed into
place) and a RuntimeWarning says so; the rows are never silently lost.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

import numpy as np

from kvstrata.core.errors import ConfigError, TierFullError, TierIOError
from kvstrata.tiers.disk_errors import os_error, tier_error
from kvstrata.tiers.disk_format import RETIRED_CHECKSUMS

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)",
    "CREATE TABLE IF NOT EXISTS blocks (slot INTEGER PRIMARY KEY, sums BLOB NOT NULL,"
    " lens BLOB NOT NULL, hash BLOB UNIQUE, token_ids BLOB, parent BLOB)",
)
_COLUMNS = "slot, sums, lens, hash, token_ids, parent"
_SIDE_FILES = ("-wal", "-shm", "-journal")
REBUILD_SUFFIX = ".rebuild"


def sqlite_error(exc: sqlite3.Error, path: Path, what: str) -> TierIOError:
    """The typed error for a failed sqlite call on the index `path`: one line naming
    the file and the fix."""
    name = getattr(exc, "sqlite_errorname", "") or ""
    text = str(exc)
    low = text.lower()
    if name.startswith("SQLITE_FULL") or "full" in low:
        cls, fix = TierFullError, "free space on that filesystem or lower disk_budget"
    elif name.startswith(("SQLITE_NOTADB", "SQLITE_CORRUPT")) or (
        "not a database" in low or "malformed" in low
    ):
        cls, fix = (
            TierIOError,
            "the index is damaged: delete it (the disk tier then starts empty) or use "
            "another disk_dir",
        )
    elif name.startswith(("SQLITE_READONLY", "SQLITE_CANTOPEN", "SQLITE_PERM")) or (
        "readonly" in low or "unable to open" in low
    ):
        cls, fix = TierIOError, "make the directory writable or use another disk_dir"
    else:
        cls, fix = (
            TierIOError,
            "check free space, file size limits and the device, or use another disk_dir",
        )
    return tier_error(cls, f"index error while {what} ({text}): {fix}", path)


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
        created: the index file did not exist before (a new or lost index).

    Raises:
        TierIOError: the index cannot be opened or is damaged (TierFullError: no space).
    """

    def __init__(self, path: Path, num_slots: int, num_layers: int, fsync: bool) -> None:
        self.path = path
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.fsync = fsync
        self.lock = threading.RLock()
        self.sums = np.zeros((num_slots, num_layers), dtype=np.uint64)
        self.lens = np.zeros((num_slots, num_layers), dtype=np.int64)
        self.written = np.zeros(num_slots, dtype=bool)
        self._hash_of: dict[int, bytes] = {}
        self._keys: dict[bytes, tuple[int, list[int]]] = {}
        self._parents: dict[bytes, bytes] = {}  # hash -> its parent's (chains after a restart)
        self._meta: str | None = None
        self._ident: tuple[int, int] | None = None
        self.db: sqlite3.Connection | None = None
        with self._guard("opening the index"):
            self._remove(path.with_name(path.name + REBUILD_SUFFIX))  # an interrupted rebuild
            self.created = not path.exists()
            if self.created:
                # side files of a deleted index would be replayed into the new one
                for suffix in _SIDE_FILES:
                    self._remove(path.with_name(path.name + suffix))
            self.db = self._connect(path)
            try:
                self._ident = self._stat()
            except BaseException:
                self.db.close()
                self.db = None
                raise

    # -- plumbing ---------------------------------------------------------------------
    @contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        """Turn sqlite3.Error / OSError raised inside into the typed TierIOError family."""
        try:
            yield
        except TierIOError:
            raise
        except sqlite3.Error as exc:
            raise sqlite_error(exc, self.path, what) from exc
        except OSError as exc:
            raise os_error(exc, self.path, [], what) from exc

    def _connect(self, path: Path) -> sqlite3.Connection:
        db = sqlite3.connect(path, check_same_thread=False)
        try:
            db.execute(f"PRAGMA synchronous={'FULL' if self.fsync else 'NORMAL'}")
            db.execute("PRAGMA journal_mode=WAL")
            for statement in _SCHEMA:
                db.execute(statement)
            columns = {row[1] for row in db.execute("PRAGMA table_info(blocks)")}
            if "parent" not in columns:  # an index from before parents were kept
                db.execute("ALTER TABLE blocks ADD COLUMN parent BLOB")
        except BaseException:
            db.close()
            raise
        return db

    def _stat(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return st.st_dev, st.st_ino

    @staticmethod
    def _remove(path: Path) -> None:
        with suppress(FileNotFoundError):
            os.unlink(path)

    def _conn(self) -> sqlite3.Connection:
        if self.db is None:
            raise tier_error(TierIOError, "the disk tier is closed: open a new one", self.path)
        return self.db

    @contextmanager
    def _transaction(self, what: str) -> Iterator[sqlite3.Connection]:
        """A write transaction on the index, after making sure the file at the path is
        still ours (rebuilt from memory otherwise). Rolled back on any failure,
        including a failed commit."""
        with self.lock, self._guard(what):
            self._check_identity()
            db = self._conn()
            try:
                yield db
                db.commit()
            except BaseException:
                with suppress(sqlite3.Error):
                    db.rollback()
                raise

    def _check_identity(self) -> None:
        self._conn()
        if self._stat() != self._ident:
            self.rebuild("deleted" if not self.path.exists() else "replaced")

    def rebuild(self, reason: str) -> None:
        """Write the in-memory rows to a fresh index.sqlite (aside, then renamed into
        place) and reconnect to it; warns that the index was `reason`."""
        with self.lock, self._guard("rebuilding the index"):
            old, self.db = self.db, None
            if old is not None:
                with suppress(sqlite3.Error):
                    old.close()
            tmp = self.path.with_name(self.path.name + REBUILD_SUFFIX)
            self._remove(tmp)
            db = sqlite3.connect(tmp)
            try:
                for statement in _SCHEMA:
                    db.execute(statement)
                if self._meta is not None:
                    db.execute("INSERT INTO meta VALUES ('config', ?)", (self._meta,))
                db.executemany(
                    f"INSERT INTO blocks ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?)", self._rows()
                )
                db.commit()
            finally:
                db.close()
            for suffix in _SIDE_FILES:  # stale side files of the lost file
                self._remove(self.path.with_name(self.path.name + suffix))
            os.replace(tmp, self.path)
            self.db = self._connect(self.path)
            self._ident = self._stat()
        warnings.warn(
            f"kvstrata disk tier: index {str(self.path)!r} was {reason} while open; "
            f"rebuilt it from memory ({int(self.written.sum())} blocks)",
            RuntimeWarning,
            stacklevel=4,
        )

    def _rows(self) -> Iterator[tuple]:
        for slot in np.flatnonzero(self.written).tolist():
            key = self._hash_of.get(slot)
            ids = None
            if key is not None:
                ids = np.asarray(self._keys[key][1], dtype="<i8").tobytes()
            yield (
                slot,
                self.sums[slot].astype("<u8").tobytes(),
                self.lens[slot].astype("<i8").tobytes(),
                key,
                ids,
                None if key is None else self._parents.get(key),
            )

    # -- open -------------------------------------------------------------------------
    def check_meta(self, want: dict[str, object], directory: Path) -> bool:
        """Refuse (ConfigError) an index written with other meta; record `want`.
        Returns whether the index already had meta (it is not new)."""
        with self._guard("reading the index"):
            row = self._conn().execute("SELECT value FROM meta WHERE key='config'").fetchone()
        if row is not None:
            try:
                have = json.loads(row[0])
                if not isinstance(have, dict):
                    raise ValueError("not an object")
            except ValueError as exc:
                raise tier_error(
                    TierIOError,
                    "index meta is damaged: delete the index (the disk tier then starts "
                    "empty) or use another disk_dir",
                    self.path,
                ) from exc
            old = have.get("checksum")
            if isinstance(old, str) and old in RETIRED_CHECKSUMS and old != want.get("checksum"):
                raise ConfigError(
                    f"disk tier directory {str(directory)!r} was written by an older kvstrata "
                    f"with checksum {old!r} ({RETIRED_CHECKSUMS[old]}), which is no longer "
                    "read: delete that directory (its blocks are recomputed) or use another "
                    "disk_dir"
                )
            for key, value in want.items():
                if have.get(key) != value:
                    raise ConfigError(
                        f"disk tier directory {str(directory)!r} holds {key}="
                        f"{have.get(key)!r}, this tier has {key}={value!r}: use another "
                        "directory or delete that one"
                    )
        self._meta = json.dumps(want)
        with self._transaction("writing the index") as db:
            db.execute("INSERT OR REPLACE INTO meta VALUES ('config', ?)", (self._meta,))
        return row is not None

    def load(self, slot_bytes: int, layer_bytes: int, arena_size: int) -> tuple[list[int], int]:
        """Read the rows back on reopen; returns (the slots they hold, keyed rows
        dropped). Unkeyed rows (and rows past the arena's slots) are dropped: those
        slots are free. So are keyed rows whose block lies past `arena_size` (the
        arena's size before it was opened: it was truncated or lost) or whose row does
        not parse (a damaged index): such blocks are gone, and are recomputed."""
        L = self.num_layers
        taken: list[int] = []
        bad: list[int] = []
        with self._guard("loading the index"):
            db = self._conn()
            with db:
                db.execute(
                    "DELETE FROM blocks WHERE hash IS NULL OR slot >= ? OR slot < 0",
                    (self.num_slots,),
                )
            for slot, sums, lens, key, tokens, parent in db.execute(
                f"SELECT {_COLUMNS} FROM blocks"
            ):
                if not self._valid(slot, sums, lens, key, tokens, slot_bytes, layer_bytes):
                    bad.append(slot)
                    continue
                if (slot + 1) * slot_bytes > arena_size:
                    bad.append(slot)  # the file was truncated or lost under the index
                    continue
                self.sums[slot] = np.frombuffer(sums, dtype="<u8", count=L)
                self.lens[slot] = np.frombuffer(lens, dtype="<i8", count=L)
                self.written[slot] = True
                ids = np.frombuffer(tokens, dtype="<i8").tolist()
                self._hash_of[slot] = key
                self._keys[key] = (slot, ids)
                if isinstance(parent, bytes) and parent:
                    self._parents[key] = parent
                taken.append(slot)
            if bad:
                with db:
                    db.executemany("DELETE FROM blocks WHERE slot=?", [(s,) for s in bad])
        return taken, len(bad)

    def _valid(
        self,
        slot: object,
        sums: object,
        lens: object,
        key: object,
        tokens: object,
        slot_bytes: int,
        layer_bytes: int,
    ) -> bool:
        L = self.num_layers
        if not isinstance(slot, int) or not isinstance(key, bytes) or not key:
            return False
        if not all(isinstance(b, bytes) for b in (sums, lens, tokens)):
            return False
        if len(sums) != 8 * L or len(lens) != 8 * L or len(tokens) % 8:
            return False
        n = np.frombuffer(lens, dtype="<i8")
        return bool((n > 0).all() and (n <= layer_bytes).all() and n.sum() <= slot_bytes)

    # -- keys -------------------------------------------------------------------------
    def put_keys(
        self,
        entries: list[tuple[int, bytes, list[int]]],
        parents: Sequence[bytes | None] | None = None,
    ) -> None:
        """Key written slots by block hash, in one transaction: (slot, hash, token ids),
        and with `parents` (parallel to `entries`) each block's parent hash, so a
        restarted store knows its chains. A key held by another slot moves to the new
        one. The mirror changes only once the transaction has committed."""
        parent_of: dict[bytes, bytes | None] = (
            {} if parents is None else dict(zip((e[1] for e in entries), parents, strict=True))
        )
        # changes to the mirror, applied once committed (None: removed)
        keys: dict[bytes, tuple[int, list[int]] | None] = {}
        hash_of: dict[int, bytes | None] = {}
        with self.lock:
            key_of = lambda h: keys[h] if h in keys else self._keys.get(h)  # noqa: E731
            hash_at = lambda s: hash_of[s] if s in hash_of else self._hash_of.get(s)  # noqa: E731
            with self._transaction("keying blocks in the index") as db:
                for slot, block_hash, token_ids in entries:
                    old = key_of(block_hash)
                    if old is not None and old[0] != slot:  # the key moves to the new copy
                        db.execute("UPDATE blocks SET hash=NULL WHERE slot=?", (old[0],))
                        hash_of[old[0]] = None
                    prev = hash_at(slot)
                    if prev is not None:
                        keys[prev] = None
                    blob = np.asarray(token_ids, dtype="<i8").tobytes()
                    db.execute(
                        "UPDATE blocks SET hash=?, token_ids=?, parent=? WHERE slot=?",
                        (block_hash, blob, parent_of.get(block_hash), slot),
                    )
                    hash_of[slot] = block_hash
                    keys[block_hash] = (slot, list(token_ids))
            for h, hit in keys.items():
                if hit is None:
                    self._keys.pop(h, None)
                    self._parents.pop(h, None)
                else:
                    self._keys[h] = hit
                    parent = parent_of.get(h)
                    if parent is not None:
                        self._parents[h] = parent
                    else:
                        self._parents.pop(h, None)
            for s, h in hash_of.items():
                if h is None:
                    self._hash_of.pop(s, None)
                else:
                    self._hash_of[s] = h

    def lookup(self, block_hash: bytes) -> tuple[int, list[int]] | None:
        """(slot, token_ids) of the block stored under `block_hash`, or None."""
        hit = self._keys.get(block_hash)
        return None if hit is None else (hit[0], list(hit[1]))

    def parent_of(self, block_hash: bytes) -> bytes | None:
        """The parent hash a keyed block was stored with (None: a chain's first block,
        or written before parents were kept)."""
        return self._parents.get(block_hash)

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
        with self.lock:
            with self._transaction("dropping index rows") as db:
                db.executemany("DELETE FROM blocks WHERE slot=?", [(s,) for s in stale])
            for s in stale:
                self.written[s] = False
                key = self._hash_of.pop(s, None)
                if key is not None:
                    self._keys.pop(key, None)
                    self._parents.pop(key, None)

    def commit_rows(self, slots: list[int], sums: np.ndarray, lens: np.ndarray) -> None:
        """Record freshly written, unkeyed blocks: per-layer checksums and stored
        lengths [len(slots), L]."""
        rows = [
            (s, sums[i].astype("<u8").tobytes(), lens[i].astype("<i8").tobytes())
            for i, s in enumerate(slots)
        ]
        with self.lock:
            with self._transaction("recording written blocks in the index") as db:
                db.executemany(
                    "INSERT OR REPLACE INTO blocks (slot, sums, lens) VALUES (?, ?, ?)", rows
                )
            idx = np.asarray(slots)
            self.sums[idx], self.lens[idx] = sums, lens
            self.written[idx] = True

    # -- lifecycle --------------------------------------------------------------------
    def close(self, persist: bool = True) -> None:
        """Commit and close the database (idempotent). With `persist`, an index that
        was deleted or replaced is first rebuilt from memory. The connection is closed
        even when that fails (then TierIOError)."""
        if self.db is None:
            return
        failure: BaseException | None = None
        if persist:
            try:
                with self.lock, self._guard("closing the index"):
                    self._check_identity()
            except TierIOError as exc:
                failure = exc
        db, self.db = self.db, None
        if db is None:  # a failed rebuild left no connection
            if failure is not None:
                raise failure
            return
        try:
            with self._guard("closing the index"):
                try:
                    db.commit()
                finally:
                    db.close()
        except TierIOError as exc:
            failure = failure or exc
        if failure is not None:
            raise failure
