"""What a store knows of one sequence beyond its block tables, and the table keys.

A sequence has one block table per layer group, keyed `(seq_id, group index)` in the
block manager; `SequenceState` holds the rest: its tenant salt, the token ids seen so
far (for hashing its full blocks), how far its hash chain got, and the state of the
step in progress.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstrata.model.groups import LayerGroup


@dataclass
class SequenceState:
    """One sequence of a store (see the module docstring)."""

    salt: str = ""
    token_ids: list[int] | None = field(default_factory=list)  # None: unknown, no hashing
    num_hashed: int = 0  # leading full blocks hashed
    in_step: bool = False  # extended, step_done not yet called
    step_start: int = 0  # tokens before the step in progress
    failed: str | None = None  # why the sequence is unusable (a step that could not be undone)
    parents: list[bytes | None] = field(default_factory=list)  # last hash per group


def table_keys(seq_id: int, groups: list[LayerGroup]) -> list[tuple[int, int]]:
    """The block-table keys of a sequence, one per layer group."""
    return [(seq_id, g.index) for g in groups]


def longest_match(groups: list[LayerGroup], block_size: int, found: list[list]) -> int:
    """The most full blocks k such that every group holds the blocks it needs after k
    blocks (all of them for full attention, its window for sliding): `found[g][i]` is
    None where group g lacks block i."""
    bs = block_size
    k = len(found[0]) if found else 0
    for group, ids in zip(groups, found, strict=True):
        if group.window is None:
            k = min(k, next((i for i, b in enumerate(ids) if b is None), len(ids)))
    while k > 0:
        if all(
            all(b is not None for b in ids[group.first_live_block(k * bs, bs) : k])
            for group, ids in zip(groups, found, strict=True)
        ):
            return k
        k -= 1
    return 0
