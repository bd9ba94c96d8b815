"""What a block is, in shapes and bytes (the "spec"; see DESIGN.md decision 1-2).

A block is `block_size` consecutive tokens of one sequence across all layers, K and V.
Memory tiers keep, per kind (K or V) and codec field, one arena

    [num_layers, num_kv_heads, num_slots * rows_per_block, cols]

so slot `s` is rows `[s*rows, (s+1)*rows)` of every layer, and a run of consecutive
slots is a zero-copy view. For the `none` codec rows = block_size and cols = head_dim:

    layer l, K:  head 0 | slot0 tokens 0..bs-1 | slot1 tokens ... | ... |
                 head 1 | slot0 ...                                      |
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KINDS = ("k", "v")


@dataclass(frozen=True)
class FieldSpec:
    """One stored tensor of a codec's encoded block: `rows` rows of `cols` per block
    per (layer, kv head), in `dtype`."""

    rows: int
    cols: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes per block per (layer, kv head)."""
        return self.rows * self.cols * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class BlockLayout:
    """The shape of one block: geometry of the model's KV plus the block size."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype = torch.float32
    v_head_dim: int | None = None  # MLA-style models may differ; None = head_dim

    @property
    def dim_v(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def raw_block_bytes(self) -> int:
        """Bytes of one block in the model dtype (K + V, all layers)."""
        per_token = self.num_kv_heads * (self.head_dim + self.dim_v) * self.element_size
        return self.num_layers * self.block_size * per_token

    def raw_shape(self, kind: str, num_blocks: int) -> tuple[int, int, int, int]:
        """Shape of `num_blocks` blocks of K or V in the model dtype:
        [num_layers, num_kv_heads, num_blocks * block_size, dim]."""
        dim = self.head_dim if kind == "k" else self.dim_v
        return (self.num_layers, self.num_kv_heads, num_blocks * self.block_size, dim)
