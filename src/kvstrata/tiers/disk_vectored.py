"""DiskTier's direct path: chunks of blocks move between the arena and the caller's
field tensors in place, one iovec per contiguous piece, checksummed (XXH3-64, one
streaming state per region, in file order) on the way by the native kernels. See
disk_format for the templates and the native call this builds on.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from kvstrata.core.errors import TierIOError
from kvstrata.tiers.disk_format import (
    SlotFormat,
    Template,
    build_template,
    direct_view,
    exchange,
    native_io,
)


class VectoredIO:
    """In-place (vectored) reads and writes of chunks of blocks.

    Args:
        fmt: the slot format.
        native: the native library (kvstrata/platform/csrc/pio.cpp).
        io_threads: threads the native call may split a chunk over.
        stored_sums: the index's per-layer checksums [num_slots, L], which reads verify.
        io_error: (OSError, slots, what) -> the TierIOError a failed call raises.
    """

    def __init__(
        self,
        fmt: SlotFormat,
        native: object,
        io_threads: int,
        stored_sums: np.ndarray,
        io_error: Callable[[OSError, list[int], str], TierIOError],
    ) -> None:
        self.fmt = fmt
        self.native = native
        self.io_threads = io_threads
        self.stored_sums = stored_sums
        self.io_error = io_error
        self._templates: dict[tuple, Template] = {}

    def _plan(
        self, tensors: dict[str, torch.Tensor], nl: int, item_bytes: int
    ) -> tuple[Template, list[np.ndarray]]:
        """Template and in-place views for moving `tensors` (key -> field tensor of
        the chunk); keys that cannot be viewed in place go through staging."""
        fmt = self.fmt
        views = {}
        for key, t in tensors.items():
            spec = fmt.spec_of[key]
            view = direct_view(t, spec.rows, spec.nbytes)
            if view is not None:
                views[key] = view
        direct = tuple(key for key in fmt.regions if key in views)
        tkey = (direct, nl, item_bytes)
        tpl = self._templates.get(tkey)
        if tpl is None:
            tpl = build_template(
                fmt.regions, list(direct), fmt.num_kv_heads, fmt.layer_bytes, nl, item_bytes
            )
            self._templates[tkey] = tpl
        return tpl, [views[key] for key in direct]

    def write(
        self,
        fd: int,
        chunk: list[int],
        src: dict[str, torch.Tensor],
        full: np.ndarray,
        stag3: np.ndarray,
    ) -> np.ndarray:
        """Checksum and write a chunk straight from the field tensors `src` (staging
        `full` [c, slot_bytes], viewed as stag3 [c, L, layer_bytes], takes the rest);
        returns the per-layer sums [c, L]."""
        fmt = self.fmt
        L, lb = fmt.num_layers, fmt.layer_bytes
        tpl, views = self._plan(src, L, fmt.slot_bytes)
        for g0, g1 in tpl.gaps:  # padding is written as zeros
            stag3[:, :, g0:g1] = 0
        full[:, L * lb :] = 0
        for key in fmt.regions:
            if key not in tpl.keys:
                exchange(fmt.field_bytes(stag3, key), src[key], True)
        base = np.asarray(chunk, dtype=np.int64) * fmt.slot_bytes
        try:
            sums, _ = native_io(self.native, fd, tpl, views, full, base, L, True, self.io_threads)
        except OSError as exc:
            raise self.io_error(exc, chunk, f"writing slots {chunk}") from exc
        return sums

    def read(
        self,
        fd: int,
        chunk: list[int],
        layer: int | None,
        dest: dict[str, torch.Tensor],
        full: np.ndarray,
        stag3: np.ndarray,
        missing: list[int],
        corrupt: list[int],
    ) -> bool:
        """Read a chunk straight into the field tensors `dest` and verify it while it
        is in cache. Appends bad slots to missing/corrupt and zeroes their bytes in
        `dest` (nothing unverified is left behind); False if any."""
        fmt = self.fmt
        tpl, views = self._plan(dest, stag3.shape[1], full.shape[1])
        base = np.asarray(chunk, dtype=np.int64) * fmt.slot_bytes
        if layer is not None:
            base += layer * fmt.layer_bytes
        try:
            got, past_end = native_io(
                self.native, fd, tpl, views, full, base, stag3.shape[1], False, self.io_threads
            )
        except OSError as exc:
            for view in views:  # nothing unverified is left behind
                view[...] = 0
            raise self.io_error(exc, chunk, f"reading slots {chunk}") from exc
        short = [chunk[j] for j in np.flatnonzero(past_end)]
        layers = slice(None) if layer is None else slice(layer, layer + 1)
        want = self.stored_sums[np.asarray(chunk)][:, layers]
        bad = np.flatnonzero((got != want).any(axis=1))
        if len(bad) == 0 and not short:
            for key in fmt.regions:
                if key not in tpl.keys:
                    exchange(fmt.field_bytes(stag3, key), dest[key], False)
            return True
        missing.extend(short)
        corrupt.extend(s for s in (chunk[j] for j in bad) if s not in short)
        bad = np.union1d(bad, np.flatnonzero(past_end))
        for view in views:
            view[:, :, bad] = 0
        return False
