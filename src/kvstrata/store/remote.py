"""The store's side of a remote tier: which blocks to ask for, and where a fetched block
is installed. The session (tiers/remote_session.py) times the steps, decides load or
recompute, fetches and checks a batch and writes behind; this adapter walks the
prompt's chain of block hashes and installs what comes back as cached blocks.

Reads (`fill`, at admission, before the prefix index's own lookup): the prompt's
chain of block hashes is walked per layer group; the blocks no local tier holds, past
the longest local match, are asked for in one round trip — only when the link model
predicts loading them beats recomputing those tokens (the decision is counted), and
within the deadline the link model gives those bytes and tokens. Every
value is checked (tiers/remote_format.py: header, namespace, block hash, lengths,
XXH3, and the token ids against the prompt's); one that fails is a miss, counted,
deleted from the server and recomputed, never served. The longest prefix every group
can then serve is installed as cached blocks on the highest local tier with room
(evicting older cached blocks when needed, never the ones this lookup matched), so
the prefix index finds it like any local hit.

Writes (`offer`, when a step's full blocks are hashed): their stored bytes are copied
on the store's thread and queued; the tier's writer thread encodes them in the remote
codec and sends them. A dropped write costs another server a recompute, nothing else.

Keys name the block hash under a namespace digest of the same extra keys the block
hash carries (core.hashing.block_namespace, via the prefix index) plus the remote
format's version, codec and block shape: another model, weights, codec, layout,
block size or tenant salt is another key.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

from kvstrata.blocks.manager import BlockManager
from kvstrata.blocks.pool import Block
from kvstrata.codecs.base import Codec
from kvstrata.core.hashing import block_hash, namespace_digest
from kvstrata.core.layout import BlockLayout
from kvstrata.model.groups import LayerGroup
from kvstrata.store.events import KVEventRecorder
from kvstrata.store.sequences import longest_match
from kvstrata.tiers.base import Encoded
from kvstrata.tiers.remote import RemoteTier
from kvstrata.tiers.remote_format import RemoteFormat
from kvstrata.tiers.remote_session import RemoteSession, Wanted

ExtraKeys = Callable[[int, str], dict[str, str | int]]


class RemoteBlocks:
    """A remote tier as seen by one store (see the module docstring).

    Args:
        tier: the remote tier (its connection, writer thread, stats and link model).
        layout: the store's block layout.
        codec: the remote codec.
        groups: the store's layer groups.
    """

    def __init__(
        self, tier: RemoteTier, layout: BlockLayout, codec: Codec, groups: list[LayerGroup]
    ) -> None:
        self.tier = tier
        self.layout = layout
        self.format = RemoteFormat(layout, codec)
        self.session: RemoteSession | None = None
        self.groups = groups
        self.block_size = layout.block_size
        self.manager: BlockManager | None = None
        self._extra_keys: ExtraKeys | None = None
        self._ns: dict[tuple[int, str], str] = {}
        self._step: tuple[float, int] | None = None
        self.events: KVEventRecorder | None = None  # set by the prefix index

    def bind(self, manager: BlockManager, extra_keys: ExtraKeys) -> None:
        """The store's block manager and its hash extra keys per (group, salt)."""
        self.manager, self._extra_keys = manager, extra_keys
        self._ns.clear()
        self.session = RemoteSession(self.tier, self.format)

    def namespace(self, group: int, salt: str) -> str:
        ns = self._ns.get((group, salt))
        if ns is None:
            assert self._extra_keys is not None, "RemoteBlocks used before bind()"
            ns = namespace_digest(self._extra_keys(group, salt), **self.format.shape_names)
            self._ns[(group, salt)] = ns
        return ns

    def key(self, group: int, salt: str, block_hash: bytes) -> bytes:
        """The server key of one block (tests read raw keys with it)."""
        return self.format.key(self.namespace(group, salt), block_hash)

    # -- what recomputing costs here ----------------------------------------------------
    def step_began(self, num_tokens: int) -> None:
        self._step = (time.perf_counter(), num_tokens)

    def step_ended(self) -> None:
        if self._step is not None:
            t0, tokens = self._step
            assert self.session is not None, "RemoteBlocks used before bind()"
            self.session.observe_compute(tokens, time.perf_counter() - t0)
            self._step = None

    # -- reads --------------------------------------------------------------------------
    def fill(self, salt: str, token_ids: list[int], limit: int) -> set[int]:
        """Install the remote blocks that extend the local prefix match of `token_ids`
        (up to `limit` full blocks) as cached blocks; returns their block ids."""
        mgr = self.manager
        assert mgr is not None and self._extra_keys is not None, "RemoteBlocks used before bind()"
        bs, stats = self.block_size, self.tier.stats
        hashes: list[list[bytes]] = []
        local: list[list[int | None]] = []
        blocks = mgr.state.pool.blocks
        for g in range(len(self.groups)):
            extra, parent, chain, ids = self._extra_keys(g, salt), None, [], []
            for i in range(limit):
                tokens = tuple(token_ids[i * bs : (i + 1) * bs])
                parent = block_hash(parent, tokens, extra)
                block_id = mgr.state.hash_to_block.get(parent)
                if block_id is not None and blocks[block_id].token_ids != tokens:
                    block_id = None
                chain.append(parent)
                ids.append(block_id)
            hashes.append(chain)
            local.append(ids)
        k0 = longest_match(self.groups, bs, local)
        want = [
            (g, i)
            for g, group in enumerate(self.groups)
            for i in range(group.first_live_block((k0 + 1) * bs, bs), limit)
            if local[g][i] is None
        ]
        if k0 >= limit or not want:
            return set()
        session = self.session
        assert session is not None
        deadline = session.worth_loading(len(want), (limit - k0) * bs)
        if deadline is None:
            return set()
        asked = [
            Wanted(
                self.key(g, salt, hashes[g][i]),
                self.namespace(g, salt),
                hashes[g][i],
                tuple(token_ids[i * bs : (i + 1) * bs]),
            )
            for g, i in want
        ]
        answer = session.fetch(asked, deadline)
        if answer is None:  # down, in backoff or past the deadline: counted by the tier
            return set()
        fetched: dict[tuple[int, int], Encoded] = {
            gi: fields for gi, fields in zip(want, answer.fields, strict=True) if fields is not None
        }
        present: list[list[int | None]] = [list(ids) for ids in local]
        for g, i in fetched:
            present[g][i] = -1  # held remotely
        k = longest_match(self.groups, bs, present)
        needed = [
            (g, i)
            for g, group in enumerate(self.groups)
            for i in range(group.first_live_block(k * bs, bs), k)
            if local[g][i] is None
        ]
        stats.hits += len(needed)
        if k <= k0 or not needed:
            return set()
        protect = {b for ids in local for b in ids if b is not None}
        items = [
            (fetched[(g, i)], hashes[g][i], tuple(token_ids[i * bs : (i + 1) * bs]))
            for g, i in needed
        ]
        chain = [(g, hashes[g][i - 1] if i else None) for g, i in needed]
        return self._install(items, protect, chain)

    def _install(
        self,
        items: list[tuple[Encoded, bytes, tuple[int, ...]]],
        protect: set,
        chain: list[tuple[int, bytes | None]],
    ) -> set:
        """Write fetched blocks to a local tier and index them as cached blocks
        (`chain`: each one's group and parent hash, for the KV events)."""
        mgr = self.manager
        assert mgr is not None
        target = self._room(len(items), protect)
        if target is None:
            self.tier.stats.no_room += 1
            return set()
        tier = mgr.state.tiers[target]
        slots = tier.allocate(len(items))
        assert slots is not None, "room was checked"
        try:
            assert self.session is not None
            self.session.install(tier, slots, [fields for fields, _, _ in items])
        except BaseException:
            tier.free(slots)
            raise
        ids = [
            mgr.adopt_cached(target, slot, h, tokens, parent)
            for (_, h, tokens), slot, (_, parent) in zip(items, slots, chain, strict=True)
        ]
        if self.events is not None:
            for block_id, (g, _) in zip(ids, chain, strict=True):
                self.events.stored(mgr.state.pool.blocks[block_id], g)
        return set(ids)

    def _room(self, n: int, protect: set) -> str | None:
        """The highest tier with `n` free slots in its budget, else the lowest one that
        gets them by evicting cached blocks this lookup did not match."""
        mgr = self.manager
        assert mgr is not None
        state = mgr.state

        def free(name: str) -> int:
            tier = state.tiers[name]
            return min(tier.num_free, state.budget_slots[name] - len(state.on_tier[name]))

        def drop(block_id: int) -> None:
            mgr.evict_cached(block_id)
            state.num_evicted_cached += 1

        for name in state.tier_order:
            if free(name) >= n:
                return name
        for name in reversed(state.tier_order):
            short = n - max(0, free(name))
            if state.hash_to_block.evict(name, short, drop, protect) and free(name) >= n:
                return name
        return None

    # -- writes -------------------------------------------------------------------------
    def offer(self, fresh: list[tuple[Block, int]], salt: str) -> None:
        """Queue the just-hashed full blocks `(block, group)` of one sequence for the
        server (copied now; encoded and sent by the writer thread)."""
        mgr, session = self.manager, self.session
        if not fresh or mgr is None or session is None or not session.available:
            if fresh:
                self.tier.stats.writes_dropped += len(fresh)
            return
        by_tier: dict[str, list[tuple[Block, int]]] = {}
        for block, g in fresh:
            by_tier.setdefault(block.tier, []).append((block, g))
        for name, entries in by_tier.items():
            metas = [
                (self.namespace(g, salt), b.block_hash, tuple(b.token_ids or ()))
                for b, g in entries
            ]
            written = None
            if self.events is not None:
                written = functools.partial(
                    self.events.remote_written, self.events.offered(entries)
                )
            session.write_behind(
                mgr.state.tiers[name], [b.slot for b, _ in entries], metas, written
            )

    # -- lifecycle ----------------------------------------------------------------------
    def stats(self) -> dict:
        return self.tier.as_dict()

    def close(self) -> None:
        self.tier.close()
