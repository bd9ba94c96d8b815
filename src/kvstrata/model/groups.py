"""Layer groups: layers with the same attention span share one block table.

A model whose layers attend different spans (full attention, a sliding window W)
keeps one block table per *group* of layers (vLLM v1's hybrid allocator; DESIGN.md
decision 1). A block is `block_size` tokens of one sequence across the layers *of
its group*, K and V: one id, one placement. A sliding group drops the blocks its
window can no longer see, so its memory is bounded by the window, not the context.

Every group has the same number of layers, so a block of any group has the same
size and all groups share one arena per tier (one budget, one slot allocator):

    Gemma-3 style, 18 layers, layers 5, 11, 17 full, the rest window 512:
    group size = gcd(15, 3) = 3
      group 0  full        layers (5, 11, 17)
      group 1  window 512  layers (0, 1, 2)
      group 2  window 512  layers (3, 4, 6)
      ...      (5 sliding groups)

    arena of a tier, per local layer 0..2:  | slot 0 | slot 1 | ... |
    slot s holds block b of whichever group owns b.

Tokens a group keeps for a `context`-token sequence (what the planner counts and what
the store holds, to the block):

    full:        every block                          ceil(context / bs) blocks
    window W:    blocks that end after context - (W-1) - slack,
                 slack = one block (a crop of up to one block stays exact)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvstrata.core.errors import ConfigError


@dataclass(frozen=True)
class LayerGroup:
    """Layers that share a block table.

    Fields:
        index: group id (0 .. num_groups-1), part of every block hash of the group.
        layers: model layer indices, in order; layer `layers[j]` is arena layer j.
        window: sliding window in tokens (a key k is seen by query q when
            q - k < window), or None for full attention.
    """

    index: int
    layers: tuple[int, ...]
    window: int | None = None

    @property
    def is_sliding(self) -> bool:
        return self.window is not None

    def first_live_token(self, num_tokens: int, block_size: int) -> int:
        """First token a sliding group must still hold after `num_tokens` tokens
        (0 for full attention): the next query, at position num_tokens, sees keys
        from num_tokens - (window - 1); one block of slack is kept below that."""
        if self.window is None:
            return 0
        return max(0, num_tokens - (self.window - 1) - block_size)

    def first_live_block(self, num_tokens: int, block_size: int) -> int:
        """Index of the first block the group keeps after `num_tokens` tokens."""
        return self.first_live_token(num_tokens, block_size) // block_size

    def blocks_held(self, num_tokens: int, block_size: int) -> int:
        """Blocks one sequence of `num_tokens` tokens holds in this group."""
        total = -(-num_tokens // block_size)
        return total - self.first_live_block(num_tokens, block_size)

    def max_blocks_held(self, num_tokens: int, block_size: int) -> int:
        """The most blocks the group holds at any length up to `num_tokens`, counting
        the new block a step opens before the oldest one is dropped."""
        if self.window is None:
            return -(-num_tokens // block_size)
        span = self.window - 1 + block_size  # live tokens at most, before alignment
        return min(-(-num_tokens // block_size), span // block_size + 2)


def layer_groups(
    num_layers: int, sliding_layers: tuple[int, ...] | list[int], window: int | None
) -> list[LayerGroup]:
    """Split a model's layers into groups of equal size by attention span.

    Args:
        num_layers: layers of the model.
        sliding_layers: indices of the layers that use `window`.
        window: the sliding window (None: every layer attends fully).

    Returns:
        Groups with full-attention groups first; one group of every layer when no
        layer slides (the layout of a model without sliding layers is unchanged).
    """
    sliding = sorted(set(sliding_layers)) if window else []
    if any(not 0 <= i < num_layers for i in sliding):
        raise ConfigError.field("sliding_layers", sliding, f"layer indices in [0, {num_layers})")
    full = [i for i in range(num_layers) if i not in set(sliding)]
    size = math.gcd(len(full), len(sliding)) or num_layers
    groups: list[LayerGroup] = []
    for layers, span in ((full, None), (sliding, window)):
        for start in range(0, len(layers), size):
            groups.append(LayerGroup(len(groups), tuple(layers[start : start + size]), span))
    return groups
