"""vLLM's KV event wire format as msgspec structs of kvstrata's own (the fleet extra).

Field for field, default for default, as `vllm.distributed.kv_events` declares them:
an `EventBatch` is a msgpack array [ts, events, data_parallel_rank]; each event a
map tagged `"type": "<class name>"` whose fields equal to their default are left
out. A vLLM subscriber decodes these bytes with its own `KVEventBatch` decoder.
Imported only where events are published: msgspec is an optional dependency.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvstrata.store import events as ev

INT_HASH_MASK = (1 << 64) - 1


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Base class of the events (vLLM's)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def external_hash(block_hash: bytes, as_int: bool) -> bytes | int:
    """A block hash as vLLM publishes one: its low 64 bits as an int (vLLM's default,
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1), else the digest's bytes."""
    return int.from_bytes(block_hash, "big") & INT_HASH_MASK if as_int else block_hash


def to_wire(ts: float, events: list[ev.KVEvent], int_hashes: bool, rank: int = 0) -> KVEventBatch:
    """One step's store events as vLLM's KVEventBatch (no LoRA, no extra keys: a tenant
    salt is folded into the hash and never published)."""
    out: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    for e in events:
        if isinstance(e, ev.BlockStored):
            parent = e.parent_block_hash
            out.append(
                BlockStored(
                    block_hashes=[external_hash(h, int_hashes) for h in e.block_hashes],
                    parent_block_hash=None if parent is None else external_hash(parent, int_hashes),
                    token_ids=list(e.token_ids),
                    block_size=e.block_size,
                    lora_id=None,
                    medium=e.medium,
                    lora_name=None,
                    group_idx=e.group_idx,
                    locality=e.locality,
                )
            )
        elif isinstance(e, ev.BlockRemoved):
            hashes = [external_hash(h, int_hashes) for h in e.block_hashes]
            out.append(BlockRemoved(hashes, e.medium, e.group_idx, e.locality))
        else:
            out.append(AllBlocksCleared())
    return KVEventBatch(ts=ts, events=out, data_parallel_rank=rank)
