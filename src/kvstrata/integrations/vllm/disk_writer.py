"""The backend's disk tier (kvstrata's DiskTier), used from one writer thread.

The tier's I/O never interleaves: every call on it runs on one thread, in order. vLLM's
scheduler thread never waits on a disk write, nor on a queue of them:

- a stored block is written through in the background; finished writes are queued and
  applied by the scheduler thread (`finished`);
- a freed slot is free at once in the scheduler's own slot allocator; dropping its
  index row is queued behind the writes already submitted (so a slot freed and given
  to a new block is dropped before it is rewritten) and never waited for; a failure
  is reported by `finished` like a failed write;
- blocks read back for hits go ahead of the queued writes, as one batch
  (`read_batch`; the scheduler gives it at most a few ms per step: disk_reads.py);
  the only other waits are draining and closing, each with a timeout.

`make_room` enforces `disk_budget` per `disk_dir` across namespaces at start-up.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout  # builtin only from 3.11
from pathlib import Path
from typing import Any, TypeVar

from kvstrata.core.errors import ConfigError, TierIOError
from kvstrata.core.units import format_bytes
from kvstrata.integrations.vllm.backend_plan import BackendPlan
from kvstrata.integrations.vllm.options import VllmOptions
from kvstrata.tiers.base import SlotAllocator, Tier
from kvstrata.tiers.disk import ARENA_FILE, INDEX_FILE, LOCK_FILE, DiskTier
from kvstrata.tiers.disk_format import SlotFormat
from kvstrata.tiers.disk_lock import DirLock
from kvstrata.tiers.movement import read_verified, write_keyed

T = TypeVar("T")
log = logging.getLogger(__name__)
NAMESPACE_DIR = re.compile(r"^.+-[0-9a-f]{16}$")  # plan.BackendPlan.named's subdirectories
_TIER_FILES = {ARENA_FILE, INDEX_FILE, LOCK_FILE} | {
    INDEX_FILE + side for side in ("-wal", "-shm", "-journal")
}


class DiskWriter:
    """Opens the plan's disk tier (its index found again after a restart) on a thread.

    Args:
        plan: gives the layout, slots, codec and namespaced directory.
        options: disk_compress / disk_delta / disk_o_direct.
    """

    def __init__(self, plan: BackendPlan, options: VllmOptions) -> None:
        assert plan.disk_path is not None and plan.disk_codec is not None
        self._cv = threading.Condition()
        self._queue: deque[tuple[Callable[[], Any], Future] | None] = deque()
        self._urgent: deque[tuple[Callable[[], Any], Future]] = deque()
        self._done: deque[tuple[int | None, BaseException | None]] = deque()
        # a daemon thread: a disk that hangs never keeps the process from exiting
        self._thread = threading.Thread(target=self._run, name="kvstrata-disk", daemon=True)
        self._thread.start()
        cache = options.cache
        self.compress = cache.disk_compress
        try:
            self.tier: DiskTier = self.call(
                lambda: DiskTier(
                    plan.layout,
                    plan.disk_slots,
                    plan.disk_path,
                    codec=plan.disk_codec,
                    compress=cache.disk_compress,
                    o_direct=cache.disk_o_direct,
                    delta=cache.disk_delta,
                )
            )
        except BaseException:
            self._stop()
            raise
        # The scheduler's own view of the free slots (the tier's allocator is the
        # writer thread's): equal at open, then the scheduler's runs ahead.
        self.slots = SlotAllocator(plan.disk_slots)
        free = set(self.tier.allocator.free_slots())
        self.slots.take([s for s in range(plan.disk_slots) if s not in free])
        self._closed = False

    # -- the thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._urgent and not self._queue:
                    self._cv.wait()
                item = self._urgent.popleft() if self._urgent else self._queue.popleft()
            if item is None:
                return
            fn, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to whoever reads the future
                future.set_exception(exc)

    def _stop(self) -> None:
        """End the thread after the calls queued so far."""
        with self._cv:
            self._queue.append(None)
            self._cv.notify()

    def submit(self, fn: Callable[[], T], urgent: bool = False) -> Future[T]:
        """Run `fn` on the disk thread: after everything queued, or (`urgent`) before
        every queued call that has not started."""
        future: Future[T] = Future()
        with self._cv:
            (self._urgent if urgent else self._queue).append((fn, future))
            self._cv.notify()
        return future

    def call(self, fn: Callable[[], T], timeout: float | None = None) -> T:
        """Run `fn` on the disk thread and wait for its result (TimeoutError after
        `timeout` seconds; `fn` still runs later)."""
        return self.submit(fn).result(timeout)

    # -- slots -----------------------------------------------------------------------------
    def keyed_slots(self) -> dict[int, bytes]:
        """slot -> key of every block the directory holds (after a restart too)."""
        return self.tier.keyed_slots()

    @property
    def num_free(self) -> int:
        return self.slots.num_free

    def allocate(self, count: int) -> list[int]:
        return self.slots.allocate(count) or []

    def free(self, slot: int) -> None:
        """Free a slot now; its index row is dropped on the thread, not waited for
        (an error comes back from `finished` with token None)."""
        self.slots.free([slot])
        future = self.submit(lambda: self.tier.free([slot]))
        future.add_done_callback(self._report(None))

    # -- I/O -------------------------------------------------------------------------------
    def read_batch(
        self, host: Tier, disk_slots: list[int], host_slots: list[int]
    ) -> Future[dict[int, TierIOError]]:
        """Read blocks into host slots in one batch (`read_verified`), ahead of the
        queued writes. The future's result: the blocks that cannot be served (corrupt,
        missing, unreadable), by index in `disk_slots`, with their errors; it fails
        when the read fails as a whole."""
        return self.submit(lambda: read_verified(self.tier, disk_slots, host, host_slots), True)

    def write(
        self,
        host: Tier,
        host_slots: list[int],
        slots: list[int],
        keys: list[bytes],
        token: int,
    ) -> None:
        """Copy host blocks to disk slots and key them (`write_keyed`), in the
        background; `token` and the error (or None) come back from `finished()`."""

        def write() -> None:
            self.tier.allocator.take(slots)  # taken already in the scheduler's view
            write_keyed(host, host_slots, self.tier, slots, keys)

        self.submit(write).add_done_callback(self._report(token))

    def _report(self, token: int | None) -> Callable[[Future], None]:
        def done(future: Future) -> None:
            if token is not None or future.exception() is not None:
                self._done.append((token, future.exception()))

        return done

    def finished(self) -> list[tuple[int | None, BaseException | None]]:
        """What finished since the last call: (token, error or None) per write, and
        (None, error) per free that failed."""
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every call submitted so far has finished; False on timeout."""
        try:
            self.call(lambda: None, timeout)
        except FutureTimeout:
            return False
        return True

    def bytes_per_block(self) -> float:
        """Bytes a block takes on disk (measured when compressed: they vary)."""
        stats = self.tier.stats
        if self.compress and stats.blocks_written:
            return stats.bytes_written / stats.blocks_written
        return self.tier.block_bytes

    def close(self, timeout: float | None = None) -> bool:
        """Finish the writes, close the tier (index committed, lock released), stop
        the thread (idempotent). False when that did not finish within `timeout`
        (the thread keeps going; the disk index holds what was committed)."""
        if self._closed:
            return True
        self._closed = True
        deadline = None if timeout is None else time.monotonic() + timeout
        future = self.submit(self.tier.close)
        self._stop()
        try:
            future.result(None if deadline is None else max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            log.warning("kvstrata: the disk tier did not close within %s s", timeout)
            return False
        except TierIOError as exc:
            log.warning("kvstrata: closing the disk tier failed: %s", exc)
        self._thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return True


# -- one budget per disk_dir -------------------------------------------------------------------
def arena_file_bytes(plan: BackendPlan) -> int:
    """Bytes of the plan's disk arena file (preallocated when the tier is created)."""
    assert plan.disk_codec is not None
    return plan.disk_slots * SlotFormat(plan.layout, plan.disk_codec).slot_bytes


def make_room(plan: BackendPlan, budget: int) -> list[str]:
    """Keep `disk_dir` within `disk_budget` across namespaces: every namespace gets a
    subdirectory with an arena of its own `disk_budget`, so a new model, codec or
    kvstrata version would otherwise leave the old ones behind for ever. Before the
    plan's namespace opens, the other namespaces are removed, least recently used
    first, until they and this one fit the budget. A namespace that another process
    holds (its tier.lock is locked) is never touched; a directory holding files other
    than a disk tier's is never removed. Returns the directories removed.

    Raises:
        ConfigError: the namespaces other processes hold leave no room for this one.
    """
    assert plan.disk_root is not None and plan.disk_path is not None
    root, ours = Path(plan.disk_root), Path(plan.disk_path)
    if not root.is_dir():
        return []
    need = arena_file_bytes(plan)
    if ours.is_dir():
        need = max(need, _dir_bytes(ours))
    others = []
    for path in root.iterdir():
        if path == ours or not path.is_dir() or not NAMESPACE_DIR.match(path.name):
            continue
        files = list(path.iterdir())
        if not files or any(f.name not in _TIER_FILES or not f.is_file() for f in files):
            continue  # not (only) a disk tier: not ours to remove
        others.append((_last_used(files), path, _dir_bytes(path)))
    others.sort()
    total = need + sum(size for _, _, size in others)
    removed: list[str] = []
    held: list[str] = []
    for last_used, path, size in others:
        if total <= budget:
            break
        try:
            lock = DirLock(path)
        except TierIOError:
            held.append(f"{path.name} ({format_bytes(size)})")
            continue
        try:
            shutil.rmtree(path)
        except OSError as exc:
            log.warning("kvstrata: cannot remove the old namespace %s: %s", path, exc)
            held.append(f"{path.name} ({format_bytes(size)})")
            continue
        finally:
            lock.release()
        total -= size
        removed.append(str(path))
        log.warning(
            "kvstrata: removed the namespace %s from disk_dir (%s, last used %s): disk_budget "
            "%s covers every namespace in %s",
            path.name,
            format_bytes(size),
            time.strftime("%Y-%m-%d %H:%M", time.localtime(last_used)),
            format_bytes(budget),
            root,
        )
    if total > budget and held:
        raise ConfigError.field(
            "disk_budget",
            format_bytes(budget),
            f"disk_dir {str(root)!r} also holds namespaces in use by other processes "
            f"({', '.join(held)}), with this one ({format_bytes(need)}) over the budget, "
            "which covers the whole directory: give each server its own disk_dir",
        )
    return removed


def _dir_bytes(path: Path) -> int:
    total = 0
    for f in path.iterdir():
        with contextlib.suppress(OSError):
            total += f.stat().st_size
    return total


def _last_used(files: list[Path]) -> float:
    newest = 0.0
    for f in files:
        with contextlib.suppress(OSError):
            newest = max(newest, f.stat().st_mtime)
    return newest
