"""A DiskTier's open files -- the directory lock, the index and the arena -- opened in
order, released together, and what a lost or truncated file at open means.

Open: lock `tier.lock` (one owner), open `index.sqlite` and check its meta, open and
size `blocks.bin`, load the keyed rows. A file found missing or truncated drops the
blocks it held and says so with a RuntimeWarning (they are recomputed): a lost index
or arena means fewer cached blocks, never wrong ones. Any failure releases what was
taken. Close: arena, then index (rebuilt from memory first if it was deleted while
open, unless the arena is gone too), then the lock; every step runs, and the first
failure is raised.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvstrata.core.errors import TierIOError
from kvstrata.tiers.disk_format import SlotFormat
from kvstrata.tiers.disk_index import DiskIndex
from kvstrata.tiers.disk_io import BlockFile
from kvstrata.tiers.disk_lock import DirLock

ARENA_FILE = "blocks.bin"
INDEX_FILE = "index.sqlite"


@dataclass
class DiskFiles:
    """What one open DiskTier holds; `pid` is the process that opened it."""

    lock: DirLock | None = None
    index: DiskIndex | None = None
    file: BlockFile | None = None
    pid: int = 0

    def open(
        self,
        directory: Path,
        fmt: SlotFormat,
        num_slots: int,
        fsync: bool,
        meta: dict[str, object],
        make_file: Callable[[DiskIndex], BlockFile],
    ) -> list[int]:
        """Lock, open and load (see the module docstring); returns the keyed slots.
        Releases everything on failure."""
        self.pid = os.getpid()
        try:
            return self._open(directory, fmt, num_slots, fsync, meta, make_file)
        except BaseException:
            self.release()
            raise

    def _open(
        self,
        directory: Path,
        fmt: SlotFormat,
        num_slots: int,
        fsync: bool,
        meta: dict[str, object],
        make_file: Callable[[DiskIndex], BlockFile],
    ) -> list[int]:
        self.lock = DirLock(directory)
        self.index = index = DiskIndex(directory / INDEX_FILE, num_slots, fmt.num_layers, fsync)
        had_index = index.check_meta(meta, directory)
        self.file = make_file(index)
        old_size = self.file.open()
        self.file.prepare(old_size or 0)
        taken, dropped = index.load(fmt.slot_bytes, fmt.layer_bytes, old_size or 0)
        where = repr(str(directory))
        if old_size is None and dropped:
            _warn(f"{ARENA_FILE} in {where} was missing: its {dropped} keyed blocks are gone")
        elif dropped:
            _warn(
                f"{dropped} keyed blocks in {where} were past the end of {ARENA_FILE} "
                "(truncated) or had damaged index rows: they are gone"
            )
        if not had_index and old_size:
            _warn(f"{INDEX_FILE} in {where} was missing: the blocks in {ARENA_FILE} are gone")
        return taken

    def release(self) -> None:
        """Close everything quietly (a failed open, or a tier collected without
        close(): nobody to report to). Not in a forked child: closing its copy of the
        sqlite connection could remove the owner's -wal file."""
        if os.getpid() != self.pid:
            return
        if self.file is not None:
            with contextlib.suppress(Exception):
                self.file.close(False)
        if self.index is not None:
            with contextlib.suppress(Exception):
                self.index.close(persist=False)
        if self.lock is not None:
            self.lock.release()

    def close(self, fsync: bool) -> None:
        """Close the arena (fdatasync first if `fsync`), the index and the lock. Every
        step runs; the first failure is then raised (TierIOError)."""
        if os.getpid() != self.pid:
            return  # a forked child's copy: the files are the owner's
        file, index, lock = self.file, self.index, self.lock
        persist = True
        try:
            file.check_linked([], TierIOError)
        except TierIOError:
            persist = False  # the arena is gone: nothing left to keep an index for
        failure: BaseException | None = None
        for step in (
            lambda: file.close(fsync and persist),
            lambda: index.close(persist=persist),
            lock.release,
        ):
            try:
                step()
            except TierIOError as exc:
                failure = failure or exc
        if failure is not None:
            raise failure


def _warn(msg: str) -> None:
    warnings.warn(
        f"kvstrata disk tier: {msg}; starting without them (they are recomputed)",
        RuntimeWarning,
        stacklevel=5,
    )


__all__ = ["ARENA_FILE", "INDEX_FILE", "DiskFiles"]
