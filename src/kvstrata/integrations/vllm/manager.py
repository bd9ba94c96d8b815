"""vLLM's OffloadingManager (scheduler process) over kvstrata's OffloadStore.

vLLM's keys (a 32-byte block hash chained over the prompt, plus the KV group index)
become namespaced kvstrata keys (BackendPlan.key): one per KV cache group, as vLLM's
key names the group, and under tensor parallel one per worker (rank) — a vLLM key is
a hit only when every worker's share is. vLLM's connector asks for every group a
request needs and takes a hit only when all of them hit (sliding-window groups: the
chunks of the window). The load/store specs carry host slots, which the workers read
and fill.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    Locality,
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
    """Where a load reads or a store writes: kvstrata host slots, per vLLM chunk in the
    order of the keys, `ranks` of them (one per tensor-parallel worker, rank order);
    -1 where that worker's share is stored already (a store skips it)."""

    def __init__(self, slots: list[int], ranks: int = 1) -> None:
        self.slots = [int(s) for s in slots]
        self.ranks = ranks
        assert len(self.slots) % ranks == 0

    def of_rank(self, rank: int) -> list[int]:
        """The slots of the worker of tensor-parallel rank `rank`, one per chunk."""
        return self.slots[rank :: self.ranks]

    def __repr__(self) -> str:
        return f"HostSlotsSpec({self.slots}, ranks={self.ranks})"


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

    def _keys(self, key: bytes) -> list[bytes]:
        """kvstrata's keys of vLLM's key: one per tensor-parallel rank."""
        plan = self.store.plan
        return [plan.key(key, rank) for rank in range(plan.tp_size)]

    def _all_keys(self, keys: Iterable[bytes]) -> list[bytes]:
        return [ours for key in keys for ours in self._keys(key)]

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        shares = self._keys(key)
        if len(shares) > 1:  # a rank's share not held: a miss, before any share is leased
            absent = next((o for o in shares if self.store.index.get(o) is None), None)
            if absent is not None:
                self.store.lookup(absent, bytes(key))  # counted: a lookup and a miss
                return LookupResult.MISS
        result = HIT
        for ours in shares:  # every rank's share, or a miss
            found = self.store.lookup(ours, bytes(key))
            if found not in _RESULTS:
                return LookupResult.MISS
            if found != HIT and result != RETRY:
                result = found
        return _RESULTS[result]

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        tier = self.store.source(self._keys(key)[0])
        return _SOURCE.get(tier, CacheHitSource.HOST)

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        slots = self.store.prepare_load(self._all_keys(keys))
        return HostSlotsSpec(slots, self.store.plan.tp_size)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.store.touch(self._all_keys(keys))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.store.complete_load(self._all_keys(keys))

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        vllm_keys = list(dict.fromkeys(keys))
        ranks = self.store.plan.tp_size
        ours = [self._keys(k) for k in vllm_keys]
        flat = [o for per_rank in ours for o in per_rank]
        prepared = self.store.prepare_store(flat, [k for k in vllm_keys for _ in range(ranks)])
        if prepared is None:
            return None
        to_store, slots = prepared
        slot_of = dict(zip(to_store, slots, strict=True))
        keys_to_store, spec = [], []
        for vllm_key, per_rank in zip(vllm_keys, ours, strict=True):
            new = [o for o in per_rank if o in slot_of]
            if not new:
                continue  # every share stored already
            if any(self.store.index.get(o) is None for o in per_rank):
                self._release(new)  # a share found no room: this key is not stored
                continue
            keys_to_store.append(vllm_key)
            spec.extend(slot_of.get(o, -1) for o in per_rank)
        evicted = [OffloadKey(k) for tier, k in self.store.evicted_vllm_keys if tier == "host"]
        self._publish_evictions()
        if not keys_to_store and prepared[0]:
            return None  # slots were had, but for no whole key
        return PrepareStoreOutput(
            keys_to_store=[OffloadKey(k) for k in keys_to_store],
            store_spec=HostSlotsSpec(spec, ranks),
            evicted_keys=list(dict.fromkeys(evicted)),
        )

    def _release(self, keys: list[bytes]) -> None:
        """Give back host slots prepared for shares of a key that is not stored."""
        before = len(self.store.evicted_vllm_keys)
        self.store.complete_store(keys, False)
        del self.store.evicted_vllm_keys[before:]  # never stored: nothing to announce

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        stored = self.store.complete_store(self._all_keys(keys), success)
        if stored and self.events is not None:
            stored = list(dict.fromkeys(stored))  # one per rank
            self.events.append(OffloadingEvent([OffloadKey(k) for k in stored], Medium.CPU, False))

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self.store.end_step()
        self._publish_evictions()

    def _publish_evictions(self) -> None:
        """The step's disk write-throughs (a copy on STORAGE, besides the CPU one
        `complete_store` announced), the blocks the shared remote tier's server stored
        (STORAGE, REMOTE; never announced removed: the server evicts without telling),
        and every copy that left a tier."""
        evicted, self.store.evicted_vllm_keys = self.store.evicted_vllm_keys, []
        on_disk, self.store.disk_stored_vllm_keys = self.store.disk_stored_vllm_keys, []
        remote = self.store.remote.take_written() if self.store.remote is not None else []
        if self.events is None:
            return
        if remote:  # reachable from every engine that shares the server: REMOTE
            keys = [OffloadKey(k) for k in dict.fromkeys(remote)]
            self.events.append(OffloadingEvent(keys, Medium.STORAGE, False, Locality.REMOTE))
        if on_disk:  # removal_expected: vLLM keeps the block's hashes for its disk removal
            keys = [OffloadKey(k) for k in dict.fromkeys(on_disk)]
            self.events.append(
                OffloadingEvent(keys, Medium.STORAGE, False, Locality.LOCAL, removal_expected=True)
            )
        for tier, medium in _MEDIUM.items():
            keys = [OffloadKey(k) for k in dict.fromkeys(k for t, k in evicted if t == tier)]
            if keys:
                locality = Locality.LOCAL if medium is Medium.STORAGE else None
                self.events.append(OffloadingEvent(keys, medium, True, locality))

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
