"""DiskTier's direct path: chunks of blocks move between the arena and the caller's
field tensors in place, one iovec per contiguous piece, checksummed on the way
(mlh64 only: it is linear, so pieces are summed where they lie). See disk_format
for the templates, iovecs and the native call this builds on.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from kvstrata.errors import TierIOError
from kvstrata.slots import slot_runs
from kvstrata.tiers.disk_format import (
    Checksum,
    SlotFormat,
    Template,
    build_template,
    direct_view,
    exchange,
    iovecs,
    native_io,
    vector_io,
)


class VectoredIO:
    """In-place (vectored) reads and writes of chunks of blocks.

    Args:
        fmt: the slot format.
        checksum: the tier's checksum (linear: mlh64).
        native: the native library (kvstrata/native/pio.cpp), or None for os.preadv /
            os.pwritev and a numpy checksum.
        io_threads: threads the native call may split a chunk over.
        stored_sums: the index's per-layer checksums [num_slots, L], which reads verify.
        io_error: (OSError, slots, what) -> the TierIOError a failed write raises.
    """

    def __init__(
        self,
        fmt: SlotFormat,
        checksum: Checksum,
        native: object | None,
        io_threads: int,
        stored_sums: np.ndarray,
        io_error: Callable[[OSError, list[int], str], TierIOError],
    ) -> None:
        self.fmt = fmt
        self.checksum = checksum
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

    def _sums(self, tpl: Template, views: list[np.ndarray], stag3: np.ndarray) -> np.ndarray:
        """Per-layer mlh64 [c, nl] of a chunk: in-place pieces plus staged gaps."""
        keys = self.checksum.keys
        sums = np.zeros(stag3.shape[:2], dtype=np.uint64)
        for key, view in zip(tpl.keys, views, strict=True):
            off, nbytes = self.fmt.regions[key]
            kw = keys[off // 8 : (off + nbytes) // 8].reshape(self.fmt.num_kv_heads, -1, 1)
            part = np.matmul(view.view(np.uint64), kw)[..., 0]  # [nl, Hkv, c]
            sums += part.sum(axis=1, dtype=np.uint64).T
        for g0, g1 in tpl.gaps:
            sums += stag3[:, :, g0:g1].view(np.uint64) @ keys[g0 // 8 : g1 // 8]
        return sums

    def _move(
        self,
        fd: int,
        chunk: list[int],
        layer: int | None,
        tpl: Template,
        views: list[np.ndarray],
        full: np.ndarray,
        write: bool,
    ) -> list[int]:
        """One preadv/pwritev per run of consecutive slots (per slot for one layer).
        Returns the slots a read found past the end of the file."""
        sb, item = self.fmt.slot_bytes, full.shape[1]
        if layer is None:
            spans = [(j, count, first * sb) for j, first, count in slot_runs(chunk)]
            run_of = np.repeat(np.arange(len(spans)), [r[1] for r in spans])
        else:
            base = layer * self.fmt.layer_bytes
            spans = [(j, 1, slot * sb + base) for j, slot in enumerate(chunk)]
            run_of = np.arange(len(chunk))
        iov, bounds, cum = iovecs(tpl, views, full, item, run_of)
        missing: list[int] = []
        for r, (j, count, offset) in enumerate(spans):
            b0, b1 = int(bounds[r]), int(bounds[r + 1])
            try:
                ok = vector_io(fd, iov[b0:b1], cum[b0 : b1 + 1] - cum[b0], offset, write)
            except OSError as exc:
                if write:
                    raise self.io_error(exc, chunk, f"writing slots {chunk}") from exc
                raise
            if not ok:
                missing.extend(chunk[j : j + count])
        return missing

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
        if self.native is not None:
            base = np.asarray(chunk, dtype=np.int64) * fmt.slot_bytes
            try:
                sums, _ = native_io(
                    self.native, fd, tpl, views, full, base, L, self.checksum.keys,
                    True, self.io_threads,
                )  # fmt: skip
            except OSError as exc:
                raise self.io_error(exc, chunk, f"writing slots {chunk}") from exc
            return sums
        sums = self._sums(tpl, views, stag3)  # also brings the chunk into cache
        self._move(fd, chunk, None, tpl, views, full, write=True)
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
        if self.native is not None:
            base = np.asarray(chunk, dtype=np.int64) * fmt.slot_bytes
            if layer is not None:
                base += layer * fmt.layer_bytes
            got, past_end = native_io(
                self.native, fd, tpl, views, full, base, stag3.shape[1],
                self.checksum.keys, False, self.io_threads,
            )  # fmt: skip
            short = [chunk[j] for j in np.flatnonzero(past_end)]
        else:
            short = self._move(fd, chunk, layer, tpl, views, full, write=False)
            got = self._sums(tpl, views, stag3)
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
        for view in views:
            view[:, :, bad] = 0
        return False
