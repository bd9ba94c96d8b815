"""A store's thread discipline: one user thread, and sequences released from elsewhere.

A mixin of `KVStore`. A store (and every TieredCache over it) is used by one thread,
the first that uses it; a call from another is refused at once. Sequences released
from another thread or from a finalizer (which the garbage collector may run in the
middle of any operation) are queued and freed at the store's next step.
"""

from __future__ import annotations

import threading

from kvstrata.core.errors import KvstrataError


class OneThread:
    """`check_thread`, `handover`, `release` (see the module docstring)."""

    _thread: int | None
    _orphans: list[int]
    _closed: bool
    _seqs: dict
    manager: object

    def check_thread(self) -> None:
        """A store (and every TieredCache over it) is used by one thread: the first
        one that uses it. A call from another thread is refused — interleaved steps
        would move blocks under each other's reads. Hand a store over explicitly with
        `handover()` once the old thread has stopped using it."""
        me = threading.get_ident()
        if self._thread is None:
            self._thread = me
        elif self._thread != me:
            raise KvstrataError(
                f"this KVStore is in use by thread {self._thread}, called from thread {me}: "
                "stores and TieredCaches are not thread-safe; use one per thread, or call "
                "store.handover() in the new thread after the old one stopped using it"
            )

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def is_user_thread(self) -> bool:
        """The calling thread may use the store (it is its user, or it has none yet)."""
        return self._thread in (None, threading.get_ident())

    def handover(self) -> None:
        """Make the calling thread the store's user (the previous one must be done)."""
        self._thread = threading.get_ident()

    def release(self, seq_ids: list[int], defer: bool = False) -> None:
        """Free sequences a cache no longer uses: now when called from the store's
        thread, else (or with `defer`, e.g. from a finalizer, which the garbage
        collector may run in the middle of another operation or on another thread)
        at the store's next `add_sequence` / `extend`."""
        if self._closed or self.manager is None:
            return
        if defer or not self.is_user_thread:
            self._orphans.extend(seq_ids)  # one atomic list operation
            return
        for seq_id in seq_ids:
            if seq_id in self._seqs:
                self.free(seq_id)

    def _free_orphans(self) -> None:
        while self._orphans:
            seq_id = self._orphans.pop()
            if seq_id in self._seqs:
                self.free(seq_id)
