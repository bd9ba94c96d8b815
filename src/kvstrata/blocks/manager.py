"""BlockManager: sequences -> block tables -> (tier, slot); placement and eviction.

The request-level facade over the pool (ids, ref counts), the tiers (slots, bytes)
and a pure eviction policy. Placement runs only when a step needs new blocks or a
budget changed — decode steps that fill the open block touch no Python per block.

Placement ("cascade"), tiers ordered fastest first:

    tier 0 (device): keep the top-K ranked blocks (K = budget in slots), where the
                     candidates are its evictable blocks + this step's new blocks;
                     the rest spill down
    tier 1 (host):   same, with the spill of tier 0 as incoming
    tier 2 (disk):   same; a spill here is an OutOfBlocksError (decided before any
                     block moves, so a failed append changes nothing)

Invariants: a partially filled block lives on the device (lossy codecs only ever see
full blocks, so a block is encoded once); blocks written in the current step are
not moved until the step ends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstrata.blocks.pool import Block, BlockPool
from kvstrata.blocks.table import BlockTable
from kvstrata.errors import ConfigError, OutOfBlocksError
from kvstrata.layout import BlockLayout
from kvstrata.policies.eviction import BlockView, EvictionPolicy
from kvstrata.tiers.base import Tier
from kvstrata.units import format_bytes


@dataclass
class PendingBlock(Block):
    """A block this step needs, before placement gives it an id, a tier and a slot."""

    seq_id: int = -1
    index: int = -1  # position in the sequence's block table


@dataclass(frozen=True)
class Run:
    """Consecutive blocks of one sequence in consecutive slots of one tier."""

    tier: str
    first_slot: int
    num_slots: int
    token_start: int  # logical position of the run's first token in the sequence
    num_tokens: int


@dataclass
class TokenWrites:
    """Where this step's new tokens go in one tier.

    rows: arena row (slot*bs + offset) per written token.
    src: index of that token in the step's flattened [batch*new_tokens] order.
    """

    tier: str
    rows: torch.Tensor
    src: torch.Tensor
    contiguous: tuple[int, int] | None = None  # (first_row, count) when src is 0..m-1


class BlockManager:
    """Sequences, their block tables, and the placement of every block."""

    def __init__(
        self,
        layout: BlockLayout,
        tiers: list[Tier],
        policy: EvictionPolicy,
        sink_tokens: int = 0,
    ) -> None:
        if not tiers:
            raise ConfigError.field("tiers", [], "at least a device tier")
        self.layout = layout
        self.tiers = {t.name: t for t in tiers}
        self.tier_order = [t.name for t in tiers]
        self.policy = policy
        self.num_sink_blocks = -(-sink_tokens // layout.block_size) if sink_tokens else 0
        self.pool = BlockPool()
        self.tables: dict[int, BlockTable] = {}
        self.budget_slots = {t.name: t.num_slots for t in tiers}
        self.on_tier: dict[str, set[int]] = {t.name: set() for t in tiers}
        self.clock = 0
        self.seq_last_access: dict[int, int] = {}
        self.seq_access_count: dict[int, int] = {}
        self._runs: dict[int, list[Run]] = {}
        self.num_moves = 0
        self.bytes_moved: dict[str, int] = {}

    # -- sequences --------------------------------------------------------------------------
    def add_sequence(self, seq_id: int) -> None:
        if seq_id in self.tables:
            raise AssertionError(f"sequence {seq_id} exists")
        self.tables[seq_id] = BlockTable()
        self.seq_last_access[seq_id] = self.clock
        self.seq_access_count[seq_id] = 0

    def has_sequence(self, seq_id: int) -> bool:
        return seq_id in self.tables

    def num_tokens(self, seq_id: int) -> int:
        return self.tables[seq_id].num_tokens

    def free_sequence(self, seq_id: int) -> None:
        table = self.tables.pop(seq_id)
        for block_id in table.block_ids:
            self._decref(block_id)
        self._runs.pop(seq_id, None)
        self.seq_last_access.pop(seq_id, None)
        self.seq_access_count.pop(seq_id, None)

    def fork(self, src_seq: int, dst_seq: int) -> None:
        """dst shares every block of src (ref counts); the first append to a shared
        partial block copies it (copy on write)."""
        table = self.tables[src_seq].copy()
        for block_id in table.block_ids:
            self.pool.incref(block_id)
        if dst_seq in self.tables:
            self.free_sequence(dst_seq)
        self.tables[dst_seq] = table
        self.seq_last_access[dst_seq] = self.seq_last_access[src_seq]
        self.seq_access_count[dst_seq] = self.seq_access_count[src_seq]
        self._runs.pop(dst_seq, None)

    def remap(self, sources: list[int]) -> None:
        """Replace the sequences by new ones 0..len(sources)-1, where new sequence i
        shares every block of old sequence `sources[i]` (beam reorder, batch repeat,
        batch select). No data is copied; shared partial blocks are copied on write."""
        old_tables = self.tables
        old_access = (self.seq_last_access, self.seq_access_count)
        self.tables, self.seq_last_access, self.seq_access_count = {}, {}, {}
        for new_id, src in enumerate(sources):
            table = old_tables[src].copy()
            for block_id in table.block_ids:
                self.pool.incref(block_id)
            self.tables[new_id] = table
            self.seq_last_access[new_id] = old_access[0][src]
            self.seq_access_count[new_id] = old_access[1][src]
        for table in old_tables.values():
            for block_id in table.block_ids:
                self._decref(block_id)
        self._runs.clear()

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Keep only the first `num_tokens` tokens (crop)."""
        table = self.tables[seq_id]
        if num_tokens >= table.num_tokens:
            return
        bs = self.layout.block_size
        keep = -(-num_tokens // bs)
        if keep and num_tokens % bs:
            # Fix: check the room for bringing a now-partial block back to the device
            # before changing anything (a refused crop used to drop blocks first).
            last = self.pool.blocks[table.block_ids[keep - 1]]
            device = self.tier_order[0]
            if last.ref_count == 1 and last.tier != device:
                freed = sum(
                    1
                    for i in table.block_ids[keep:]
                    if self.pool.blocks[i].ref_count == 1 and self.pool.blocks[i].tier == device
                )
                if self.tiers[device].num_free + freed < 1:
                    raise OutOfBlocksError(self._no_device_slot("a cropped block"))
        for block_id in table.block_ids[keep:]:
            self._decref(block_id)
        del table.block_ids[keep:]
        table.num_tokens = num_tokens
        if keep and num_tokens % bs:
            last = self.pool.blocks[table.block_ids[-1]]
            if last.ref_count == 1:
                last.num_tokens = num_tokens % bs
                if last.tier != self.tier_order[0]:
                    # A partial block must be on the device: bring it back.
                    self._place_partial_on_device(last)
        self._runs.pop(seq_id, None)

    def _decref(self, block_id: int) -> None:
        block = self.pool.decref(block_id)
        if block is not None:
            self.tiers[block.tier].free([block.slot])
            self.on_tier[block.tier].discard(block.block_id)

    # -- budgets ----------------------------------------------------------------------------
    def set_budget(self, tier: str, num_slots: int) -> None:
        """Change a tier's budget at run time (dynamic offload ratio); enforced now."""
        if tier not in self.tiers:
            raise ConfigError.field("tier", tier, f"one of {', '.join(self.tier_order)}")
        if not 0 <= num_slots <= self.tiers[tier].num_slots:
            raise ConfigError.field(
                f"{tier}_budget",
                num_slots,
                f"between 0 and the arena's {self.tiers[tier].num_slots} slots",
            )
        old_budget = self.budget_slots[tier]
        self.budget_slots[tier] = num_slots
        try:
            self._place([], pinned=set())
        except OutOfBlocksError:
            # Fix: a refused budget must not stick (_place decides before moving, so
            # restoring the number restores the whole state).
            self.budget_slots[tier] = old_budget
            raise

    # -- the step ---------------------------------------------------------------------------
    def append(self, seq_ids: list[int], num_new: int) -> list[TokenWrites]:
        """Make room for `num_new` tokens at the end of each sequence.

        Returns where each new token goes: per tier, arena rows and the index of the
        token in the flattened [len(seq_ids) * num_new] order of this step.
        """
        self.clock += 1
        bs = self.layout.block_size
        device = self.tier_order[0]
        new_blocks: list[PendingBlock] = []
        pinned: set[int] = set()
        copied: list[tuple[int, int, bool]] = []  # (seq_id, old block, sole owner)
        try:
            for seq_id in seq_ids:
                self.seq_last_access[seq_id] = self.clock
                self.seq_access_count[seq_id] += 1
                table = self.tables[seq_id]
                if table.block_ids and table.num_tokens % bs:
                    last = self.pool.blocks[table.block_ids[-1]]
                    if last.ref_count > 1 or last.tier != device:
                        # Fix: an open block this sequence owns alone can sit below the
                        # device once the other owners of a shared full block are gone
                        # (crop, then free/remap); it is copied up too, and the original
                        # is released only when the step succeeds (pinned until then).
                        sole = last.ref_count == 1
                        self._copy_on_write(seq_id, pinned, release=not sole)
                        copied.append((seq_id, last.block_id, sole))
                        if sole:
                            pinned.add(last.block_id)
                        last = self.pool.blocks[table.block_ids[-1]]
                    pinned.add(last.block_id)
                total = table.num_tokens + num_new
                first_new = len(table.block_ids)
                for idx in range(first_new, -(-total // bs)):
                    new_blocks.append(
                        PendingBlock(
                            block_id=-1,
                            ref_count=1,
                            is_sink=idx < self.num_sink_blocks,
                            num_tokens=min(bs, total - idx * bs),
                            seq_id=seq_id,
                            index=idx,
                        )
                    )
            if new_blocks or copied:
                # Fix: copies on write take device slots too; place (and check the
                # device budget) even when the step needs no new block.
                self._place(new_blocks, pinned)
        except OutOfBlocksError:
            # Fix: a refused step changes nothing: undo this step's copies on write
            # (they used to stay, leaving a copied block behind after the error).
            self._undo_copy_on_write(copied)
            raise
        for _seq_id, old_id, sole in copied:
            if sole:
                self._decref(old_id)
        # Build the token write plan.
        rows_by_tier: dict[str, list[int]] = {}
        src_by_tier: dict[str, list[int]] = {}
        for b_idx, seq_id in enumerate(seq_ids):
            table = self.tables[seq_id]
            start = table.num_tokens
            pos = start
            while pos < start + num_new:
                block = self.pool.blocks[table.block_ids[pos // bs]]
                off = pos % bs
                take = min(bs - off, start + num_new - pos)
                base = block.slot * bs + off
                rows_by_tier.setdefault(block.tier, []).extend(range(base, base + take))
                src0 = b_idx * num_new + (pos - start)
                src_by_tier.setdefault(block.tier, []).extend(range(src0, src0 + take))
                block.num_tokens = off + take
                pos += take
            table.num_tokens = start + num_new
            runs = self._runs.get(seq_id)
            if runs is not None and not new_blocks and runs and runs[-1].tier == device:
                last = runs[-1]
                runs[-1] = Run(
                    last.tier,
                    last.first_slot,
                    last.num_slots,
                    last.token_start,
                    last.num_tokens + num_new,
                )
            else:
                self._runs.pop(seq_id, None)
        writes = []
        for tier_name, rows in rows_by_tier.items():
            src = src_by_tier[tier_name]
            contiguous = None
            if src == list(range(len(src))) and rows == list(range(rows[0], rows[0] + len(rows))):
                contiguous = (rows[0], len(rows))
            writes.append(TokenWrites(tier_name, torch.tensor(rows), torch.tensor(src), contiguous))
        return writes

    # -- placement --------------------------------------------------------------------------
    def _views(self, new_count: dict[int, int] | None = None) -> dict[int, BlockView]:
        """Policy views of every live block (shared blocks: newest / most used owner).
        `new_count`: blocks each sequence gains this step (they come after its others)."""
        views: dict[int, BlockView] = {}
        for seq_id, table in self.tables.items():
            # Fix: count this step's new blocks, as their own views do; an old last block
            # used to look as new as the newest new block (blocks_from_end 0).
            n = len(table.block_ids) + (new_count or {}).get(seq_id, 0)
            last, count = self.seq_last_access[seq_id], self.seq_access_count[seq_id]
            for i, block_id in enumerate(table.block_ids):
                block = self.pool.blocks.get(block_id)
                if block is None:
                    continue
                v = BlockView(block_id, block.is_sink, n - 1 - i, last, count)
                old = views.get(block_id)
                if old is None or self.policy.keep_key(v) > self.policy.keep_key(old):
                    views[block_id] = v
        return views

    def _place(self, new_blocks: list[PendingBlock], pinned: set[int]) -> None:
        bs = self.layout.block_size
        new_count: dict[int, int] = {}
        for block in new_blocks:
            seq_id = block.seq_id
            new_count[seq_id] = new_count.get(seq_id, 0) + 1
        views = self._views(new_count)
        for i, block in enumerate(new_blocks):
            seq_id, idx = block.seq_id, block.index
            total_blocks = len(self.tables[seq_id].block_ids) + new_count[seq_id]
            views[-(i + 1)] = BlockView(
                -(i + 1),
                block.is_sink,
                total_blocks - 1 - idx,
                self.clock,
                self.seq_access_count[seq_id],
            )
        new_key = {id(b): -(i + 1) for i, b in enumerate(new_blocks)}

        # Decide (no side effects yet): which blocks end on which tier.
        incoming: list[Block] = list(new_blocks)
        decisions: list[tuple[str, list[Block], list[Block]]] = []  # (tier, arrive, leave)
        for depth, name in enumerate(self.tier_order):
            budget = self.budget_slots[name]
            resident = [self.pool.blocks[i] for i in self.on_tier[name]]
            fixed = [b for b in resident if b.block_id in pinned or b.num_tokens < bs]
            movable = [b for b in resident if not (b.block_id in pinned or b.num_tokens < bs)]
            must = [b for b in incoming if b.num_tokens < bs] if depth == 0 else []
            if depth > 0 and any(b.num_tokens < bs for b in incoming):
                raise AssertionError("partial blocks never leave the device")
            room = budget - len(fixed) - len(must)
            if room < 0:
                need = (len(fixed) + len(must)) * self.tiers[name].block_bytes
                raise OutOfBlocksError(
                    f"{name} tier needs {format_bytes(need)} for blocks being written "
                    f"(open blocks of {len(self.tables)} sequences) but its budget is "
                    f"{format_bytes(budget * self.tiers[name].block_bytes)}: raise "
                    f"{name}_budget or lower block_size"
                )
            cands = movable + [b for b in incoming if b.num_tokens >= bs]

            def key(b: Block) -> tuple:
                vid = new_key.get(id(b), b.block_id)
                return self.policy.keep_key(views[vid])

            ranked = sorted(cands, key=key, reverse=True)
            keep, spill = ranked[:room], ranked[room:]
            arrive = must + [b for b in keep if b.tier != name]
            leave = [b for b in spill if b.tier == name]
            decisions.append((name, arrive, leave))
            incoming = spill
            # Fix: no early exit when nothing spills: a lower tier whose budget just
            # shrank (set_budget) must still demote its own surplus.
        if incoming:
            need = len(incoming) * self.layout.raw_block_bytes
            avail = ", ".join(
                f"{n}={format_bytes(self.budget_slots[n] * self.tiers[n].block_bytes)}"
                for n in self.tier_order
            )
            raise OutOfBlocksError(
                f"all tiers are full: {len(incoming)} more blocks "
                f"({format_bytes(need)} raw) needed, budgets {avail}; raise host_budget "
                f"or disk_budget (or use a smaller codec on the lower tiers)"
            )
        # Execute, deepest tier first so every move finds a free slot. Fix: a block that
        # spills through several tiers moves straight to the tier that keeps it (it used
        # to move one tier down only, overfilling that tier past its budget).
        dest = {id(b): name for name, arrive, _leave in decisions for b in arrive}
        for _name, _arrive, leave in reversed(decisions):
            by_dest: dict[str, list[Block]] = {}
            for b in sorted(leave, key=lambda b: b.block_id):
                by_dest.setdefault(dest[id(b)], []).append(b)
            for dst_name in sorted(by_dest, key=self.tier_order.index, reverse=True):
                self._move(by_dest[dst_name], dst_name)
        for name, arrive, _leave in decisions:
            fresh = [b for b in arrive if b.block_id == -1]
            self._install_new(name, fresh)

    def _install_new(self, tier_name: str, blocks: list[PendingBlock]) -> None:
        tier = self.tiers[tier_name]
        # Group by sequence so each sequence's new blocks get consecutive slots.
        by_seq: dict[int, list[Block]] = {}
        for b in blocks:
            by_seq.setdefault(b.seq_id, []).append(b)
        for seq_id, group in by_seq.items():
            group.sort(key=lambda b: b.index)
            table = self.tables[seq_id]
            after = None
            if table.block_ids:
                prev = self.pool.blocks[table.block_ids[-1]]
                if prev.tier == tier_name:
                    after = prev.slot
            slots = tier.allocate(len(group), after=after)
            if slots is None:
                raise AssertionError(f"{tier_name}: placement promised {len(group)} free slots")
            for b, slot in zip(group, slots, strict=True):
                real = self.pool.new_block(tier_name, slot)
                real.num_tokens = 0
                real.is_sink = b.is_sink
                idx = b.index
                # table positions are appended in order: fill holes in order of idx
                while len(table.block_ids) <= idx:
                    table.block_ids.append(-1)
                table.block_ids[idx] = real.block_id
                self.on_tier[tier_name].add(real.block_id)
            self._runs.pop(seq_id, None)

    def _move(self, blocks: list[Block], dst_name: str) -> None:
        """Move full blocks (all layers) of one tier to another, freeing their old slots."""
        src_name = blocks[0].tier
        src, dst = self.tiers[src_name], self.tiers[dst_name]
        slots = dst.allocate(len(blocks))
        if slots is None:
            raise AssertionError(f"{dst_name}: no free slots for a planned move")
        src_slots = [b.slot for b in blocks]
        self._copy_data(src, src_slots, dst, slots)
        src.free(src_slots)
        link = f"{src_name}->{dst_name}"
        self.bytes_moved[link] = self.bytes_moved.get(link, 0) + len(blocks) * dst.block_bytes
        self.num_moves += len(blocks)
        for block, slot in zip(blocks, slots, strict=True):
            self.on_tier[src_name].discard(block.block_id)
            block.tier, block.slot = dst_name, slot
            self.on_tier[dst_name].add(block.block_id)
        self._runs.clear()

    def _copy_data(self, src: Tier, src_slots: list[int], dst: Tier, dst_slots: list[int]) -> None:
        if src.codec.name == dst.codec.name:  # encoded as is: quantized once, never twice
            dst.write_encoded(dst_slots, src.read_encoded(src_slots))
            return
        n = len(src_slots)
        k = torch.empty(self.layout.raw_shape("k", n), dtype=self.layout.dtype)
        v = torch.empty(self.layout.raw_shape("v", n), dtype=self.layout.dtype)
        src.read_blocks(src_slots, k, v)
        dst.write_blocks(dst_slots, k, v)

    def _copy_on_write(self, seq_id: int, pinned: set[int], release: bool = True) -> None:
        table = self.tables[seq_id]
        old = self.pool.blocks[table.block_ids[-1]]
        device = self.tiers[self.tier_order[0]]
        if not device.can_allocate(1):
            # Fix: keep this step's open blocks pinned (an earlier copy, full by its
            # metadata, could otherwise be demoted while the step writes into it).
            self._place([], pinned=pinned)
        slots = device.allocate(1)
        if slots is None:
            # Fix: the message now states bytes and the budget to raise.
            raise OutOfBlocksError(self._no_device_slot("a copy-on-write block"))
        self._copy_data(self.tiers[old.tier], [old.slot], device, slots)
        new = self.pool.new_block(device.name, slots[0])
        new.num_tokens, new.is_sink = old.num_tokens, old.is_sink
        self.on_tier[device.name].add(new.block_id)
        table.block_ids[-1] = new.block_id
        if release:
            self._decref(old.block_id)
        self._runs.pop(seq_id, None)

    def _undo_copy_on_write(self, copied: list[tuple[int, int, bool]]) -> None:
        """Point each sequence back at the block it copied and drop the copy."""
        for seq_id, shared_id, sole in reversed(copied):
            table = self.tables[seq_id]
            if not sole:
                self.pool.incref(shared_id)
            copy_id = table.block_ids[-1]
            table.block_ids[-1] = shared_id
            self._decref(copy_id)
            self._runs.pop(seq_id, None)

    def _no_device_slot(self, what: str) -> str:
        device = self.tiers[self.tier_order[0]]
        return (
            f"device tier has no free slot ({format_bytes(device.block_bytes)}) for {what}: "
            f"all {device.num_slots} slots "
            f"({format_bytes(device.capacity_bytes)}) hold blocks being written; "
            f"raise device_budget or lower block_size"
        )

    def _place_partial_on_device(self, block: Block) -> None:
        device = self.tier_order[0]
        if not self.tiers[device].can_allocate(1):
            raise OutOfBlocksError(self._no_device_slot("a cropped block"))
        self._move([block], device)

    # -- reading ----------------------------------------------------------------------------
    def runs(self, seq_id: int) -> list[Run]:
        """The sequence's tokens as runs of consecutive slots per tier, in order."""
        cached = self._runs.get(seq_id)
        if cached is not None:
            return cached
        bs = self.layout.block_size
        table = self.tables[seq_id]
        runs: list[Run] = []
        for i, block_id in enumerate(table.block_ids):
            block = self.pool.blocks[block_id]
            ntok = min(bs, table.num_tokens - i * bs)
            if runs:
                r = runs[-1]
                if (
                    r.tier == block.tier
                    and r.first_slot + r.num_slots == block.slot
                    and (r.num_tokens == r.num_slots * bs)
                ):
                    runs[-1] = Run(
                        r.tier, r.first_slot, r.num_slots + 1, r.token_start, r.num_tokens + ntok
                    )
                    continue
            runs.append(Run(block.tier, block.slot, 1, i * bs, ntok))
        self._runs[seq_id] = runs
        return runs

    def blocks_of(self, seq_id: int) -> list[Block]:
        return [self.pool.blocks[i] for i in self.tables[seq_id].block_ids]

    # -- stats ------------------------------------------------------------------------------
    def occupancy(self) -> dict[str, dict[str, int]]:
        out = {}
        for name in self.tier_order:
            tier = self.tiers[name]
            out[name] = {
                "used_blocks": tier.num_used,
                "budget_blocks": self.budget_slots[name],
                "capacity_blocks": tier.num_slots,
                "used_bytes": tier.used_bytes,
                "block_bytes": tier.block_bytes,
                "peak_used_blocks": tier.stats.peak_used_slots,
            }
        return out
