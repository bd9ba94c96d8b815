"""Where a step's new K/V go: the write plan of one layer group (built once per step from
the block manager's token writes) and the per-layer write that follows it."""

from __future__ import annotations

from typing import Protocol

import torch

from kvstrata.blocks.runs import TokenWrites, token_writes
from kvstrata.tiers.base import Tier


class WriteTarget(Protocol):
    """What a write plan needs of the attention runtime: its tiers by name, the tiers
    whose raw arenas take token rows, and the device the step's K/V are on."""

    tiers: dict[str, Tier]
    arena_tiers: set[str]
    device: torch.device


def write_plan(target: WriteTarget, writes: list[TokenWrites], batch: int) -> list[tuple]:
    """Turn one group's token writes into what every layer of this step does, once
    per step: ("slice", tier, first, count) for a contiguous single-sequence write,
    ("rows", tier, rows, src) for scattered rows of an arena tier, ("blocks", tier,
    slots, src) for whole new blocks of an encoded tier."""
    plan: list[tuple] = []
    for tw in writes:
        tier = target.tiers[tw.tier]
        bs = tier.layout.block_size
        src = tw.src.to(target.device)
        if tw.tier not in target.arena_tiers:
            plan.append(("blocks", tier, (tw.rows[::bs] // bs).tolist(), src))
        elif tw.contiguous is not None and batch == 1:
            plan.append(("slice", tier, *tw.contiguous))
        else:
            plan.append(("rows", tier, tw.rows.to(tier.device), src))
    return plan


def write_layer(plan: list[tuple], local: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store one layer's new K/V ([B, Hkv, T, D]) as the step's write plan says."""
    batch, heads, num_new, _ = k.shape
    flat_k = flat_v = None
    for kind, tier, a, b in plan:
        if kind == "slice":
            tier.k_arena[local, :, a : a + b].copy_(k[0, :, :b])
            tier.v_arena[local, :, a : a + b].copy_(v[0, :, :b])
            continue
        if flat_k is None:
            flat_k = k.transpose(0, 1).reshape(heads, batch * num_new, -1)
            flat_v = v.transpose(0, 1).reshape(heads, batch * num_new, -1)
        new_k, new_v = flat_k.index_select(1, b), flat_v.index_select(1, b)
        if kind == "rows":
            tier.k_arena[local].index_copy_(1, a, new_k.to(tier.device))
            tier.v_arena[local].index_copy_(1, a, new_v.to(tier.device))
        else:
            tier.write_layer(local, a, new_k, new_v)


def split_by_group(
    writes: list[TokenWrites], num_groups: int, per_group: int
) -> list[list[TokenWrites]]:
    """Split one step's writes (tables ordered group-major) into per-group writes
    whose `src` indexes that group's [len(seq_ids) * num_new] tokens."""
    if num_groups == 1:
        return [writes]
    out: list[list[TokenWrites]] = [[] for _ in range(num_groups)]
    for tw in writes:
        group_of = tw.src // per_group
        for g in torch.unique(group_of).tolist():
            sel = group_of == g
            rows, src = tw.rows[sel].tolist(), (tw.src[sel] - g * per_group).tolist()
            out[g].append(token_writes(tw.tier, rows, src))
    return out
