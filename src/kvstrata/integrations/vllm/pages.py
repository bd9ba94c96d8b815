"""vLLM's KV pages read as kvstrata blocks, and written back.

vLLM hands the worker one byte tensor per layer, `[num_blocks, page_bytes]` (int8).
On its CPU backend a page is one vLLM block of one layer, `[Hkv, 2 * N * D]`: per head
the block's keys column-major (`[D, N]`: channel by channel, N tokens each), then its
values row-major (`[N, D]`) — vLLM-CPU's VEC attention, as its `reshape_and_cache`
writes them (checked against transformers' K and V of the same prompt). A kvstrata
block is `blocks_per_chunk` such blocks; kvstrata's tiers take K and V as
`[L, Hkv, n * block_tokens, D]`:

    page (block b, layer l)               kvstrata K of n blocks, layer l
    head h: [ K_b^T (D x N) | V_b (N x D) ]  head h: [ K_b0 | K_b1 | ... ]  (N rows each)

One gather (index_select) and one permuted copy per layer and kind; no loop per block.
Under vLLM's hybrid allocator each KV cache group has its own Pages (its layers, in
the group's order); a group with fewer layers than the plan's block (vLLM pads the
last group of a kind) leaves the block's last layers zero.
"""

from __future__ import annotations

import torch

from kvstrata.codecs.fp8_input import FP8_DTYPES
from kvstrata.core.errors import UnsupportedModelError
from kvstrata.integrations.vllm.backend_plan import BackendPlan


class Pages:
    """Typed views of the page tensors of one KV cache group.

    Args:
        page_tensors: per layer, in the group's layer order, `[num_blocks, >= page
            bytes]` int8 with unit stride along the page; at most the plan's layers.
        plan: gives the page shape `(Hkv, 2, N, D)` and the dtype (fp8 for an fp8
            KV cache: its bytes are moved as they are).
    """

    def __init__(self, page_tensors: list[torch.Tensor], plan: BackendPlan) -> None:
        heads, two, tokens, dim = plan.page_shape
        # gathers and scatters move values as they are: fp8 pages (an fp8 KV cache)
        # as bytes, which every torch indexing kernel takes
        dtype = torch.uint8 if plan.layout.dtype in FP8_DTYPES else plan.layout.dtype
        self.dtype = dtype
        elem = torch.empty((), dtype=dtype).element_size()
        page_bytes = heads * two * tokens * dim * elem
        if not 0 < len(page_tensors) <= plan.layout.num_layers:
            raise UnsupportedModelError(
                f"vLLM registered {len(page_tensors)} KV tensors for "
                f"{plan.layout.num_layers} layers"
            )
        self.plan = plan
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        for t in page_tensors:
            if t.dtype != torch.int8 or t.ndim != 2 or t.shape[1] < page_bytes or t.stride(1) != 1:
                raise UnsupportedModelError(
                    f"a vLLM KV tensor of shape {tuple(t.shape)}, strides {t.stride()} "
                    f"({t.dtype}) cannot hold pages of {page_bytes} bytes"
                )
            pages = t[:, :page_bytes].view(dtype).unflatten(1, (heads, two, tokens, dim))
            k = pages[:, :, 0]
            if plan.page_layout == "cpu-hnd":  # K is column-major: [D, N] per head
                k = k.flatten(2).unflatten(2, (dim, tokens)).transpose(2, 3)
            self.k.append(k)  # [num_blocks, Hkv, N, D] views
            self.v.append(pages[:, :, 1])
        self.heads, self.tokens, self.dim = heads, tokens, dim

    def gather(self, block_ids: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        """Copy vLLM blocks `block_ids` (in order) into k_out, v_out
        `[L, Hkv, len(block_ids) * N, D]` (layers this group lacks: zeros)."""
        n = len(block_ids)
        for out in (k_out, v_out):
            out[len(self.k) :].zero_()
        for layer, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
            for pages, out in ((k, k_out), (v, v_out)):
                blocks = pages.index_select(0, block_ids)  # [n, Hkv, N, D]
                dest = out[layer].view(self.dtype).view(self.heads, n, self.tokens, self.dim)
                dest.copy_(blocks.transpose(0, 1))

    def scatter(
        self, block_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor, skip: int = 0
    ) -> None:
        """Write k, v `[L, Hkv, m * N, D]` into vLLM blocks `block_ids`, leaving out
        the first `skip` vLLM blocks of k, v (a load that starts inside a chunk); the
        layers this group lacks are not read."""
        n = len(block_ids)
        for layer, (k_pages, v_pages) in enumerate(zip(self.k, self.v, strict=True)):
            for pages, src in ((k_pages, k), (v_pages, v)):
                blocks = src[layer].view(self.dtype).view(self.heads, -1, self.tokens, self.dim)
                pages.index_copy_(0, block_ids, blocks[:, skip : skip + n].transpose(0, 1))
