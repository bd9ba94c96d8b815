"""vLLM's OffloadingWorker (worker process): pages <-> kvstrata's host tier.

A store gathers the vLLM blocks of each chunk from the KV pages, encodes them with
the host codec and writes them into the host slots the manager chose; a load reads
and decodes host slots into the vLLM blocks the scheduler allocated. Both run to
completion inside `submit_*` (on the CPU the copy is the work; vLLM fences the
source blocks of a store until it is reported done), and are reported by
`get_finished`. They cannot fail on a block: the manager only hands out host slots
that hold complete, verified blocks.

Several KV cache groups (vLLM's hybrid allocator: sliding-window and full layers): a
transfer lists each group's vLLM blocks in turn (`group_sizes`), and the host slots
follow in the same order, one per chunk; a group's first chunk may be partial
(`block_indices`: a sliding window that starts inside a chunk), and the blocks a store
does not have (out of the window) are stored as zeros, never read back by vLLM.
Tensor parallel: each worker moves its own share of the heads, in its own column of
the transfer's slots (HostSlotsSpec.of_rank; -1: already stored for this rank).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from kvstrata.core.errors import UnsupportedModelError
from kvstrata.integrations.vllm.backend_plan import BackendPlan
from kvstrata.integrations.vllm.manager import HostSlotsSpec
from kvstrata.integrations.vllm.pages import Pages


class KvstrataOffloadingWorker(OffloadingWorker):
    """Moves blocks between vLLM's KV pages and the shared host tier.

    Args:
        plan: the engine's BackendPlan (the scheduler derived the same one).
        kv_caches: vLLM's canonical KV caches (one byte tensor per layer; its
            group_data_refs give each KV cache group's layers).
        identity: the model identity (plan.model_identity), published to the
            scheduler in the host arena's header.
        rank: this worker's tensor-parallel rank (rank 0 creates the host arena,
            the others join it).
    """

    def __init__(
        self,
        plan: BackendPlan,
        kv_caches: CanonicalKVCaches,
        identity: dict[str, Any],
        rank: int = 0,
    ) -> None:
        groups = kv_caches.group_data_refs
        if len(groups) != len(plan.group_layers) or any(
            len(refs) != layers for refs, layers in zip(groups, plan.group_layers, strict=False)
        ):
            raise UnsupportedModelError(
                f"vLLM registered KV cache groups of {[len(refs) for refs in groups]} layers, "
                f"its config announced {list(plan.group_layers)}: kvstrata cannot read them"
            )
        self.plan, self.rank = plan, rank
        self.pages = [
            Pages([kv_caches.tensors[r.tensor_idx].tensor for r in refs], plan) for refs in groups
        ]
        # vLLM builds the workers first: rank 0 creates the arena, the scheduler opens it
        if rank == 0:
            self.host = plan.host_tier(create=True, identity=identity)
        else:
            self.host = plan.host_tier(create=False, join=True)
        self._finished: list[TransferResult] = []

    def _parts(
        self, spec: GPULoadStoreSpec, slots: HostSlotsSpec
    ) -> list[tuple[Pages, torch.Tensor, int, list[int]]]:
        """Per KV cache group with blocks in the transfer: its pages, its vLLM block
        ids, the blocks to skip in its first chunk, and this rank's host slots."""
        mine = slots.of_rank(self.rank)
        ids = np.asarray(spec.block_ids, dtype=np.int64)
        sizes = spec.group_sizes if spec.group_sizes is not None else [len(ids)]
        indices = spec.block_indices if len(spec.block_indices) else [0] * len(sizes)
        bpc = self.plan.blocks_per_chunk
        parts, b, s = [], 0, 0
        for pages, size, index in zip(self.pages, sizes, indices, strict=True):
            if size == 0:
                continue
            skip = int(index) % bpc
            count = -(-(skip + size) // bpc)  # chunks, the first and last maybe partial
            block_ids = torch.from_numpy(ids[b : b + size])
            parts.append((pages, block_ids, skip, mine[s : s + count]))
            b, s = b + size, s + count
        assert b == len(ids) and s == len(mine), "a transfer covers whole chunks"
        return parts

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        assert isinstance(dst_spec, HostSlotsSpec)
        start = time.perf_counter()
        layout, bpc, tokens = self.plan.layout, self.plan.blocks_per_chunk, self.plan.page_shape[2]
        written = 0
        for pages, block_ids, skip, slots in self._parts(src_spec, dst_spec):
            keep = [i for i, slot in enumerate(slots) if slot >= 0]
            if not keep:
                continue
            n = len(slots)
            partial = skip or (skip + len(block_ids)) % bpc  # blocks out of the window
            alloc = torch.zeros if partial else torch.empty
            k = alloc(layout.raw_shape("k", n), dtype=layout.dtype)
            v = alloc(layout.raw_shape("v", n), dtype=layout.dtype)
            span = slice(skip * tokens, (skip + len(block_ids)) * tokens)
            pages.gather(block_ids, k[:, :, span], v[:, :, span])
            if len(keep) < n:  # shares this rank stored already
                k, v = (x.unflatten(2, (n, -1))[:, :, keep].flatten(2, 3) for x in (k, v))
            self.host.write_blocks([slots[i] for i in keep], k, v)
            written += len(keep)
        self._done(job_id, written * self.host.block_bytes, start)
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        assert isinstance(src_spec, HostSlotsSpec)
        start = time.perf_counter()
        layout = self.plan.layout
        read = 0
        for pages, block_ids, skip, slots in self._parts(dst_spec, src_spec):
            assert min(slots) >= 0, "a load reads every rank's share"
            k = torch.empty(layout.raw_shape("k", len(slots)), dtype=layout.dtype)
            v = torch.empty(layout.raw_shape("v", len(slots)), dtype=layout.dtype)
            self.host.read_blocks(slots, k, v)
            pages.scatter(block_ids, k, v, skip)
            read += len(slots)
        self._done(job_id, read * self.host.block_bytes, start)
        return True

    def _done(self, job_id: int, nbytes: int, start: float) -> None:
        elapsed = time.perf_counter() - start
        self._finished.append(TransferResult(job_id, True, nbytes, elapsed))

    def get_finished(self) -> list[TransferResult]:
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        return  # every transfer has finished by the time submit_* returns

    def shutdown(self) -> None:
        self.host.close()
