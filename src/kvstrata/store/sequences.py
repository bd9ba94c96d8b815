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
