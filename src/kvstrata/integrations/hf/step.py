"""One engine step as a transformers forward: a ragged batch packed into one row.

Every running sequence contributes its new tokens (one for a decode, a chunk for a
prefill) to a single row of `sum(counts)` tokens; `position_ids` give each token its
position in its own sequence, so RoPE and the model's layers need no padding. The
"kvstrata" attention sees a `PackedKV` handle and attends each sequence's slice of
the queries over that sequence's blocks only (per-sequence lengths and block
tables; the store's read plans are built once per step and reused by every layer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache

from kvstrata.attention.writes import write_layer, write_plan
from kvstrata.core.errors import UnsupportedModelError
from kvstrata.integrations.hf.layers import _TieredLayer
from kvstrata.store.kvstore import KVStore


@dataclass
class PackedKV:
    """What `StepCache.update()` returns for one layer: this step's new K/V of every
    sequence, packed ([1, Hkv, T, D]); the history stays in the store's tiers."""

    step: StepCache
    layer_idx: int
    new_k: torch.Tensor
    new_v: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.new_k.shape

    def kvstrata_attend(
        self,
        layer_idx: int,
        query: torch.Tensor,
        scaling: float | None,
        sliding_window: int | None,
        softcap: float | None,
        sinks: torch.Tensor | None,
    ) -> tuple[torch.Tensor, None]:
        return self.step.attend(self, layer_idx, query, scaling, sliding_window, softcap, sinks)


def _check_kv_shape(store: KVStore, k: torch.Tensor, v: torch.Tensor) -> None:
    """The model's K/V have the shape the store was built with from its config."""
    layout = store.layout
    want = (layout.num_kv_heads, layout.head_dim, layout.num_kv_heads, layout.dim_v)
    got = (k.shape[1], k.shape[-1], v.shape[1], v.shape[-1])
    if got != want:
        raise UnsupportedModelError(
            f"model_type={store.geometry.model_type!r}: the model's K/V have (kv heads, "
            f"k dim, v heads, v dim) = {got} but its config describes {want}: the engine "
            "sizes its store from the config (TieredCache, which reads the K/V, can serve it)"
        )


class StepCache(Cache):
    """A transformers `Cache` for the engine's packed steps over a shared `KVStore`.

    `begin(seq_ids, counts, token_ids)` before each forward names the sequences of
    the row and how many tokens each brings; `update()` stores the layer's new K/V
    where the store placed them; the attention runs per sequence. A failed forward
    is undone by the engine (`KVStore.abort_step`)."""

    is_compileable = False

    def __init__(self, store: KVStore) -> None:
        self.store = store
        self.num_layers = store.geometry.num_layers  # layers that cache K/V
        # the step ends after this layer's attention (later layers may reuse K/V)
        self.last_attention_layer = store.geometry.attention_layers - 1
        sliding = [store.groups[g].is_sliding for g, _ in store.layer_map]
        super().__init__(layers=[_TieredLayer(self, i, s) for i, s in enumerate(sliding)])
        self.seq_ids: list[int] = []
        self.counts: list[int] = []
        self.token_ids: list[list[int]] = []
        self.bounds: list[tuple[int, int]] = []
        self.decodes: list[int] = []
        self.decode_rows: torch.Tensor | slice = slice(0, 0)
        self._writes: list[list[tuple]] = []

    def begin(self, seq_ids: list[int], counts: list[int], token_ids: list[list[int]]) -> None:
        self.seq_ids, self.counts, self.token_ids = seq_ids, counts, token_ids
        ends = [0]
        for n in counts:
            ends.append(ends[-1] + n)
        self.bounds = list(zip(ends[:-1], ends[1:], strict=True))
        # sequences bringing one token (decodes): attended together where possible
        self.decodes = [i for i, n in enumerate(counts) if n == 1]
        rows = [ends[i] for i in self.decodes]
        # the rows of the decodes: a slice when they are consecutive (decodes come first)
        self.decode_rows: torch.Tensor | slice = (
            slice(rows[0], rows[-1] + 1)
            if rows and rows[-1] - rows[0] == len(rows) - 1
            else torch.tensor(rows, dtype=torch.long)
        )

    # -- transformers Cache API --------------------------------------------------------------
    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[PackedKV, PackedKV]:
        store = self.store
        if key_states.shape[0] != 1 or key_states.shape[2] != self.bounds[-1][1]:
            raise RuntimeError(
                f"StepCache: a step of {self.bounds[-1][1]} packed tokens got K/V of shape "
                f"{tuple(key_states.shape)}"
            )
        if layer_idx == 0:
            _check_kv_shape(store, key_states, value_states)
            writes = store.extend(self.seq_ids, self.counts, self.token_ids)
            self._writes = [write_plan(store.runtime, w, 1) for w in writes]
        group, local = store.layer_map[layer_idx]
        write_layer(self._writes[group], local, key_states, value_states)
        handle = PackedKV(self, layer_idx, key_states, value_states)
        return handle, handle

    def attend(
        self,
        kv: PackedKV,
        calling_layer: int,
        query: torch.Tensor,
        scaling: float | None,
        sliding_window: int | None,
        softcap: float | None,
        sinks: torch.Tensor | None,
    ) -> tuple[torch.Tensor, None]:
        """Each sequence's queries over its own blocks; [1, T, Hq, Dv] like every
        transformers attention function returns. `calling_layer` is the layer whose
        attention this is: `kv`'s own, or a later one that reuses its K/V."""
        runtime = self.store.runtime
        _, hq, total, dim = query.shape
        scale = scaling if scaling is not None else 1.0 / math.sqrt(dim)
        out = query.new_empty((1, total, hq, kv.new_v.shape[-1]))
        layer = kv.layer_idx
        batched: set[int] = set()
        if len(self.decodes) > 1:  # the decodes that the native kernel reads in place
            done, o = runtime.decode_batch(
                layer,
                [self.seq_ids[i] for i in self.decodes],
                query[0, :, self.decode_rows].transpose(0, 1),
                scale,
                sliding_window,
                softcap,
                sinks,
            )
            if done:
                rows = self.decode_rows
                if len(done) < len(self.decodes):
                    rows = torch.tensor([self.bounds[self.decodes[i]][0] for i in done])
                out[0, rows] = o.to(out.dtype)
                batched = {self.decodes[i] for i in done}
        for i, (seq_id, (s, e)) in enumerate(zip(self.seq_ids, self.bounds, strict=True)):
            if i in batched:
                continue
            o = runtime.attend(
                layer,
                seq_id,
                query[0, :, s:e],
                kv.new_k[0, :, s:e],
                kv.new_v[0, :, s:e],
                scale,
                None,
                sliding_window,
                softcap,
                sinks,
            )
            out[0, s:e].copy_(o.transpose(0, 1))
        runtime.prefetch_next_layer(layer, self.seq_ids)
        if calling_layer == self.last_attention_layer:
            self.store.step_done(self.seq_ids)
        return out, None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions come with position_ids; the mask is built by the attention

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def is_initialized(self) -> bool:  # type: ignore[override]
        return True
