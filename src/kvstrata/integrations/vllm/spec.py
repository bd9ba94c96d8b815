"""The OffloadingSpec vLLM loads by name: `KvstrataOffloadingSpec`.

vLLM builds one spec per process from `kv_connector_extra_config`: the scheduler
process asks it for the manager, the worker process for the worker (first). Both
derive the same BackendPlan, so they agree on the host arena they share; the worker,
which can read vLLM's config, adds the model identity and publishes it there.
"""

from __future__ import annotations

from typing import Any

from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from kvstrata.core.errors import UnsupportedModelError
from kvstrata.integrations.vllm.backend_plan import (
    VllmSide,
    make_plan,
    model_geometry,
    model_identity,
)
from kvstrata.integrations.vllm.manager import KvstrataOffloadingManager
from kvstrata.integrations.vllm.options import VllmOptions
from kvstrata.integrations.vllm.stats import metric_definitions
from kvstrata.integrations.vllm.store import OffloadStore
from kvstrata.integrations.vllm.worker import KvstrataOffloadingWorker


class KvstrataOffloadingSpec(OffloadingSpec):
    """kvstrata tiers (host arena, durable disk) as vLLM's KV offloading backend.

    Raises:
        ConfigError: a bad `kv_connector_extra_config` value (one line).
        UnsupportedModelError: KV cache groups of different page shapes or block
            sizes, MLA, a quantized KV cache other than fp8, pipeline or context parallel.
    """

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        self.options = VllmOptions.from_extra_config(config.extra_config)
        groups = config.groups
        if len({g.tokens_per_block for g in groups}) != 1:
            raise UnsupportedModelError(
                f"{config.model.name} has KV cache groups of "
                f"{[g.tokens_per_block for g in groups]} tokens per block: kvstrata's vLLM "
                "backend stores groups of one block size"
            )
        parallel = config.parallel
        if parallel.pcp_size > 1 or parallel.dcp_size > 1:
            raise UnsupportedModelError(
                f"kvstrata's vLLM backend splits blocks by heads (tensor parallel), not by "
                f"tokens: this engine runs context parallel (prefill {parallel.pcp_size}, "
                f"decode {parallel.dcp_size}); use vLLM's own offloading there"
            )
        side = VllmSide(
            model_name=config.model.name,
            dtype=config.model.dtype,
            num_layers=max(len(g.layer_names) for g in groups),
            tokens_per_block=groups[0].tokens_per_block,
            blocks_per_chunk=self.blocks_per_chunk,
            worker_kv_bytes_per_block=config.worker_kv_bytes_per_block,
            engine_id=config.engine_id,
            world_size=parallel.world_size,
            page_layout="cpu-hnd" if current_platform.is_cpu() else "opaque",
            group_layers=tuple(len(g.layer_names) for g in groups),
            tp_size=parallel.tp_size,
        )
        self.rank = parallel.rank  # 0 in the scheduler process
        self.model_name = config.model.name
        self.plan = make_plan(self.options, side, model_geometry(config.model.name))
        self._manager: KvstrataOffloadingManager | None = None
        self._worker: OffloadingWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            store = OffloadStore(self.plan, self.options)
            self._manager = KvstrataOffloadingManager(
                store, enable_events=self.kv_events_config.enable_kv_cache_events
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            vllm_config = _current_vllm_config()
            _check_heads(vllm_config, self.plan.layout.num_kv_heads, self.plan.page_layout)
            identity = {}  # rank 0 publishes it; the other ranks join its arena
            if self.rank == 0:
                identity = model_identity(self.options, self.model_name, vllm_config)
            self._worker = KvstrataOffloadingWorker(self.plan, kv_caches, identity, self.rank)
        return self._worker

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        """kvstrata's counters in vLLM's Prometheus /metrics (stats.py)."""
        return metric_definitions()


def _current_vllm_config() -> Any:
    """vLLM's config: set while the worker process builds its KV caches (never in the
    scheduler process, which is why the worker publishes the model identity)."""
    from vllm.config import get_current_vllm_config_or_none

    return get_current_vllm_config_or_none()


def _check_heads(vllm_config: Any, num_kv_heads: int, page_layout: str) -> None:
    """The worker process knows vLLM's own view of the model: check the plan's heads
    (one worker's share under tensor parallel)."""
    if vllm_config is None or page_layout != "cpu-hnd":
        return
    heads = vllm_config.model_config.get_num_kv_heads(vllm_config.parallel_config)
    if heads != num_kv_heads:
        raise UnsupportedModelError(
            f"vLLM runs {heads} kv heads per worker, kvstrata planned {num_kv_heads} from "
            "the model's config.json and the tensor-parallel size: it cannot read these "
            "KV pages"
        )
