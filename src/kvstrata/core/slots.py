"""Slot-list helpers shared by the tiers."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["slot_runs"]

# Below this many slots a Python loop beats numpy (its fixed cost per call dominates).
_NUMPY_FROM = 512


def slot_runs(slots: Sequence[int] | np.ndarray) -> list[tuple[int, int, int]]:
    """Group `slots` (in their order) into runs of consecutive ids.

    Returns:
        (index in `slots`, first slot, count) per run, in order; e.g. [2, 3, 4, 0, 5]
        -> [(0, 2, 3), (3, 0, 1), (4, 5, 1)]. A repeated id starts a new run.
    """
    n = len(slots)
    if n == 0:
        return []
    first = int(slots[0])
    if (
        isinstance(slots, list)
        and slots[-1] - first == n - 1
        and slots == list(range(first, first + n))
    ):
        return [(0, first, n)]  # the common case, one run, checked at C speed
    if n < _NUMPY_FROM:
        runs: list[tuple[int, int, int]] = []
        i = 0
        while i < n:
            j = i + 1
            while j < n and slots[j] == slots[j - 1] + 1:
                j += 1
            runs.append((i, int(slots[i]), j - i))
            i = j
        return runs
    ids = np.asarray(slots, dtype=np.int64)
    starts = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate(([0], starts))
    counts = np.diff(starts, append=n)
    return list(zip(starts.tolist(), ids[starts].tolist(), counts.tolist(), strict=True))
