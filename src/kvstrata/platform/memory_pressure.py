"""How close this process is to running out of memory: its memory cgroup's limit and
use (cgroup v2 `memory.max` / `memory.current`, v1 `memory.limit_in_bytes` /
`memory.usage_in_bytes`), the machine's `MemAvailable`, and PSI (`/proc/pressure/memory`).

`MemoryPressureReader(root)` finds the process's memory cgroup once (from
`/proc/self/cgroup`, under `root`: tests point it at a recorded or fake tree) and each
`read()` is a few small file reads. Page cache is left out of a cgroup's use where the
kernel can drop it (`inactive_file`, as the kubelet's "working set"): the disk tier's
writes would otherwise read as pressure. The limit is the tightest one on the way to the
root (v1: `hierarchical_memory_limit`; v2: the smallest `memory.max` of the cgroup and
its ancestors). `available_bytes` is the smaller of the cgroup's room and the machine's
`MemAvailable`: either one running out ends in the OOM killer.

`release_pages` gives the whole pages of a range of private memory back to the kernel
(`MADV_DONTNEED`): the host tier's free slots, when memory pressure shrinks it. They
read as zeros, and are committed again when written.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NO_LIMIT = 1 << 60  # v1 writes "no limit" as the largest page-aligned long (~2^63)


@dataclass(frozen=True)
class MemoryReading:
    """One look at memory.

    Fields:
        source: where the limit came from: "cgroup2", "cgroup1" or "meminfo" (no limit
            on the cgroup: the machine's RAM is the limit).
        limit_bytes: the memory this process may use with its cgroup (the machine's
            MemTotal when the cgroup has no limit).
        used_bytes: what the cgroup uses without its droppable page cache (meminfo:
            MemTotal - MemAvailable).
        available_bytes: room left before the OOM killer: min(limit - used,
            MemAvailable).
        psi_some_avg10 / psi_full_avg10: the share (%) of the last 10 s some / all
            tasks stalled on memory (PSI), None where the kernel has no PSI.
    """

    source: str
    limit_bytes: int
    used_bytes: int
    available_bytes: int
    psi_some_avg10: float | None = None
    psi_full_avg10: float | None = None


class MemoryPressureReader:
    """Reads this process's memory limit, use and pressure (see the module docstring).

    Args:
        root: the file system root the /proc and /sys paths are read under ("/").
    """

    def __init__(self, root: str | Path = "/") -> None:
        self.root = Path(root)
        self.v2_dirs: list[Path] = []  # the cgroup first, then its ancestors
        self.v1_dir: Path | None = None
        self._find_cgroup()
        self.psi_path = self._psi_path()

    @property
    def source(self) -> str:
        return "cgroup2" if self.v2_dirs else "cgroup1" if self.v1_dir else "meminfo"

    def _find_cgroup(self) -> None:
        text = _read(self.root / "proc/self/cgroup") or ""
        for line in text.splitlines():
            hier, _, rest = line.partition(":")
            controllers, _, path = rest.partition(":")
            rel = path.strip().lstrip("/")
            if hier == "0" and not controllers:
                base = self.root / "sys/fs/cgroup"
                if (base / "cgroup.controllers").exists():
                    leaf = _existing(base, rel)
                    if leaf is not None and (leaf / "memory.current").exists():
                        self.v2_dirs = [leaf, *(p for p in leaf.parents if base in p.parents)]
                        return
            elif "memory" in controllers.split(","):
                base = self.root / "sys/fs/cgroup/memory"
                leaf = _existing(base, rel)
                if leaf is not None and (leaf / "memory.usage_in_bytes").exists():
                    self.v1_dir = leaf

    def _psi_path(self) -> Path | None:
        if self.v2_dirs and (self.v2_dirs[0] / "memory.pressure").exists():
            return self.v2_dirs[0] / "memory.pressure"
        path = self.root / "proc/pressure/memory"
        return path if path.exists() else None

    def read(self) -> MemoryReading | None:
        """Memory now; None when nothing can be read (no /proc/meminfo either)."""
        meminfo = _meminfo(self.root / "proc/meminfo")
        total, avail = meminfo.get("MemTotal"), meminfo.get("MemAvailable")
        cgroup = self._cgroup()
        some, full = _psi(self.psi_path) if self.psi_path is not None else (None, None)
        if cgroup is not None:
            limit, used = cgroup
            room = max(0, limit - used)
            if avail is not None:
                room = min(room, avail)
            return MemoryReading(self.source, limit, used, room, some, full)
        if total is None or avail is None:
            return None
        return MemoryReading("meminfo", total, total - avail, avail, some, full)

    def _cgroup(self) -> tuple[int, int] | None:
        """(limit, use without droppable cache) of the cgroup, None without a limit."""
        if self.v2_dirs:
            limits = [_int(d / "memory.max") for d in self.v2_dirs]
            limit = min((x for x in limits if x is not None), default=None)
            current = _int(self.v2_dirs[0] / "memory.current")
            if limit is None or current is None:
                return None
            stat = _stat(self.v2_dirs[0] / "memory.stat")
            return limit, max(0, current - stat.get("inactive_file", 0))
        if self.v1_dir is not None:
            stat = _stat(self.v1_dir / "memory.stat")
            limit = stat.get(
                "hierarchical_memory_limit", _int(self.v1_dir / "memory.limit_in_bytes")
            )
            usage = _int(self.v1_dir / "memory.usage_in_bytes")
            if limit is None or limit >= NO_LIMIT or usage is None:
                return None
            cache = stat.get("total_inactive_file", stat.get("inactive_file", 0))
            return limit, max(0, usage - cache)
        return None


def release_pages(address: int, nbytes: int) -> int:
    """`madvise(MADV_DONTNEED)` on the whole pages inside [address, address + nbytes)
    of private anonymous memory: the kernel frees them now and they read as zeros (and
    are committed again) when next touched. Returns the bytes advised; 0 where the
    platform has no such call or refuses."""
    page = mmap.PAGESIZE
    first = -(-address // page) * page
    last = (address + nbytes) // page * page
    advice = getattr(mmap, "MADV_DONTNEED", None)
    if last <= first or advice is None or _madvise is None:
        return 0
    return last - first if _madvise(first, last - first, advice) == 0 else 0


def _libc_madvise() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _libc_madvise()


def _existing(base: Path, rel: str) -> Path | None:
    """The cgroup's directory under its mount; in a cgroup namespace /proc/self/cgroup
    shows "/" for a cgroup mounted as the root: then the mount itself."""
    for cand in (base / rel, base):
        if cand.is_dir():
            return cand
    return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _int(path: Path) -> int | None:
    """A one-number file; "max" (v2's no limit) and anything unreadable are None."""
    text = (_read(path) or "").strip()
    return int(text) if text.isdigit() else None


def _stat(path: Path) -> dict[str, int]:
    out = {}
    for line in (_read(path) or "").splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[key] = int(value)
    return out


def _meminfo(path: Path) -> dict[str, int]:
    """/proc/meminfo's kB lines in bytes."""
    out = {}
    for line in (_read(path) or "").splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def _psi(path: Path) -> tuple[float | None, float | None]:
    """(some avg10, full avg10) of a PSI file."""
    found: dict[str, float] = {}
    for line in (_read(path) or "").splitlines():
        kind, *fields = line.split()
        for field in fields:
            name, _, value = field.partition("=")
            if name == "avg10":
                with contextlib.suppress(ValueError):
                    found[kind] = float(value)
    return found.get("some"), found.get("full")


__all__ = ["NO_LIMIT", "MemoryPressureReader", "MemoryReading", "release_pages"]
