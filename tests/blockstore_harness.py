"""Test helpers for the block store: tiny tiers, token writes and reads done the way
`TieredCache` does them, a reference model of what each sequence holds, and the
invariant checks shared by the block-manager tests.

Writes mirror `TieredCache._write_layer`: zero-copy arenas take
`k_arena[layer].index_copy_(1, rows, flat_k[:, src])`; other tiers take
`write_layer(layer, rows[::bs] // bs, ...)`. Reads mirror `AttentionRuntime._parts`: a
zero-copy view per run of a memory tier, `read_layer` of the run's slots otherwise.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from kvstrata.blocks.manager import BlockManager, TokenWrites
from kvstrata.core.layout import BlockLayout
from kvstrata.tiers.base import Tier
from kvstrata.tiers.memory import MemoryTier


def tiny_layout(block_size: int = 2, dtype: torch.dtype = torch.float32) -> BlockLayout:
    """2 layers, 2 kv heads, head_dim 4."""
    return BlockLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=block_size, dtype=dtype)


def write_step(
    mgr: BlockManager,
    writes: list[TokenWrites],
    ks: list[torch.Tensor],
    vs: list[torch.Tensor],
) -> None:
    """Store one step's K/V (per layer [batch, Hkv, num_new, D]) where `writes` says.

    Args:
        mgr: the manager whose tiers receive the tokens.
        writes: what `mgr.append` returned for this step.
        ks, vs: one tensor per layer, [batch, Hkv, num_new, D].
    """
    state = mgr.state
    bs = state.layout.block_size
    for layer, (k, v) in enumerate(zip(ks, vs, strict=True)):
        batch, heads, num_new, _ = k.shape
        flat_k = k.transpose(0, 1).reshape(heads, batch * num_new, -1)
        flat_v = v.transpose(0, 1).reshape(heads, batch * num_new, -1)
        for tw in writes:
            tier = state.tiers[tw.tier]
            if getattr(tier, "k_arena", None) is not None:
                tier.k_arena[layer].index_copy_(1, tw.rows, flat_k[:, tw.src])
                tier.v_arena[layer].index_copy_(1, tw.rows, flat_v[:, tw.src])
            else:
                # Blocks placed below the device in a step are new and full: whole slots.
                slots = (tw.rows[::bs] // bs).tolist()
                tier.write_layer(layer, slots, flat_k[:, tw.src], flat_v[:, tw.src])


def read_sequence(mgr: BlockManager, seq_id: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [Hkv, tokens held, D] of one table and layer, read run by run."""
    state = mgr.state
    lay = state.layout
    bs = lay.block_size
    k_parts, v_parts = [], []
    # a sliding-window table starts at its first live block (0 for every other table)
    expected_start = state.tables[seq_id].first_block * bs
    for run in mgr.runs(seq_id):
        assert run.token_start == expected_start, "runs must tile the sequence in order"
        assert 0 < run.num_tokens <= run.num_slots * bs
        assert run.num_tokens > (run.num_slots - 1) * bs, "only a run's last block may be partial"
        expected_start += run.num_tokens
        tier = state.tiers[run.tier]
        if isinstance(tier, MemoryTier) and tier.zero_copy:
            k, v = tier.layer_view(layer, run.first_slot, run.num_slots)
        else:
            n = run.num_slots * bs
            k = torch.empty((lay.num_kv_heads, n, lay.head_dim), dtype=lay.dtype)
            v = torch.empty((lay.num_kv_heads, n, lay.dim_v), dtype=lay.dtype)
            slots = list(range(run.first_slot, run.first_slot + run.num_slots))
            tier.read_layer(layer, slots, k, v)
        k_parts.append(k[:, : run.num_tokens])
        v_parts.append(v[:, : run.num_tokens])
    assert expected_start == mgr.num_tokens(seq_id)
    if not k_parts:
        empty = torch.empty((lay.num_kv_heads, 0, lay.head_dim), dtype=lay.dtype)
        return empty, empty.clone()
    return torch.cat(k_parts, dim=1), torch.cat(v_parts, dim=1)


@dataclass
class SeqModel:
    """What each sequence should hold: per layer K and V [Hkv, n, D]."""

    layout: BlockLayout
    k: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    v: dict[int, list[torch.Tensor]] = field(default_factory=dict)

    def add(self, seq_id: int) -> None:
        lay = self.layout
        self.k[seq_id] = [
            torch.empty((lay.num_kv_heads, 0, lay.head_dim), dtype=lay.dtype)
            for _ in range(lay.num_layers)
        ]
        self.v[seq_id] = [t.clone() for t in self.k[seq_id]]

    def append(self, seq_ids: list[int], ks: list[torch.Tensor], vs: list[torch.Tensor]) -> None:
        for b, seq_id in enumerate(seq_ids):
            for layer in range(self.layout.num_layers):
                self.k[seq_id][layer] = torch.cat([self.k[seq_id][layer], ks[layer][b]], dim=1)
                self.v[seq_id][layer] = torch.cat([self.v[seq_id][layer], vs[layer][b]], dim=1)

    def free(self, seq_id: int) -> None:
        del self.k[seq_id], self.v[seq_id]

    def fork(self, src: int, dst: int) -> None:
        self.k[dst] = list(self.k[src])
        self.v[dst] = list(self.v[src])

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        self.k[seq_id] = [t[:, :num_tokens] for t in self.k[seq_id]]
        self.v[seq_id] = [t[:, :num_tokens] for t in self.v[seq_id]]

    def remap(self, sources: list[int]) -> None:
        k, v = self.k, self.v
        self.k = {i: list(k[s]) for i, s in enumerate(sources)}
        self.v = {i: list(v[s]) for i, s in enumerate(sources)}

    def num_tokens(self, seq_id: int) -> int:
        return self.k[seq_id][0].shape[1]


def snapshot(mgr: BlockManager) -> dict:
    """Everything a refused operation must leave as it was."""
    state = mgr.state
    return {
        "tables": {s: (list(t.block_ids), t.num_tokens) for s, t in state.tables.items()},
        "blocks": {
            i: (b.tier, b.slot, b.num_tokens, b.ref_count) for i, b in state.pool.blocks.items()
        },
        # Free-list order may change (an undone copy on write frees its slot and id).
        "num_free": {n: t.num_free for n, t in state.tiers.items()},
        "budgets": dict(state.budget_slots),
        "on_tier": {n: sorted(ids) for n, ids in state.on_tier.items()},
    }


def check_accounting(mgr: BlockManager) -> None:
    """Invariants (b) and (c): slots, ref counts and bytes agree everywhere."""
    state = mgr.state
    bs = state.layout.block_size
    refs: dict[int, int] = {}
    for table in state.tables.values():
        assert len(table.block_ids) == -(-table.num_tokens // bs)
        for block_id in table.block_ids:
            refs[block_id] = refs.get(block_id, 0) + 1
    # Every live block is referenced by exactly its ref count; no leaked blocks.
    assert refs == {i: b.ref_count for i, b in state.pool.blocks.items()}
    assert not set(state.pool.free_ids()) & set(state.pool.blocks)
    occ = mgr.occupancy()
    device = state.tier_order[0]
    for name in state.tier_order:
        tier: Tier = state.tiers[name]
        placed = [b for b in state.pool.blocks.values() if b.tier == name]
        slots = [b.slot for b in placed]
        assert len(set(slots)) == len(slots), f"{name}: a slot owned by two blocks"
        assert {b.block_id for b in placed} == state.on_tier[name]
        free = tier.allocator.free_slots()
        assert len(set(free)) == len(free)
        assert sorted(free + slots) == list(range(tier.num_slots)), f"{name}: slot leak"
        assert tier.num_used == len(placed)
        assert tier.used_bytes == len(placed) * tier.block_bytes
        assert occ[name]["used_blocks"] == len(placed)
        assert occ[name]["used_bytes"] == len(placed) * tier.block_bytes
        assert occ[name]["budget_blocks"] == state.budget_slots[name]
        if name != device:
            # A partially filled block lives on the device (lossy codecs see full blocks).
            for b in placed:
                assert b.num_tokens == bs, f"partial block {b.block_id} on {name}"


def check_step(mgr: BlockManager, seq_ids: list[int], writes: list[TokenWrites]) -> None:
    """After a step: open blocks are on the device, and lower tiers only receive whole
    blocks (lossy codecs only ever see full blocks)."""
    state = mgr.state
    bs = state.layout.block_size
    device = state.tier_order[0]
    for seq_id in seq_ids:
        if mgr.num_tokens(seq_id) % bs:
            last = mgr.blocks_of(seq_id)[-1]
            assert last.tier == device, f"seq {seq_id}: open block on {last.tier}"
    for tw in writes:
        assert len(tw.rows) == len(tw.src)
        if tw.tier != device:
            rows = tw.rows.tolist()
            assert len(rows) % bs == 0 and rows[::bs] == [r - r % bs for r in rows[::bs]]
            for i in range(0, len(rows), bs):
                assert rows[i : i + bs] == list(range(rows[i], rows[i] + bs))


def check_contents(mgr: BlockManager, model: SeqModel) -> None:
    """Invariant (a): every token of every live sequence reads back bit-exact."""
    state = mgr.state
    assert set(state.tables) == set(model.k)
    for seq_id in state.tables:
        assert mgr.num_tokens(seq_id) == model.num_tokens(seq_id)
        for layer in range(state.layout.num_layers):
            k, v = read_sequence(mgr, seq_id, layer)
            assert torch.equal(k, model.k[seq_id][layer]), f"seq {seq_id} layer {layer} K"
            assert torch.equal(v, model.v[seq_id][layer]), f"seq {seq_id} layer {layer} V"


def held_deleted_files(root: os.PathLike | str) -> list[str]:
    """Files under `root` this process still holds open or mapped after deletion."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(root)):
            held.append(target)
    with open("/proc/self/maps") as maps:
        held += [line.split()[-2] for line in maps if str(root) in line]
    return held
