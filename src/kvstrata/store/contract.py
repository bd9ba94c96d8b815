"""The store as the engine sees it: a handful of verbs over sequences, and two values.

The engine's scheduler never touches the block manager, the tiers or the arenas (vLLM
hands its scheduler `KVCacheBlocks` "to hide KVCacheManager's internal data structure";
nano-vllm's sees five verbs). What crosses the line, and nothing else:

    build(dtype, num_sequences=)           create the tiers (once, on the engine thread)
    capacity() -> Capacity                 blocks: block size and bytes, the device
                                           budget, all tiers, the per-sequence floor
    blocks_held(num_tokens) -> int         blocks one sequence of that length holds
    add_sequence(ids, salt, lookup)        admit: a sequence starting from its cached
        -> (seq_id, matched tokens)        prefix (storage errors: TierIOError)
    has_sequence(seq_id) / sequence_ids    what is admitted
    demote(seq_id) -> blocks moved         preempt: full blocks to host / disk, nothing lost
    abort_step(seq_ids) / failure(seq_id)  undo a failed step; why a sequence is unusable
    free(seq_id)                           release (its hashed blocks stay cached)
    usage() -> Usage                       occupancy per tier, cached blocks evicted
    stats() / close()                      the store's counters; persist and release files
    record_events(recorder)                report cached-block changes (KV events)
    adapt() -> seconds | None              move budgets to memory pressure (between
                                           steps and while idle; None: fixed budgets)

Extending sequences and writing their K/V is the model adapter's side (the packed
step of `integrations.hf`), which the engine hands the store to without reading it.
`KVStore` implements this protocol; a test checks the engine uses nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvstrata.store.events import KVEventRecorder


@dataclass(frozen=True)
class Capacity:
    """What a built store holds, in blocks of `block_size` tokens (all layer groups).

    Fields:
        block_size: tokens per block.
        block_bytes: bytes of one block on the device tier.
        device_blocks: the device tier's budget.
        total_blocks: every tier's budget together.
        floor_blocks: what one running sequence pins on the device whatever its
            length: its sinks, its open block (and one more while a step crosses a
            block), its residual window above a lossy tier — summed over the groups.
        in_place_blocks: the budgets of the tiers below the device that a step's
            attention reads where they lie, losslessly and at the device's speed (host
            RAM when the CPU computes): a running sequence's older blocks may live
            there instead of the request being preempted. 0 where lower tiers are
            staged (a GPU: host RAM across PCIe) or lossy.
    """

    block_size: int
    block_bytes: int
    device_blocks: int
    total_blocks: int
    floor_blocks: int
    in_place_blocks: int = 0


@dataclass(frozen=True)
class Usage:
    """Occupancy per tier (`{tier: {"used_blocks", "cached_blocks", "budget_blocks",
    ...}}`, BlockManager.occupancy) and the cached blocks evicted so far."""

    occupancy: dict[str, dict[str, int]]
    evicted_cached_blocks: int


class EngineStore(Protocol):
    """What the engine may call on its store (see the module docstring)."""

    @property
    def prefix_caching(self) -> bool: ...  # full blocks are hashed, found by add_sequence
    def build(self, dtype: torch.dtype, *, num_sequences: int = 1) -> None: ...
    def capacity(self) -> Capacity: ...
    def blocks_held(self, num_tokens: int) -> int: ...
    def add_sequence(
        self, token_ids: Sequence[int] | None = None, salt: str = "", lookup: bool = True
    ) -> tuple[int, int]: ...
    def has_sequence(self, seq_id: int) -> bool: ...
    @property
    def sequence_ids(self) -> list[int]: ...
    def demote(self, seq_id: int) -> int: ...
    def abort_step(self, seq_ids: list[int] | None = None) -> list[int]: ...
    def failure(self, seq_id: int) -> str | None: ...
    def free(self, seq_id: int) -> None: ...
    def usage(self) -> Usage: ...
    def stats(self) -> dict[str, Any]: ...
    def close(self) -> None: ...
    def record_events(self, recorder: KVEventRecorder | None) -> None: ...
    def adapt(self) -> float | None: ...
