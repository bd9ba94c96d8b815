"""One owner per disk tier directory: an OS lock on `tier.lock` in the directory.

A DiskTier holds an exclusive `flock` on `<disk_dir>/tier.lock` from open to close.
A second opener -- another process, or another DiskTier in the same process (flock
locks belong to an open file description, so two opens conflict even in one
process) -- is refused with a one-line TierIOError naming the holder (pid and host,
which the holder writes into the file) and the fix. The kernel releases the lock
when its holder exits or is killed (kill -9 included), so a lock file left behind by
a dead process never blocks anyone: the file is only a place to lock, never deleted.

A process forked while a tier is open does not keep the lock: its copy of the
descriptor is closed right after the fork (which leaves the parent's lock in place),
and DiskTier refuses to be used from a process other than the one that opened it.
On network filesystems flock may be local to one host: keep disk_dir on a local disk.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import gc
import os
import socket
import time
import weakref
from pathlib import Path

from kvstrata.core.errors import TierIOError
from kvstrata.tiers.disk_errors import os_error, tier_error

LOCK_FILE = "tier.lock"
_HELD: weakref.WeakSet[DirLock] = weakref.WeakSet()


def _forget_in_child() -> None:
    """After fork, in the child: close the inherited lock descriptors. A flock belongs
    to the open file description, so the parent keeps its lock; the child never
    holds it (it would outlive the parent and keep the directory locked)."""
    for lock in list(_HELD):
        fd, lock.fd = lock.fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (on this host's PID namespace)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, another user's
        return True
    return True


def _holder(fd: int) -> str:
    """Who holds the lock, as its holder wrote it into the file ("" while unknown: not
    written yet, or still the line of a dead earlier holder on this host)."""
    try:
        text = os.pread(fd, 256, 0).decode("utf-8", "replace")
    except OSError:
        return ""
    fields = dict(part.split("=", 1) for part in text.split() if "=" in part)
    pid, host = fields.get("pid", ""), fields.get("host", "")
    if not pid.isdigit():
        return ""
    here = host == socket.gethostname()
    if here and int(pid) == os.getpid():
        return (
            f"this process (pid {pid}, host {host}; another DiskTier or store on it is still open)"
        )
    if here and not pid_alive(int(pid)):
        return ""
    return f"process {pid} on host {host or '?'}"


def _wait_for_holder(fd: int) -> str:
    """The holder, waiting up to ~0.2 s for a new holder to write its line."""
    for _ in range(20):
        holder = _holder(fd)
        if holder:
            return holder
        time.sleep(0.01)
    return ""


class DirLock:
    """An exclusive flock on `directory/tier.lock`, held until `release()`.

    Raises:
        TierIOError: the directory is in use (names the holder and the fix), or the
            lock cannot be taken on this filesystem.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / LOCK_FILE
        self.fd = -1
        collected = False
        while True:
            fd = self._open()
            try:
                if self._try_lock(fd):
                    if self._is_current(fd):
                        break
                    os.close(fd)  # the file was replaced under us: lock the new one
                    continue
                holder = _wait_for_holder(fd)
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
            if not collected and holder.startswith("this process"):
                # an unreachable tier of this process that was never closed: collect it
                collected = True
                gc.collect()
                continue
            raise tier_error(
                TierIOError,
                f"disk_dir {str(directory)!r} is in use by {holder or 'another process'}: "
                "use another disk_dir, or close that store first",
                self.path,
            )
        self.fd = fd
        _HELD.add(self)
        self._record()

    def _open(self) -> int:
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise os_error(exc, self.path, [], "opening the directory's lock file") from exc

    def _try_lock(self, fd: int) -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False
            raise tier_error(
                TierIOError,
                f"cannot lock {str(self.path)!r} ({exc.strerror}): put disk_dir on a local "
                "filesystem that supports flock",
                self.path,
            ) from exc
        return True

    def _is_current(self, fd: int) -> bool:
        """The locked file is still the one at the path (not deleted or replaced)."""
        try:
            a, b = os.fstat(fd), os.stat(self.path)
        except OSError:
            return False
        return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)

    def _record(self) -> None:
        """Write who holds the lock (for the message a second opener gets). Best
        effort: the lock itself is what matters."""
        # one fixed-size write, no truncation: a reader sees the old line or the new
        line = f"pid={os.getpid()} host={socket.gethostname()}".encode()[:255]
        with contextlib.suppress(OSError):
            os.pwrite(self.fd, line.ljust(256, b" "), 0)

    def release(self) -> None:
        """Release the lock (idempotent). The file stays: deleting it would race with
        a new opener."""
        fd, self.fd = self.fd, -1
        _HELD.discard(self)
        if fd >= 0:
            os.close(fd)
