"""Per-sequence block table: logical block i holds tokens [i*bs, (i+1)*bs).

A table of a sliding-window layer group drops the blocks its window no longer sees:
`block_ids[j]` is logical block `first_block + j`. During a step whose new tokens
reach past the window of all its history, the history blocks the step's queries
still read are held in `step_history` (logical index, block id) until the step ends;
full blocks of the step that the window will not see are stored only when free
slots allow, as future prefix-cache entries (`step_extra`).

    logical blocks:  0   1   2 | 3   4   5   6
                     dropped   | block_ids (first_block = 3)
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BlockTable:
    """The blocks of one sequence (in one layer group) in order, and its length."""

    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0
    first_block: int = 0
    window: int | None = None
    step_history: list[tuple[int, int]] = field(default_factory=list)
    # full blocks this step writes only as prefix-cache copies (outside the window at
    # its end): (logical index, block id), released (cached once hashed) at end_step
    step_extra: list[tuple[int, int]] = field(default_factory=list)
    step_first: int | None = None  # first_block before a step that skipped its window

    @property
    def num_blocks(self) -> int:
        """Logical blocks, dropped ones included (= ceil(num_tokens / bs))."""
        return self.first_block + len(self.block_ids)

    def held_ids(self) -> list[int]:
        """Every block id the table holds a reference to (live, then held for a step)."""
        return self.block_ids + [b for _, b in self.step_history + self.step_extra]

    def copy(self) -> BlockTable:
        return BlockTable(
            list(self.block_ids),
            self.num_tokens,
            self.first_block,
            self.window,
            list(self.step_history),
            list(self.step_extra),
            self.step_first,
        )
