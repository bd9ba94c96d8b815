"""KV events: which cached blocks a store holds, and on which tier, as they change.

A `KVEventRecorder` attached to a built store (`KVStore.record_events`) hears every
change to the blocks a later request can hit — full blocks in the prefix index, one
indexed copy per content hash — and keeps them as events in vLLM's vocabulary:

- `BlockStored`: a block got a copy on a tier: hashed after a step, installed from
  the remote tier, moved to a tier (device -> host -> disk, or back), or written to
  the shared remote tier (announced once the server stored it);
- `BlockRemoved`: its copy left a tier: moved off it (after the `BlockStored` of
  its new tier, so a consumer never sees it absent), evicted, dropped as corrupt or
  cut by a truncation;
- `AllBlocksCleared`: forget every earlier announcement; recorded when a recorder
  is attached, followed by a `BlockStored` for every block the store already holds
  (after a restart: what the disk tier kept).

A tier is named as vLLM names its media (`MEDIUM_*`, `LOCALITY_*`): the device is
vLLM's primary pool ("GPU", locality unset as vLLM leaves it), host RAM "CPU", the
disk "STORAGE", all three local; the shared remote tier is "STORAGE" with locality
"REMOTE" (every replica reaches it). The server does not report its evictions, so
remote copies are never announced removed.

A block hash is the store's own (`core.hashing`): it already folds in the model,
codecs, layer group and the tenant salt, and nothing else here names the salt.
When a recorder is attached (after a restart: to what the disk kept), the blocks held
are announced chain by chain, each after its parent (the disk index keeps each block's
parent, not its group), and a block whose parent is gone is not announced: no request
can reach it.
`take()` hands the events over once per engine step, merging runs of consecutive
blocks of one chain as vLLM batches them. The store calls the recorder only when one
is attached: without one a step pays a None check per changed cached block.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvstrata.blocks.pool import Block

MEDIUM_GPU = "GPU"  # vLLM's names (vllm.distributed.kv_events, vllm.v1.kv_offload.base)
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
LOCALITY_LOCAL = "LOCAL"
LOCALITY_REMOTE = "REMOTE"
REMOTE_TIER = "remote"  # the tier name events use for the shared remote tier


@dataclass(frozen=True)
class BlockStored:
    """Blocks of one chain that got a copy on one tier (vLLM's `BlockStored`):
    `token_ids` holds `block_size` tokens per hash, `parent_block_hash` is the first
    block's parent (None for a chain's first block, or when unknown)."""

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str
    locality: str | None
    group_idx: int | None
    tier: str  # kvstrata's tier name (not on the wire)


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks whose copy left one tier (vLLM's `BlockRemoved`)."""

    block_hashes: tuple[bytes, ...]
    medium: str
    locality: str | None
    group_idx: int | None
    tier: str


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every block announced before is gone (vLLM's `AllBlocksCleared`)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventSink(Protocol):
    """Where an engine hands each step's events (e.g. a ZMQ publisher). A sink may also
    have `wants_snapshot() -> bool`: True asks the engine to announce everything again
    (AllBlocksCleared, then every block held), e.g. for a subscriber that just joined."""

    def publish(self, ts: float, events: list[KVEvent]) -> None: ...


class RecordsEvents:
    """A mixin of `KVStore`: `record_events` (its prefix index does the wiring)."""

    prefix_index: Any
    checked_manager: Callable[[], object]

    def record_events(self, recorder: KVEventRecorder | None) -> None:
        """Report every change to the store's cached blocks to `recorder` (None: stop):
        first AllBlocksCleared and a BlockStored for every block held now. Built store."""
        self.checked_manager()
        self.prefix_index.record_events(recorder)


@dataclass
class _Meta:
    """What a stored event says about an indexed block besides its tier."""

    parent: bytes | None
    group: int | None
    tier: str
    tokens: tuple[int, ...] = field(default=())


class KVEventRecorder:
    """The events of one store (see the module docstring); used on the store's thread,
    except `remote_written`, which the remote tier's writer thread calls."""

    def __init__(self) -> None:
        self.block_size = 0
        self._media: dict[str, tuple[str, str | None]] = {}
        self._meta: dict[bytes, _Meta] = {}
        self._events: list[KVEvent] = []
        self._remote: deque[KVEvent] = deque()  # appended by the writer thread

    def bind(self, tier_order: list[str], disk: str | None, block_size: int) -> None:
        """The store's tiers, fastest first ([0] the device), its disk tier's name."""
        self.block_size = block_size
        self._media = {REMOTE_TIER: (MEDIUM_STORAGE, LOCALITY_REMOTE)}
        for i, name in enumerate(tier_order):
            if i == 0:
                self._media[name] = (MEDIUM_GPU, None)
            else:
                medium = MEDIUM_STORAGE if name == disk else MEDIUM_CPU
                self._media[name] = (medium, LOCALITY_LOCAL)
        self._meta.clear()

    def medium(self, tier: str) -> tuple[str, str | None]:
        """(medium, locality) of a tier."""
        return self._media[tier]

    # -- what the store reports --------------------------------------------------------------
    def cleared(self) -> None:
        self._meta.clear()
        self._events.append(AllBlocksCleared())

    def stored(self, block: Block, group: int | None) -> None:
        """An indexed block got its copy on its tier (hashed, installed or adopted)."""
        assert block.block_hash is not None
        tokens = tuple(block.token_ids or ())
        self._meta[block.block_hash] = _Meta(block.parent_hash, group, block.tier, tokens)
        self._events.append(self._stored(block.block_hash, self._meta[block.block_hash]))

    def moved(self, blocks: Iterable[Block]) -> None:
        """These blocks moved tier: the indexed ones are stored where they are now, then
        removed from where they were."""
        removed = []
        for block in blocks:
            meta = None if block.block_hash is None else self._meta.get(block.block_hash)
            if meta is None or meta.tier == block.tier:
                continue
            old, meta.tier = meta.tier, block.tier
            self._events.append(self._stored(block.block_hash, meta))
            removed.append(self._removed(block.block_hash, old, meta.group))
        self._events += removed

    def removed(self, block: Block) -> None:
        """An indexed block leaves the index (its copy is dropped)."""
        meta = None if block.block_hash is None else self._meta.pop(block.block_hash, None)
        if meta is not None:
            self._events.append(self._removed(block.block_hash, meta.tier, meta.group))

    def offered(self, blocks: list[tuple[Block, int]]) -> list[tuple[bytes, _Meta]]:
        """What to announce for these (block, group) once the remote tier stored them."""
        out = []
        for block, group in blocks:
            tokens = tuple(block.token_ids or ())
            out.append((block.block_hash, _Meta(block.parent_hash, group, REMOTE_TIER, tokens)))
        return out

    def remote_written(self, offered: list[tuple[bytes, _Meta]], written: list[bool]) -> None:
        """The remote tier's writer thread stored these (`written`: which of them)."""
        for (block_hash, meta), ok in zip(offered, written, strict=False):
            if ok:
                self._remote.append(self._stored(block_hash, meta))

    # -- events out ---------------------------------------------------------------------------
    def take(self) -> list[KVEvent]:
        """The events recorded since the last call, in order, runs merged."""
        events, self._events = self._events, []
        while self._remote:
            events.append(self._remote.popleft())
        return merge_runs(events) if len(events) > 1 else events

    def _stored(self, block_hash: bytes, meta: _Meta) -> BlockStored:
        medium, locality = self._media[meta.tier]
        return BlockStored(
            (block_hash,),
            meta.parent,
            meta.tokens,
            self.block_size,
            medium,
            locality,
            meta.group,
            meta.tier,
        )

    def _removed(self, block_hash: bytes, tier: str, group: int | None) -> BlockRemoved:
        medium, locality = self._media[tier]
        return BlockRemoved((block_hash,), medium, locality, group, tier)


def merge_runs(events: list[KVEvent]) -> list[KVEvent]:
    """Merge neighbouring events as vLLM batches them: a `BlockStored` that continues
    the previous one's chain (same tier and group, its parent the previous last block)
    into it; neighbouring `BlockRemoved` of one tier and group into one."""
    runs: list[list[KVEvent]] = []
    for ev in events:
        prev = runs[-1][-1] if runs else None
        if (
            isinstance(ev, BlockStored)
            and isinstance(prev, BlockStored)
            and (ev.tier, ev.group_idx) == (prev.tier, prev.group_idx)
            and ev.parent_block_hash is not None
            and ev.parent_block_hash == prev.block_hashes[-1]
        ) or (
            isinstance(ev, BlockRemoved)
            and isinstance(prev, BlockRemoved)
            and (ev.tier, ev.group_idx) == (prev.tier, prev.group_idx)
        ):
            runs[-1].append(ev)
        else:
            runs.append([ev])
    return [_joined(run) if len(run) > 1 else run[0] for run in runs]


def _joined(run: list) -> KVEvent:
    first = run[0]
    hashes = tuple(h for ev in run for h in ev.block_hashes)
    if isinstance(first, BlockRemoved):
        return BlockRemoved(hashes, first.medium, first.locality, first.group_idx, first.tier)
    return BlockStored(
        hashes,
        first.parent_block_hash,
        tuple(t for ev in run for t in ev.token_ids),
        first.block_size,
        first.medium,
        first.locality,
        first.group_idx,
        first.tier,
    )


def chain_order(blocks: Iterable[Block]) -> list[Block]:
    """The blocks a prefix lookup can reach, chain by chain, every block after its
    parent (depth first from each chain's first block, ids breaking ties). A block
    whose parent is not among them is left out, with its descendants: no request can
    hit it (a lookup stops at the first missing block), and a consumer that anchors a
    block on its parent (vllm-router) would skip it. A chain in order merges into one
    event."""
    blocks = list(blocks)
    children: dict[bytes | None, list[Block]] = {}
    for block in sorted(blocks, key=lambda b: b.block_id, reverse=True):
        children.setdefault(block.parent_hash, []).append(block)
    out: list[Block] = []
    stack = list(children.get(None, []))  # reversed ids: the lowest id pops first
    while stack:
        block = stack.pop()
        out.append(block)
        stack.extend(children.get(block.block_hash, []))
    return out
