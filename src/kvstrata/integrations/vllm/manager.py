"""vLLM's OffloadingManager (scheduler process) over kvstrata's OffloadStore.

vLLM's keys (a 32-byte block hash chained over the prompt, plus the KV group index)
become namespaced kvstrata keys (BackendPlan.key); the load/store specs carry host
slots, which the worker reads and fills.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvstrata.integrations.vllm.remote import RETRY
from kvstrata.integrations.vllm.stats import VllmStats
from kvstrata.integrations.vllm.store import HIT, PENDING, OffloadStore

_RESULTS = {HIT: LookupResult.HIT, PENDING: LookupResult.HIT_PENDING, RETRY: LookupResult.RETRY}
_MEDIUM = {"host": Medium.CPU, "disk": Medium.STORAGE}
_SOURCE = {"disk": CacheHitSource.DISK, "remote": CacheHitSource.EXTERNAL_UNSPECIFIED}


class HostSlotsSpec(LoadStoreSpec):
    """Where a load reads or a store writes: kvstrata host slots, one per vLLM chunk,
    in the order of the keys."""

    def __init__(self, slots: list[int]) -> None:
        self.slots = [int(s) for s in slots]

    def __repr__(self) -> str:
        return f"HostSlotsSpec({self.slots})"


class KvstrataOffloadingManager(OffloadingManager):
    """Tracks the blocks kvstrata holds for one engine (see OffloadStore).

    Args:
        store: the engine's OffloadStore.
        enable_events: publish vLLM KV events (stored / removed keys).
    """

    def __init__(self, store: OffloadStore, enable_events: bool = False) -> None:
        self.store = store
        self.events: list[OffloadingEvent] | None = [] if enable_events else None
        self.vllm_stats = VllmStats()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        result = self.store.lookup(self.store.plan.key(key), bytes(key))
        return _RESULTS.get(result, LookupResult.MISS)

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        tier = self.store.source(self.store.plan.key(key))
        return _SOURCE.get(tier, CacheHitSource.HOST)

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        return HostSlotsSpec(self.store.prepare_load([self.store.plan.key(k) for k in keys]))

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.store.touch([self.store.plan.key(k) for k in keys])

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.store.complete_load([self.store.plan.key(k) for k in keys])

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        vllm_keys = list(keys)
        ours = [self.store.plan.key(k) for k in vllm_keys]
        prepared = self.store.prepare_store(ours, vllm_keys)
        if prepared is None:
            return None
        to_store, slots = prepared
        back = dict(zip(ours, vllm_keys, strict=True))
        evicted = [OffloadKey(k) for tier, k in self.store.evicted_vllm_keys if tier == "host"]
        self._publish_evictions()
        return PrepareStoreOutput(
            keys_to_store=[back[k] for k in to_store],
            store_spec=HostSlotsSpec(slots),
            evicted_keys=evicted,
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        stored = self.store.complete_store([self.store.plan.key(k) for k in keys], success)
        if stored and self.events is not None:
            self.events.append(OffloadingEvent([OffloadKey(k) for k in stored], Medium.CPU, False))

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self.store.end_step()
        self._publish_evictions()

    def _publish_evictions(self) -> None:
        evicted, self.store.evicted_vllm_keys = self.store.evicted_vllm_keys, []
        if self.events is None:
            return
        for tier, medium in _MEDIUM.items():
            keys = [OffloadKey(k) for t, k in evicted if t == tier]
            if keys:
                self.events.append(OffloadingEvent(keys, medium, True))

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self.events:
            events, self.events = self.events, []
            yield from events

    def get_stats(self) -> OffloadingConnectorStats:
        """The counters' increments since the last step (vLLM's /metrics: stats.py)."""
        return self.vllm_stats.collect(self.store)

    def reset_cache(self) -> None:
        self.store.reset()

    def shutdown(self) -> None:
        self.store.close()
