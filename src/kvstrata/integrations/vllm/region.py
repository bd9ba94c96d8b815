"""The host tier both vLLM processes map: kvstrata's HostTier over a shared file.

vLLM runs the offloading manager in its scheduler process and the worker in a worker
process. The worker encodes pages into host slots and decodes them back; the manager
allocates and evicts the slots, reads them to write the disk tier, and writes blocks
it promotes from disk. So the host tier's arenas live in one file in shared memory
(/dev/shm), mapped by both:

    [ header 4 KiB: magic, JSON line ][ arena k.<field> ][ arena v.<field> ] ...
    arena = [num_layers, num_kv_heads, num_slots * rows, cols] (kvstrata.core.layout), each
    starting on a 64-byte boundary, in sorted field order

Roles. vLLM builds the worker before the scheduler (EngineCore initializes the KV
caches, which creates the worker, then builds its Scheduler, which creates the
manager), so the worker is the *creator* and the manager only *opens*:

- the creator removes any file left under the name (a crashed start; also, under any
  name, an arena whose creator is no longer running), creates a new
  one with O_EXCL, reserves its memory (posix_fallocate: a /dev/shm smaller than the
  arena is a one-line ConfigError at start-up, never a SIGBUS later) and writes the
  header: the plan's arena digest, its pid, a random nonce and the model identity
  (plan.model_identity, which only the worker can read from vLLM's config);
- the opener (the manager) refuses a missing file, a header of another plan, and a
  file whose creator is not this engine's worker: the creator must be alive and be
  this process (vLLM's "uni" executor; the nonce must then be the one this process
  published) or a child of it (the "mp" executor: the worker process is a child of
  EngineCore, the scheduler's process). A stale file is never adopted. The opener
  then removes the file's name, so nothing is left in /dev/shm after start-up (the
  creator also removes it when it closes, in case the manager never came).

Under tensor parallel vLLM runs one worker process per rank, all children of EngineCore
and built at once: rank 0 creates the arena, the other ranks *join* it — they wait
(JOIN_TIMEOUT_S) for a file of this plan whose creator is a live sibling (a stale one
is waited out, never adopted), map it and leave its name to the scheduler.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import mmap
import os
import secrets
import time
from typing import Any

import torch

from kvstrata.codecs.base import Codec
from kvstrata.core.errors import ConfigError, KvstrataError
from kvstrata.core.layout import KINDS, BlockLayout
from kvstrata.core.units import format_bytes
from kvstrata.tiers.base import Tier
from kvstrata.tiers.disk_lock import pid_alive
from kvstrata.tiers.memory import MemoryTier

log = logging.getLogger(__name__)
HEADER_BYTES = 4096
MAGIC = b"kvstrata-vllm-host-2\n"
ALIGN = 64
PREFIX = "kvstrata-vllm-"  # plan.region_path's file names
JOIN_TIMEOUT_S = 120.0  # how long a worker of rank > 0 waits for rank 0's arena
# path -> nonce of the region this process created under it (the "uni" executor runs
# the worker in the scheduler's process: the opener checks the nonce against this)
_CREATED: dict[str, str] = {}


class SharedRegion:
    """A file of `nbytes` (plus the header) mapped MAP_SHARED; see the module docstring.

    Args:
        path: the file (BackendPlan.region_path).
        nbytes: bytes of the arenas.
        digest: the plan's arena digest, written (creator) or checked (opener).
        create: True in the worker (creator), False in the manager (opener).
        identity: what the creator publishes for the opener (JSON-able dict).
        join: a worker of tensor-parallel rank > 0 (create=False): wait for the
            creator's arena, accept a sibling creator, keep the file's name.

    Raises:
        ConfigError: the arena does not fit in the shared-memory filesystem (creator).
        KvstrataError: no arena to open, an arena of another plan, or a stale one; a
            joiner that waited JOIN_TIMEOUT_S in vain.
    """

    def __init__(
        self,
        path: str,
        nbytes: int,
        digest: str,
        *,
        create: bool,
        identity: dict[str, Any] | None = None,
        join: bool = False,
    ) -> None:
        self.path = path
        self.created = create
        self.size = HEADER_BYTES + nbytes
        header: dict[str, Any] = {}
        if create:
            fd = self._create(nbytes)
        elif join:
            fd, header = self._join(digest)
        else:
            fd = self._open()
        try:
            self._ino = os.fstat(fd).st_ino
            self._map = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            if create:
                self.unlink()
            raise
        finally:
            os.close(fd)
        if create:
            self.nonce = secrets.token_hex(16)
            self.identity = identity or {}
            self._write_header(digest)
            _CREATED[path] = self.nonce
        elif join:  # the scheduler opens it after every worker: it removes the name
            self.nonce, self.identity = header["nonce"], header.get("identity", {})
        else:
            header = self._read_header(digest)
            self.nonce, self.identity = header["nonce"], header.get("identity", {})
            self.unlink()  # both processes have it mapped: its name is no longer needed
        self.buffer = torch.frombuffer(self._map, dtype=torch.uint8, offset=HEADER_BYTES)

    # -- creator ---------------------------------------------------------------------------
    def _create(self, nbytes: int) -> int:
        sweep_stale(os.path.dirname(self.path))
        for _ in range(3):
            if os.path.lexists(self.path):
                log.warning(
                    "kvstrata: removed a stale host arena %s (left by an earlier start)", self.path
                )
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                break
            except FileExistsError:  # another creator in between: try once more
                continue
        else:
            raise KvstrataError(
                f"cannot create the host arena {self.path}: another engine with the same "
                "engine_id keeps creating it; give each engine its own engine_id"
            )
        try:
            reserve(fd, self.size, nbytes, self.path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            raise
        return fd

    def _write_header(self, digest: str) -> None:
        line = json.dumps(
            {"digest": digest, "pid": os.getpid(), "nonce": self.nonce, "identity": self.identity},
            sort_keys=True,
            separators=(",", ":"),
        ).encode()
        header = MAGIC + line + b"\n"
        if len(header) > HEADER_BYTES:
            raise KvstrataError(
                f"the model identity is too long for the host arena's header ({len(header)} "
                f"bytes > {HEADER_BYTES}): set model_key"
            )
        self._map[: len(header)] = header

    # -- opener ----------------------------------------------------------------------------
    def _open(self) -> int:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            raise KvstrataError(
                f"no host arena at {self.path}: vLLM's worker creates it before the scheduler "
                "opens it; kvstrata's vLLM backend needs the worker in the scheduler's "
                "process or a child of it (executor 'uni' or 'mp')"
            ) from None
        have = os.fstat(fd).st_size
        if have < self.size:
            os.close(fd)
            raise KvstrataError(
                f"the host arena {self.path} has {have} bytes, this process planned "
                f"{self.size}: the scheduler and the worker disagree on the kvstrata settings"
            )
        return fd

    def _read_header(self, digest: str) -> dict[str, Any]:
        header = _parse_header(bytes(self._map[:HEADER_BYTES]))
        if header is None:
            raise KvstrataError(f"{self.path} is not a kvstrata host arena of this version")
        if header["digest"] != digest:
            raise KvstrataError(
                f"{self.path} holds another host arena (plan {header['digest']}, this process "
                f"planned {digest}): the scheduler and the worker disagree on the kvstrata "
                "settings"
            )
        pid, nonce = header["pid"], header["nonce"]
        ours = pid == os.getpid() and _CREATED.get(self.path) == nonce
        child = pid != os.getpid() and pid_alive(pid) and _parent(pid) in (os.getpid(), None)
        if not (ours or child):
            raise KvstrataError(
                f"{self.path} is a stale host arena (created by process {pid}, which is not "
                "this engine's worker): kvstrata never adopts it; the worker replaces it "
                "when it starts (remove the file, or give each engine its own engine_id)"
            )
        return header

    # -- joiner (tensor-parallel rank > 0) --------------------------------------------------
    def _join(self, digest: str) -> tuple[int, dict[str, Any]]:
        """Wait for rank 0's arena of this plan (complete header, live sibling creator)."""
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while True:
            with contextlib.suppress(FileNotFoundError):
                fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
                header = None
                if os.fstat(fd).st_size >= self.size:
                    header = _parse_header(os.pread(fd, HEADER_BYTES, 0))
                if header is not None and header["digest"] != digest:
                    os.close(fd)
                    raise KvstrataError(
                        f"{self.path} holds another host arena (plan {header['digest']}, this "
                        f"worker planned {digest}): the workers disagree on the kvstrata settings"
                    )
                if header is not None and _peer(header, self.path):
                    return fd, header
                os.close(fd)  # not written yet, or stale: rank 0 replaces it
            if time.monotonic() > deadline:
                raise KvstrataError(
                    f"no host arena of this plan at {self.path} after {JOIN_TIMEOUT_S:.0f} s: "
                    "the worker of rank 0 creates it (kvstrata's vLLM backend needs vLLM's "
                    "'mp' executor for tensor parallel, its workers on one machine)"
                )
            time.sleep(0.05)

    # -- both ------------------------------------------------------------------------------
    def unlink(self) -> None:
        """Remove the file's name when it is still this region's file (the mappings
        stay valid); a no-op when it is gone or replaced."""
        with contextlib.suppress(FileNotFoundError):
            if os.stat(self.path).st_ino == self._ino:
                os.unlink(self.path)


def _peer(header: dict[str, Any], path: str) -> bool:
    """Whether an arena's creator is a fellow worker: a live sibling process (vLLM's
    "mp" executor), or this very process (workers driven in one process)."""
    pid = header["pid"]
    if pid == os.getpid():
        return _CREATED.get(path) == header["nonce"]
    return isinstance(pid, int) and pid_alive(pid) and _parent(pid) == os.getppid()


def _parse_header(raw: bytes) -> dict[str, Any] | None:
    """The header's fields, or None when it is not (yet) a complete header."""
    raw = raw.split(b"\0", 1)[0]
    header: Any = None
    if raw.startswith(MAGIC):
        with contextlib.suppress(ValueError):
            header = json.loads(raw[len(MAGIC) :])
    if not isinstance(header, dict) or not {"digest", "pid", "nonce"} <= header.keys():
        return None
    return header


def sweep_stale(base: str) -> list[str]:
    """Remove the host arenas in `base` whose creator is gone (a crashed start under
    another engine_id: its reserved memory would stay taken until a reboot). A file
    whose header names a live process, or cannot be read yet, is left alone."""
    removed = []
    try:
        names = [n for n in os.listdir(base) if n.startswith(PREFIX) and n.endswith(".host")]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(base, name)
        try:
            with open(path, "rb") as f:
                raw = f.read(HEADER_BYTES).split(b"\0", 1)[0]
            pid = json.loads(raw[len(MAGIC) :])["pid"] if raw.startswith(MAGIC) else None
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(pid, int) and not pid_alive(pid):
            with contextlib.suppress(OSError):
                os.unlink(path)
                removed.append(path)
                log.warning(
                    "kvstrata: removed %s, left by process %d (no longer running)", path, pid
                )
    return removed


def reserve(fd: int, size: int, nbytes: int, path: str) -> None:
    """Give the file `size` bytes of real memory now (a shared-memory file that
    outgrows /dev/shm is a SIGBUS on first touch): ENOSPC is a ConfigError on
    host_budget; a filesystem without fallocate gets a plain (sparse) size."""
    fallocate = getattr(os, "posix_fallocate", None)
    if fallocate is not None:
        try:
            fallocate(fd, 0, size)
            return
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise _no_room(path, nbytes) from None
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
    os.ftruncate(fd, size)


def _no_room(path: str, nbytes: int) -> ConfigError:
    base = os.path.dirname(path)
    try:
        st = os.statvfs(base)
        free = format_bytes(st.f_bavail * st.f_frsize)
    except OSError:
        free = "unknown"
    return ConfigError.field(
        "host_budget",
        format_bytes(nbytes),
        f"the host arena does not fit in {base} ({free} free): lower host_budget, or "
        f"enlarge {base} (e.g. docker run --shm-size=..., or a larger tmpfs)",
    )


def _parent(pid: int) -> int | None:
    """The parent pid of `pid` (Linux /proc), or None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2 :].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def arena_bytes(layout: BlockLayout, num_slots: int, codec: Codec) -> int:
    """Bytes of the arenas of a host tier (alignment included)."""
    total = 0
    for _, shape, dtype in _arena_shapes(layout, num_slots, codec):
        total = _aligned(total) + _numel(shape) * torch.empty((), dtype=dtype).element_size()
    return _aligned(total)


def _arena_shapes(
    layout: BlockLayout, num_slots: int, codec: Codec
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    out = []
    for kind in KINDS:
        for fname, spec in sorted(codec.fields(kind, layout).items()):
            shape = (layout.num_layers, layout.num_kv_heads, num_slots * spec.rows, spec.cols)
            out.append((f"{kind}.{fname}", shape, spec.dtype))
    return out


def _aligned(offset: int) -> int:
    return (offset + ALIGN - 1) // ALIGN * ALIGN


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class SharedHostTier(MemoryTier):
    """kvstrata's host tier (codec, slots, reads and writes) with its arenas in a
    SharedRegion. Each process keeps its own slot allocator: only the manager's
    allocates; the worker is told which slots to fill or read.

    Args:
        layout: the block layout (BackendPlan.layout).
        num_slots: host slots (BackendPlan.host_slots).
        codec: the host codec.
        path: the region's file (BackendPlan.region_path).
        digest: the plan's arena digest (BackendPlan.arena_digest), written into, and
            checked against, the header.
        create: True in the worker (creates the file), False in the manager (opens it).
        identity: the model identity the worker publishes (create=True only).
        join: a worker of tensor-parallel rank > 0 (see SharedRegion).
    """

    def __init__(
        self,
        layout: BlockLayout,
        num_slots: int,
        codec: Codec,
        path: str,
        digest: str,
        *,
        create: bool,
        identity: dict[str, Any] | None = None,
        join: bool = False,
    ) -> None:
        super().__init__("host", layout, 0, codec, "cpu")  # empty arenas, replaced below
        Tier.__init__(self, "host", layout, num_slots, codec)
        self.region = SharedRegion(
            path,
            arena_bytes(layout, num_slots, codec),
            digest,
            create=create,
            identity=identity,
            join=join,
        )
        offset = 0
        self.arenas = {}
        for key, shape, dtype in _arena_shapes(layout, num_slots, codec):
            offset = _aligned(offset)
            nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
            raw = self.region.buffer[offset : offset + nbytes]
            self.arenas[key] = raw.view(dtype).view(shape)
            offset += nbytes
        self.k_arena = self.arenas["k.data"] if self.zero_copy else None
        self.v_arena = self.arenas["v.data"] if self.zero_copy else None

    def close(self) -> None:
        self.region.unlink()
