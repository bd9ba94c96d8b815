"""Applying a NUMA plan (kvstrata.platform.numa): pin a thread, bind a region's pages.

Memory is bound with `mbind(2)` on the arena's own mapping, right after `mmap` and
before any page of it is touched — not by first touch. First touch puts a page on the
node of the CPU that faults it in, and an arena's first writer is not its reader: a
pinned arena is faulted in whole by `cudaHostRegister` on the calling thread, a
pageable one by whichever thread writes each block first (the engine thread, a disk
reader, a GPU's copy engine through a pinned buffer), and a page stays where it first
landed. `mbind` states the node once, for the mapping, whoever touches it and whenever;
the thread's own policy and other allocations of the process are left alone.

The mode is `MPOL_PREFERRED` for one node (its pages come from that node while it has
room, then from the nearest other one: a full node slows the arena down instead of
killing the process, which `MPOL_BIND` would do through the OOM killer) and
`MPOL_INTERLEAVE` for several. `mbind` is a system call glibc does not wrap (libnuma
does, but is not always installed): it is made through `syscall(2)` with the number of
this architecture. A kernel or sandbox that refuses it (ENOSYS, EPERM under seccomp)
leaves the memory where first touch puts it, and the caller says so.

Threads are pinned with `os.sched_setaffinity(0, cpus)`, which on Linux sets the
calling thread's mask only; threads it starts afterwards (a disk writer, the remote
write-behind thread, OpenMP's pool when it is first used) inherit it.
"""

from __future__ import annotations

import ctypes
import os
import platform

MPOL_PREFERRED = 1
MPOL_BIND = 2
MPOL_INTERLEAVE = 3
MPOL_F_NODE = 1 << 0  # get_mempolicy: the node of the page at addr, not the policy
MPOL_F_ADDR = 1 << 1  # get_mempolicy: the policy (or node) of addr, not the thread's
POLICIES = {"preferred": MPOL_PREFERRED, "interleave": MPOL_INTERLEAVE, "bind": MPOL_BIND}

# (mbind, get_mempolicy) system call numbers per architecture (the kernel's syscall tables).
_SYSCALLS = {
    "x86_64": (237, 239),
    "aarch64": (235, 236),
    "arm64": (235, 236),
    "ppc64le": (259, 260),
    "s390x": (268, 269),
}
_WORD_BITS = 8 * ctypes.sizeof(ctypes.c_ulong)


def _syscall_numbers() -> tuple[int, int] | None:
    if os.uname().sysname != "Linux":
        return None
    return _SYSCALLS.get(platform.machine())


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def _nodemask(nodes: tuple[int, ...] | list[int]) -> tuple[ctypes.Array, int]:
    """(mask words, maxnode) for the kernel: one bit per node, and the mask's bit count
    plus one (the kernel reads maxnode - 1 bits, as libnuma passes it)."""
    words = max(nodes) // _WORD_BITS + 1
    mask = (ctypes.c_ulong * words)()
    for node in nodes:
        mask[node // _WORD_BITS] |= 1 << (node % _WORD_BITS)
    return mask, words * _WORD_BITS + 1


def bind_region(address: int, nbytes: int, nodes: tuple[int, ...], policy: str) -> None:
    """Bind the pages of [address, address + nbytes) to `nodes` with `policy`
    ('preferred', 'interleave' or 'bind'): pages touched from now on come from there.

    `address` must be page-aligned (an mmap'd region is); the length is rounded up to
    whole pages by the kernel.

    Raises:
        OSError: the kernel refused (the errno says why: ENOSYS, EPERM, EINVAL for a
            node it does not have), or this platform has no mbind.
    """
    numbers = _syscall_numbers()
    if numbers is None:
        raise OSError(38, f"mbind: not available on {platform.machine()} {os.uname().sysname}")
    if not nodes:
        raise ValueError("bind_region needs at least one node")
    mask, maxnode = _nodemask(nodes)
    libc = _libc()
    rc = libc.syscall(
        ctypes.c_long(numbers[0]),
        ctypes.c_void_p(address),
        ctypes.c_ulong(nbytes),
        ctypes.c_int(POLICIES[policy]),
        mask,
        ctypes.c_ulong(maxnode),
        ctypes.c_uint(0),
    )
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mbind({policy}, nodes {list(nodes)}): {os.strerror(err)}")


def region_policy(address: int) -> tuple[int, list[int]]:
    """(mode, nodes) of the memory policy that covers `address` (get_mempolicy with
    MPOL_F_ADDR): what `bind_region` set, for checks and stats.

    Raises:
        OSError: the kernel refused, or this platform has no get_mempolicy.
    """
    numbers = _syscall_numbers()
    if numbers is None:
        raise OSError(38, "get_mempolicy: not available here")
    mode = ctypes.c_int(0)
    words = 1024 // _WORD_BITS
    mask = (ctypes.c_ulong * words)()
    rc = _libc().syscall(
        ctypes.c_long(numbers[1]),
        ctypes.byref(mode),
        mask,
        ctypes.c_ulong(words * _WORD_BITS),
        ctypes.c_void_p(address),
        ctypes.c_ulong(MPOL_F_ADDR),
    )
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"get_mempolicy: {os.strerror(err)}")
    nodes = [
        w * _WORD_BITS + b for w in range(words) for b in range(_WORD_BITS) if mask[w] >> b & 1
    ]
    return mode.value, nodes


def page_node(address: int) -> int:
    """The node the (touched) page at `address` is on (get_mempolicy MPOL_F_NODE |
    MPOL_F_ADDR).

    Raises:
        OSError: the kernel refused, or this platform has no get_mempolicy.
    """
    numbers = _syscall_numbers()
    if numbers is None:
        raise OSError(38, "get_mempolicy: not available here")
    node = ctypes.c_int(-1)
    rc = _libc().syscall(
        ctypes.c_long(numbers[1]),
        ctypes.byref(node),
        ctypes.c_void_p(None),
        ctypes.c_ulong(0),
        ctypes.c_void_p(address),
        ctypes.c_ulong(MPOL_F_NODE | MPOL_F_ADDR),
    )
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"get_mempolicy: {os.strerror(err)}")
    return node.value


def pin_thread(cpus: tuple[int, ...] | frozenset[int]) -> bool:
    """Pin the calling thread to `cpus` (threads it starts later inherit the mask).
    False, having changed nothing, where the platform has no affinity call or the
    kernel refuses the set (CPUs outside the process's cgroup)."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return False
    try:
        os.sched_setaffinity(0, set(cpus))
    except OSError:
        return False
    return True
