"""vLLM's OffloadingWorker (worker process): pages <-> kvstrata's host tier.

A store gathers the vLLM blocks of each chunk from the KV pages, encodes them with
the host codec and writes them into the host slots the manager chose; a load reads
and decodes host slots into the vLLM blocks the scheduler allocated. Both run to
completion inside `submit_*` (on the CPU the copy is the work; vLLM fences the
source blocks of a store until it is reported done), and are reported by
`get_finished`. They cannot fail on a block: the manager only hands out host slots
that hold complete, verified blocks.
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
from kvstrata.integrations.vllm.manager import HostSlotsSpec
from kvstrata.integrations.vllm.pages import Pages
from kvstrata.integrations.vllm.plan import BackendPlan


class KvstrataOffloadingWorker(OffloadingWorker):
    """Moves blocks between vLLM's KV pages and the shared host tier.

    Args:
        plan: the engine's BackendPlan (the scheduler derived the same one).
        kv_caches: vLLM's canonical KV caches (one byte tensor per layer).
        identity: the model identity (plan.model_identity), published to the
            scheduler in the host arena's header.
    """

    def __init__(
        self, plan: BackendPlan, kv_caches: CanonicalKVCaches, identity: dict[str, Any]
    ) -> None:
        if len(kv_caches.group_data_refs) != 1:
            raise UnsupportedModelError(
                f"kvstrata's vLLM backend offloads one KV cache group; this model has "
                f"{len(kv_caches.group_data_refs)}"
            )
        refs = kv_caches.group_data_refs[0]
        self.plan = plan
        self.pages = Pages([kv_caches.tensors[r.tensor_idx].tensor for r in refs], plan)
        # vLLM builds the worker first: it creates the arena, the scheduler opens it
        self.host = plan.host_tier(create=True, identity=identity)
        self._finished: list[TransferResult] = []

    def _spec_blocks(self, spec: GPULoadStoreSpec, num_slots: int) -> tuple[torch.Tensor, int]:
        """vLLM block ids of a transfer and the blocks to skip in its first chunk."""
        block_ids = torch.from_numpy(np.asarray(spec.block_ids, dtype=np.int64))
        bpc = self.plan.blocks_per_chunk
        skip = int(spec.block_indices[0]) % bpc if len(spec.block_indices) else 0
        assert len(block_ids) + skip == num_slots * bpc, "a transfer covers whole chunks"
        return block_ids, skip

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        assert isinstance(dst_spec, HostSlotsSpec)
        start = time.perf_counter()
        slots = dst_spec.slots
        block_ids, skip = self._spec_blocks(src_spec, len(slots))
        assert skip == 0, "a store starts at a chunk boundary"
        layout = self.plan.layout
        k = torch.empty(layout.raw_shape("k", len(slots)), dtype=layout.dtype)
        v = torch.empty(layout.raw_shape("v", len(slots)), dtype=layout.dtype)
        if slots:
            self.pages.gather(block_ids, k, v)
            self.host.write_blocks(slots, k, v)
        self._done(job_id, len(slots) * self.host.block_bytes, start)
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        assert isinstance(src_spec, HostSlotsSpec)
        start = time.perf_counter()
        slots = src_spec.slots
        block_ids, skip = self._spec_blocks(dst_spec, len(slots))
        layout = self.plan.layout
        k = torch.empty(layout.raw_shape("k", len(slots)), dtype=layout.dtype)
        v = torch.empty(layout.raw_shape("v", len(slots)), dtype=layout.dtype)
        if slots:
            self.host.read_blocks(slots, k, v)
            self.pages.scatter(block_ids, k, v, skip)
        self._done(job_id, len(slots) * self.host.block_bytes, start)
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
