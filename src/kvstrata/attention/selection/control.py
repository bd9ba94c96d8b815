"""The attention runtime's query-aware selection (a mixin of `AttentionRuntime`): the
selector and the prediction of its next step's staged units, set from a CacheConfig,
cut back with a table, settled before blocks move, and reported."""

from __future__ import annotations

from typing import Any

import torch

from kvstrata.attention.selection.prefetch import SelectionPrefetcher
from kvstrata.attention.selection.selector import KeySelector
from kvstrata.attention.selection.sharing import BlockHashes
from kvstrata.config import CacheConfig
from kvstrata.core.layout import BlockLayout


class SelectionControl:
    """`set_selection`, `selection_stats`, `settle` and the truncation hook of a runtime
    that has these attributes."""

    device: torch.device
    native: set[str]
    layout: BlockLayout
    layer_map: list[tuple[int, int]]
    device_name: str
    stager: Any
    _hashes: BlockHashes
    selector: KeySelector | None = None
    prefetch: SelectionPrefetcher | None = None

    def set_selection(self, cc: CacheConfig) -> None:
        """Query-aware key selection as `cc`'s attention_* fields give it (None: exact
        attention) from the next step on; between steps only (the benchmarks compare
        settings over one store's placement and cached prompt this way)."""
        half = self.device.type == "cpu" and bool(self.native)  # the native kernel's fp16
        self.selector = KeySelector.from_config(cc, self.device, half, self._hashes)
        if self.prefetch is not None:
            self.prefetch.close()
        self.prefetch = None
        if self.selector is not None and self.stager is not None:
            lay = self.layout
            unit = lay.num_kv_heads * lay.block_size * (lay.head_dim + lay.dim_v)
            engine = self.stager.engine  # its one worker: reads of a tier never overlap
            link = f"staged->{self.device_name}"
            self.prefetch = SelectionPrefetcher(
                cc.attention_prefetch,
                cc.attention_prefetch_budget,
                unit * lay.dtype.itemsize,
                max(1, len(self.layer_map) - cc.attention_dense_layers),
                lay.block_size,
                self.device,
                lambda fn, nbytes: engine.submit(fn, link=link, nbytes=nbytes),
                engine.wait,
            )

    def _truncate(self, key: Any, num_tokens: int) -> None:
        """A table cut back (a crop, an undone step): its summaries and held units past
        the cut go."""
        if self.selector is not None:
            self.selector.truncate(key, num_tokens)
        if self.prefetch is not None:
            self.prefetch.truncate(key, num_tokens)

    def selection_stats(self) -> dict[str, Any] | None:
        """What query-aware selection did (None without it), with its prediction's
        counters under "prefetch" (None when it read no staged tier)."""
        if self.selector is None:
            return None
        out = self.selector.stats.as_dict()
        out["prefetch"] = None
        if self.prefetch is not None and self.prefetch.stats.attentions:
            out["prefetch"] = {"policy": self.prefetch.policy, **self.prefetch.stats.as_dict()}
        return out

    def settle(self) -> None:
        """Finish selection's reads ahead (before the store moves any block: a read
        names a slot as it was when issued); free when none runs."""
        if self.prefetch is not None:
            self.prefetch.settle()
