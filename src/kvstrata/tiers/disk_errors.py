"""The typed errors of the disk tier's files: every storage failure becomes one
TierIOError (TierFullError for a full disk) naming the file, the slots concerned and
the fix. Shared by the arena (disk_io), the index (disk_index), the directory lock
(disk_lock) and DiskTier itself.
"""

from __future__ import annotations

import errno
from pathlib import Path

from kvstrata.core.errors import TierFullError, TierIOError


def slot_list(slots: list[int], most: int = 8) -> str:
    """`slots` for a one-line message: at most `most` of them, then the count."""
    if len(slots) <= most:
        return str(list(slots))
    return f"[{', '.join(map(str, slots[:most]))}, ...] ({len(slots)} slots)"


def tier_error(
    cls: type[TierIOError], msg: str, path: Path, slots: list[int] | None = None
) -> TierIOError:
    """A `cls` naming the file, with `.path` and `.slots` set."""
    # Not OSError.filename: setting it changes str(exc) to "[Errno None] ...".
    exc = cls(f"{msg} (file {str(path)!r})")
    exc.path = str(path)
    exc.slots = list(slots or [])
    return exc


FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def os_error(exc: OSError, path: Path, slots: list[int], what: str) -> TierIOError:
    """The typed error for a failed system call on `path` while doing `what`:
    TierFullError for a full disk (ENOSPC, EDQUOT, EFBIG), else TierIOError; one
    line naming the file and the fix."""
    reason = exc.strerror or str(exc)
    if exc.errno in FULL_ERRNOS:
        return tier_error(
            TierFullError,
            f"out of space while {what} ({reason}): free space on that filesystem (or raise "
            "the file size limit) or lower disk_budget",
            path,
            slots,
        )
    return tier_error(
        TierIOError,
        f"I/O error while {what} ({reason}): check the device and its permissions, or "
        "use another disk_dir",
        path,
        slots,
    )
