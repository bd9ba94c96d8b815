"""Staging of cold blocks for attention: two fixed buffers, double-buffered.

Blocks that cannot be attended where they live (a lossy codec on the host, the disk
tier, or host RAM across PCIe with CUDA) are decoded/copied one layer at a time into
a staging buffer on the compute device. Two buffers of `tokens_per_buffer` tokens:
while the attention works on chunk i in one, the TransferEngine loads chunk i+1 (or
the next layer's first chunk) into the other.

    layer l:   [load c0 → buf A] [attend A | load c1 → B] [attend B | load c2 → A] ...
    end of l:  [prefetch layer l+1 c0 → free buffer]

Device memory for cold data is therefore 2 × tokens_per_buffer, whatever the context.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import Future

import torch

from kvstrata.blocks.manager import Run
from kvstrata.layout import BlockLayout
from kvstrata.tiers.base import Tier
from kvstrata.transfer import TransferEngine

ChunkKey = tuple[int, str, int, int]
"""(layer, tier name, first slot, number of slots)."""


class Stager:
    """Two staging buffers and the transfers that fill them."""

    def __init__(
        self,
        tiers: dict[str, Tier],
        layout: BlockLayout,
        device: torch.device,
        staging_tokens: int,
        device_name: str,
    ) -> None:
        bs = layout.block_size
        per_buffer = max(staging_tokens // 2, bs)
        self.tokens_per_buffer = per_buffer - per_buffer % bs
        self.tiers = tiers
        self.layout = layout
        self.device_name = device_name
        self.buffers = [
            (
                torch.empty(
                    (layout.num_kv_heads, self.tokens_per_buffer, layout.head_dim),
                    dtype=layout.dtype,
                    device=device,
                ),
                torch.empty(
                    (layout.num_kv_heads, self.tokens_per_buffer, layout.dim_v),
                    dtype=layout.dtype,
                    device=device,
                ),
            )
            for _ in range(2)
        ]
        self.engine = TransferEngine(max_workers=1)
        self._current = 1
        self._inflight: dict[ChunkKey, tuple[Future, int]] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.buffers for t in pair)

    def chunks(self, run: Run, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """Chunks of a cold run clipped to tokens [lo, hi): (first_slot, count, base)."""
        bs = self.layout.block_size
        first_block = (lo - run.token_start) // bs
        last_block = (hi - 1 - run.token_start) // bs
        per_chunk = self.tokens_per_buffer // bs
        return [
            (run.first_slot + c0, min(per_chunk, last_block + 1 - c0), run.token_start + c0 * bs)
            for c0 in range(first_block, last_block + 1, per_chunk)
        ]

    def parts(
        self, layer: int, run: Run, lo: int, hi: int, then: ChunkKey | None = None
    ) -> Iterator[tuple[torch.Tensor, ...]]:
        """(k, v) views of the staged keys [lo, hi) of a cold run, chunk by chunk; the
        next chunk loads while the caller attends the current one, and after the last
        chunk `then` (e.g. the next layer's first chunk) starts loading."""
        bs = self.layout.block_size
        chunks = self.chunks(run, lo, hi)
        for i, (first, count, base) in enumerate(chunks):
            buf = self._load((layer, run.tier, first, count))
            if i + 1 < len(chunks):
                nxt = chunks[i + 1]
                self.prefetch((layer, run.tier, nxt[0], nxt[1]))
            elif then is not None:
                self.prefetch(then)
            sk, sv = self.buffers[buf]
            a, b = max(lo, base) - base, min(hi, base + count * bs) - base
            yield sk[:, a:b], sv[:, a:b]

    def prefetch(self, key: ChunkKey) -> None:
        """Start loading a chunk into the buffer the attention is not using."""
        if key in self._inflight:
            return
        target = 1 - self._current
        self._drop_inflight(target)
        self._inflight[key] = (self._submit(key, target), target)

    def _submit(self, key: ChunkKey, buf: int) -> Future:
        layer, tier_name, first, count = key
        tier = self.tiers[tier_name]
        n = count * self.layout.block_size
        bk, bv = self.buffers[buf]
        slots = list(range(first, first + count))
        # Worker threads do not inherit inference mode; writing the (inference-mode)
        # staging buffers from one outside it is an error.
        inference = torch.is_inference_mode_enabled()

        def load() -> None:
            with torch.inference_mode(inference):
                tier.read_layer(layer, slots, bk[:, :n], bv[:, :n])

        return self.engine.submit(
            load,
            link=f"{tier_name}->{self.device_name}",
            nbytes=count * tier.block_bytes // self.layout.num_layers,
        )

    def _drop_inflight(self, buf: int) -> None:
        """Let a stale (unused) prefetch into `buf` finish before the buffer is reused.
        Its errors are moot: a real load of the same blocks reports them."""
        for other, (fut, target) in list(self._inflight.items()):
            if target == buf:
                del self._inflight[other]
                with contextlib.suppress(Exception):
                    self.engine.wait(fut)

    def _load(self, key: ChunkKey) -> int:
        """The buffer holding chunk `key`, waiting for its prefetch if there is one."""
        hit = self._inflight.pop(key, None)
        if hit is not None:
            self.engine.wait(hit[0])
            self._current = hit[1]
            return hit[1]
        target = 1 - self._current
        self._drop_inflight(target)
        self.engine.wait(self._submit(key, target))
        self._current = target
        return target
