"""A host tier that yields to memory pressure (`host_pressure="auto"`): a dynamic
offload ratio on a CPU machine.

The host tier's arenas are reserved up front but committed as slots are written, so a
full host tier is real memory. `HostPressure` reads how much memory is left before the
OOM killer (the process's cgroup limit and use, `MemAvailable`, PSI:
`platform.memory_pressure`) at most every `INTERVAL_S`, on the store's own thread (the
engine calls `KVStore.adapt` between steps and while idle; the store moves blocks on
that thread only):

- below `host_headroom` left: the host budget shrinks by what lifts the room to twice
  the headroom, in blocks; with room but PSI's "full" stall share at `PSI_FULL` % or
  more, by an eighth of `host_budget`, once per `PSI_WINDOW_S` (PSI's average trails).
  `BlockManager.set_budget` moves the coldest blocks over the budget down to disk (a
  cached block may be dropped instead, as any eviction), and the pages of the host's
  free slots go back to the kernel (`MemoryTier.release_slots`);
- above twice the headroom, a shrunk budget grows back, by what leaves twice the
  headroom once filled, never past `host_budget`. Between the two nothing moves (the
  hysteresis that keeps the budget from swinging at each reading).

Its decisions and a sampled history of the host budget, use and room are in
`stats()["host_pressure"]` (and in the engine's /metrics).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from kvstrata.blocks.manager import BlockManager
from kvstrata.config import CacheConfig
from kvstrata.core.errors import KvstrataError, OutOfBlocksError
from kvstrata.platform.memory_pressure import MemoryPressureReader, MemoryReading

INTERVAL_S = 0.1  # the shortest time between two readings
HISTORY_S = 0.5  # a history sample at least this often (and at every decision)
HISTORY_LEN = 2400  # samples kept (the newest)
PSI_FULL = 10.0  # % of the last 10 s all tasks stalled on memory: pressure whatever the room
PSI_WINDOW_S = 10.0  # ...which shrinks the host by an eighth at most once per this window
STEP_BYTES = 16 << 20  # a shrink moves at most max(this, its cut / 8) between releases
HOST = "host"


class HostPressure:
    """The host tier's budget under memory pressure (see the module docstring).

    Args:
        manager: the store's block manager (with a host tier).
        headroom: bytes of memory to keep free (`host_headroom`).
        reader: what reads memory (default: this process's, under "/").
        clock: seconds (tests pass their own).
    """

    def __init__(
        self,
        manager: BlockManager,
        headroom: int,
        reader: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.manager = manager
        self.tier = manager.state.tiers[HOST]
        self.configured = manager.state.budget_slots[HOST]
        self.low, self.high = headroom, 2 * headroom
        self.reader = reader if reader is not None else MemoryPressureReader()
        self.clock = clock
        self.start = clock()
        self._next = self._next_sample = self._psi_next = self.start
        self.last: MemoryReading | None = None
        self.decisions = {"shrink": 0, "grow": 0, "refused": 0}
        self.released_bytes = 0
        self._released: set[int] = set()  # the free slots released last time
        self.blocks_moved = 0
        self.history: deque[tuple[float, int, int, int | None]] = deque(maxlen=HISTORY_LEN)
        self._history_view: list[list] | None = None  # stats() runs after every step

    @property
    def budget(self) -> int:
        return self.manager.state.budget_slots[HOST]

    def tick(self) -> float:
        """Read memory (when due) and move the host budget; returns the seconds until
        the next reading is due."""
        now = self.clock()
        if now < self._next:
            return self._next - now
        self._next = now + INTERVAL_S
        reading = self.reader.read()
        self.last = reading
        decided = False
        if reading is not None:
            psi = (reading.psi_full_avg10 or 0.0) >= PSI_FULL
            low = reading.available_bytes < self.low
            if (low or (psi and now >= self._psi_next)) and self.budget > 0:
                decided = self._shrink(reading, psi and not low)
                if psi and not low:  # PSI's average trails: one such cut per window
                    self._psi_next = now + PSI_WINDOW_S
            elif reading.available_bytes > self.high and not psi and self.budget < self.configured:
                decided = self._grow(reading)
        if decided or now >= self._next_sample:
            self._sample(now)
        return INTERVAL_S

    def _shrink(self, reading: MemoryReading, psi: bool) -> bool:
        bb = self.tier.block_bytes
        want = max(0, self.high - reading.available_bytes)
        if psi:
            want = max(want, self.configured * bb // 8)
        cut = max(1, -(-want // bb))
        start = min(self.budget, self.tier.num_used)  # at most what it holds: no refill
        goal = max(0, start - cut)
        step = max(1, STEP_BYTES // bb, cut // 8)
        moves = self.manager.state.num_moves
        try:  # in steps, each one's pages given back before the next: a move's copies
            if self.budget > start:  # take memory while they run
                self.manager.set_budget(HOST, start)  # what it holds: no move, no refill
            target = start
            while target > goal:
                target = max(goal, target - step)
                if not self._try(target):  # the tiers below are full of live blocks:
                    self.decisions["refused"] += 1  # the lowest budget they take
                    lo, hi = target, max(target + 1, min(self.budget, target + step))
                    while hi - lo > 1:
                        mid = (lo + hi) // 2
                        lo, hi = (lo, mid) if self._try(mid) else (mid, hi)
                    if self.budget > hi:
                        self.manager.set_budget(HOST, hi)  # holds no more than now: no move
                    break
                self._release()
        except KvstrataError:  # a disk write failed: the blocks stayed (next reading)
            self.decisions["refused"] += 1
            return False
        finally:
            self.blocks_moved += self.manager.state.num_moves - moves
            self._release()
        self.decisions["shrink"] += 1
        return True

    def _release(self) -> None:
        """Every free host slot's pages back to the kernel (again: a slot written and
        freed since is committed again); the counter counts each slot once while free."""
        free = self.tier.allocator.free_slots()
        self.tier.release_slots(free)
        now = set(free)
        self.released_bytes += len(now - self._released) * self.tier.block_bytes
        self._released = now

    def _try(self, target: int) -> bool:
        try:
            self.manager.set_budget(HOST, target)
        except OutOfBlocksError:
            return False
        return True

    def _grow(self, reading: MemoryReading) -> bool:
        more = (reading.available_bytes - self.high) // self.tier.block_bytes
        target = min(self.configured, self.budget + more)
        if target <= self.budget:
            return False
        self.manager.set_budget(HOST, target)
        self.decisions["grow"] += 1
        return True

    def _sample(self, now: float) -> None:
        self._next_sample = now + HISTORY_S
        avail = self.last.available_bytes if self.last is not None else None
        bb = self.tier.block_bytes
        self._history_view = None
        self.history.append(
            (round(now - self.start, 3), self.budget * bb, self.tier.num_used * bb, avail)
        )

    def stats(self) -> dict[str, Any]:
        """Decisions, the last reading and the history of [seconds since start, host
        budget bytes, host used bytes, available bytes]."""
        r, bb = self.last, self.tier.block_bytes
        return {
            "source": r.source if r is not None else self.reader.source,
            "limit_bytes": r.limit_bytes if r is not None else None,
            "available_bytes": r.available_bytes if r is not None else None,
            "psi_full_avg10": r.psi_full_avg10 if r is not None else None,
            "headroom_bytes": self.low,
            "configured_bytes": self.configured * bb,
            "budget_bytes": self.budget * bb,
            "decisions": dict(self.decisions),
            "blocks_moved": self.blocks_moved,
            "released_bytes": self.released_bytes,
            "history": self._history(),
        }

    def _history(self) -> list[list]:
        if self._history_view is None:
            self._history_view = [list(s) for s in self.history]
        return self._history_view


class AdaptsBudgets:
    """A mixin of `KVStore`: `adapt` and `pressure_stats` (host_pressure="auto")."""

    config: CacheConfig
    manager: BlockManager | None
    checked_manager: Callable[[], BlockManager]
    pressure: HostPressure | None = None

    def adapt(self) -> float | None:
        """Move the host budget to memory pressure now, on the store's thread (the
        engine calls it between steps and while idle). Returns the seconds until it
        wants calling again; None when the budgets are fixed (host_pressure="off", or
        not built yet)."""
        if self.config.host_pressure == "off" or self.manager is None:
            return None
        manager = self.checked_manager()
        if self.pressure is None:
            self.pressure = HostPressure(manager, self.config.host_headroom)
        return self.pressure.tick()

    def pressure_stats(self) -> dict[str, Any] | None:
        return self.pressure.stats() if self.pressure is not None else None


__all__ = ["INTERVAL_S", "PSI_FULL", "AdaptsBudgets", "HostPressure"]
