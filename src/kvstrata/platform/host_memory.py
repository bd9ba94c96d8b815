"""Host memory: CPU arenas on transparent huge pages, and page-locked (pinned) host
buffers for DMA with CUDA devices.

`huge_empty` allocates a large CPU tensor of private anonymous memory, 2 MiB-aligned
and advised `MADV_HUGEPAGE`: Linux backs it with transparent huge pages where the
system allows it (`/sys/kernel/mm/transparent_hugepage/enabled` "madvise" or
"always"), else with ordinary pages. Attention reads a tier's arenas as many runs a
few KiB long (a decode step's pages of every layer and head; query-aware selection's
chosen pages lie apart), and on 4 KiB pages each run is (presumably) a TLB miss and a
page walk: decode attention over long contexts was measured markedly faster from huge
pages than from ordinary ones, both in the native kernel alone and through the engine
(docs/MEASUREMENTS.md). torch's allocator gives no such advice (a large `torch.empty`
is a malloc'd mapping the kernel only backs with huge pages when THP is "always").

`pinned_empty` allocates pageable memory of exactly the requested size and registers
it with `cudaHostRegister` (torch's pinned allocator would round it up to a power of
two: a 70 GiB budget would lock 128 GiB); a finalizer synchronises the device and
unregisters it before the memory is freed. A refusal (locked-memory limit, no CUDA
runtime) is a RuntimeError with nothing left locked and no CUDA error left pending:
the caller decides whether pageable memory will do (the host tier does).

`huge_empty`, `cpu_empty` and `pinned_empty` take `numa=(nodes, policy)`: the mapping is
bound to those NUMA nodes (`kvstrata.platform.numa_bind.bind_region`) before any of its
pages is touched; where the kernel refuses, first touch places them (one warning).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import warnings
import weakref
from typing import Any

import numpy as np
import torch

from kvstrata.platform.numa_bind import bind_region

HUGE_PAGE = 2 << 20  # x86-64's and arm64's (4 KiB base pages) PMD size
HUGE_MIN_BYTES = 4 * HUGE_PAGE  # below this an arena gains too few huge pages to matter
Numa = tuple[tuple[int, ...], str]  # (nodes, policy): see kvstrata.platform.numa_bind
_REFUSED: list[str] = []  # the first mbind refusal of this process (warned about once)


def bind_numa(address: int, nbytes: int, numa: Numa | None) -> bool:
    """Bind a fresh mapping's pages to `numa`'s nodes before they are touched. False
    for None, and (with one warning per process) where the kernel refuses."""
    if numa is None:
        return False
    try:
        bind_region(address, nbytes, *numa)
    except OSError as err:
        if not _REFUSED:
            _REFUSED.append(str(err))
            warnings.warn(
                f"host arena not bound to NUMA node(s) {list(numa[0])} ({err}): its pages "
                "go where they are first touched",
                RuntimeWarning,
                stacklevel=3,
            )
        return False
    return True


def huge_empty(
    shape: tuple[int, ...], dtype: torch.dtype, numa: Numa | None = None
) -> torch.Tensor:
    """An uninitialised CPU tensor on memory advised for transparent huge pages.

    Private anonymous memory (shared anonymous memory is shmem, which THP's "madvise"
    setting does not cover), starting on a 2 MiB boundary, `MADV_HUGEPAGE`; as
    `torch.empty` where the platform has no such advice (not Linux) or the tensor is
    small. Untouched pages are never committed, as with `torch.empty`."""
    nbytes = math.prod(shape) * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    if nbytes < HUGE_MIN_BYTES or advice is None or not flags:
        return torch.empty(shape, dtype=dtype)
    try:
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=flags)
    except OSError:  # no room: torch's allocator says so in its own words
        return torch.empty(shape, dtype=dtype)
    with contextlib.suppress(OSError):  # a kernel without THP: ordinary pages
        region.madvise(advice)
    buf = np.frombuffer(region, dtype=np.uint8)  # the array keeps the mapping alive
    bind_numa(buf.ctypes.data, len(region), numa)
    skip = -buf.ctypes.data % HUGE_PAGE
    return torch.from_numpy(buf[skip : skip + nbytes]).view(dtype).view(shape)


def cpu_empty(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device | str,
    numa: Numa | None = None,
) -> torch.Tensor:
    """`torch.empty` on `device`; on the CPU, `huge_empty` (an arena attention reads)."""
    if torch.device(device).type == "cpu":
        return huge_empty(shape, dtype, numa)
    return torch.empty(shape, dtype=dtype, device=device)


def pinned_empty(
    shape: tuple[int, ...], dtype: torch.dtype, numa: Numa | None = None
) -> torch.Tensor:
    """An uninitialised CPU tensor, page-locked for DMA with CUDA devices.

    Pageable memory of exactly its size, registered with `cudaHostRegister` (torch's
    pinned allocator rounds every allocation up to a power of two: a 2 GiB + 8 MiB
    arena would lock 4 GiB). A finalizer unregisters it before the memory is freed,
    once no tensor or view uses it any more.

    Raises:
        RuntimeError: CUDA refused (or there is no CUDA runtime); nothing stays locked.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    # numpy owns the memory: its finalizer runs before the buffer is freed, and no
    # sooner than the last tensor viewing it is gone (they hold a reference to it)
    # mmap: page-aligned and whole pages of its own (cudaHostRegister locks pages; an
    # arena sharing a page with another allocation could not be registered twice)
    buf = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)
    bind_numa(buf.ctypes.data, nbytes, numa)  # before cudaHostRegister faults it in
    tensor = torch.from_numpy(buf).view(dtype).view(shape)
    try:
        cudart = torch.cuda.cudart()
    except Exception as err:  # a CPU-only torch raises AssertionError here
        raise RuntimeError(f"no CUDA runtime: {err}") from err
    ptr = buf.ctypes.data
    err = cudart.cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        _drain_cuda_error(cudart)
        raise RuntimeError(f"cudaHostRegister: {_cuda_error_string(cudart, err)}")
    weakref.finalize(buf, _host_unregister, cudart, ptr).atexit = False
    return tensor


def _host_unregister(cudart: Any, ptr: int) -> None:
    """Finalizer of a pinned arena's memory, just before it is freed: no copy may still
    be reading or writing it (the device finishes its work), then it is unlocked."""
    with contextlib.suppress(Exception):
        torch.cuda.synchronize()
    if int(cudart.cudaHostUnregister(ptr)) != 0:
        _drain_cuda_error(cudart)


def _cuda_error_string(cudart: Any, err: Any) -> str:
    try:
        return str(cudart.cudaGetErrorString(err))
    except Exception:  # the binding takes its own enum type only
        return f"cudaError {int(err)}"


def _drain_cuda_error(cudart: Any) -> None:
    """A failed CUDA runtime call leaves its error pending in this thread, and the next
    checked CUDA call (an unrelated kernel launch) would raise it: consume it. torch
    binds cudaGetLastError in recent versions; else every libcudart mapped in this
    process is asked through ctypes (best effort)."""
    get_last = getattr(cudart, "cudaGetLastError", None)
    if get_last is not None:
        with contextlib.suppress(Exception):
            get_last()
        return
    try:
        with open("/proc/self/maps") as maps:
            paths = {
                line.split(None, 5)[5].strip().removesuffix(" (deleted)")
                for line in maps
                if "libcudart" in line and len(line.split(None, 5)) == 6
            }
    except OSError:
        return
    for path in sorted(paths):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(path).cudaGetLastError()
