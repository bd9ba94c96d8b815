"""CUDA host memory: page-locked (pinned) host buffers for DMA with CUDA devices.

`pinned_empty` allocates pageable memory of exactly the requested size and registers
it with `cudaHostRegister` (torch's pinned allocator would round it up to a power of
two: a 70 GiB budget would lock 128 GiB); a finalizer synchronises the device and
unregisters it before the memory is freed. A refusal (locked-memory limit, no CUDA
runtime) is a RuntimeError with nothing left locked and no CUDA error left pending:
the caller decides whether pageable memory will do (the host tier does).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import weakref
from typing import Any

import numpy as np
import torch


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
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
