"""Predictive prefetch for query-aware selection over staged tiers (disk, remote, a
lossy host tier; on a GPU the host): the blocks the next decode step will read, held or
fetched ahead while this one computes (`CacheConfig.attention_prefetch`).

A selecting decode step attends, per layer and KV head, the pages it chose. Pages in a
tier that cannot be attended in place are read as whole (block, layer) units — the unit
the disk tier checksums, so a corrupt block is still detected, never served — each unit
once per step whatever number of its pages the heads chose, and one masked attention
runs over them. Without prediction (`"off"`) every step reads its units again.

Consecutive decode queries choose mostly the same pages (Quest, Tang et al. 2024;
InfiniGen, Lee et al., OSDI '24, builds on the same similarity across steps): on
smollm2 at 4k with a 1/8 budget, about 89 % of the units a step reads were read by the
step before. Two predictors of the next step's units, per sequence and layer:

- `"last"` (the simple rule): the units this step read are held for the next step;
  over the budget, those with the most chosen keys are kept.
- `"learned"`: an online score per unit — its recency and frequency, an exponential
  moving average of "this step read it" (decay `DECAY`) — updated from every step's true
  choice; the units scoring at least `THRESHOLD` are predicted, best first within the
  budget (a unit read in two of the last three steps stays held through a step that
  skips it). A predicted unit not held (dropped when the budget was split over more
  sequences) is fetched ahead on the transfer worker while the rest of the step
  computes; `settle` waits for such reads before the store may move a block.

Held units live on the compute device within `attention_prefetch_budget` bytes, split
evenly over the selecting layers and the sequences holding units. A step starts one
read per tier of the units it needs and does not hold (on the transfer worker), then
attends every unit in block order in one masked attention: the same sums in the same
order whatever was predicted, so tokens equal those without prediction bit for bit. A
held unit is a copy of a full block (a partial block's newest keys would change); a
table cut back or replaced drops its units. Reported (`stats()["selection"]
["prefetch"]`, `/metrics`): units needed, hits (held when asked), misses (read while the
step waited), units fetched ahead and the bytes of those dropped unused (wasted), bytes
read, stall seconds, bytes held, hit rate and precision (hits per unit predicted).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

DECAY = 0.75  # "learned": a unit's score keeps this share of itself per step
THRESHOLD = 0.2  # "learned": units scoring at least this are predicted
# (read once: 1 - DECAY = 0.25; read once two steps ago: 0.19, not predicted; read
# twice in the last three steps: >= 0.33, predicted)


@dataclass
class PrefetchStats:
    """What prediction did, summed over the selecting decode attentions that read
    staged units."""

    attentions: int = 0  # (sequence, layer) selecting attentions over staged units
    needed: int = 0  # (block, layer) units their chosen keys touched
    hits: int = 0  # of those, held (or fetched ahead) when the step asked
    misses: int = 0  # of those, read while the step waited
    predicted: int = 0  # units held or fetched ahead for a next step
    fetched_ahead: int = 0  # units read ahead of the step that asked (learned)
    wasted_units: int = 0  # units fetched ahead and dropped unused
    wasted_bytes: int = 0
    read_bytes: int = 0  # bytes read from tiers on this path (misses + ahead)
    stall_s: float = 0.0  # time steps waited for their reads
    held_bytes: int = 0  # bytes held now
    peak_held_bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["hit_rate"] = self.hits / self.needed if self.needed else None
        out["precision"] = self.hits / self.predicted if self.predicted else None
        return out


@dataclass
class _Unit:
    """One held (block, layer) unit: its keys and values [Hkv, bs, D] on the compute
    device, or a Future of them; `ahead` while it was fetched ahead and no step has
    used it yet (dropped so, its bytes were wasted)."""

    kv: tuple[torch.Tensor, torch.Tensor] | None
    future: Future | None = None
    ahead: bool = False


@dataclass
class _Layer:
    units: dict[int, _Unit] = field(default_factory=dict)  # block index -> unit
    scores: dict[int, float] = field(default_factory=dict)  # "learned"


# a staged unit: (block index, tier name, slot, tokens valid in it)
Need = tuple[int, str, int, int]


class SelectionPrefetcher:
    """The held units of every sequence and layer, and their predictor.

    Args:
        policy: "off", "last" or "learned" (the module docstring).
        budget: bytes of held units at most.
        unit_bytes: bytes of one held unit (K and V of a block in one layer).
        layers: layers that select (the budget is split over them).
        block_size: tokens per block.
        device: where held units live (the compute device).
        submit: runs a read on the transfer worker: (fn, nbytes) -> Future.
        wait: waits for such a Future.
    """

    def __init__(
        self,
        policy: str,
        budget: int,
        unit_bytes: int,
        layers: int,
        block_size: int,
        device: torch.device,
        submit: Callable[[Callable[[], Any], int], Future],
        wait: Callable[[Future], Any],
    ) -> None:
        self.policy = policy
        self.budget = budget
        self.unit_bytes = unit_bytes
        self.layers = max(layers, 1)
        self.block_size = block_size
        self.device = device
        self.submit = submit
        self.wait = wait
        self.stats = PrefetchStats()
        self._layers: dict[tuple[Hashable, int], _Layer] = {}
        self._tables: dict[Hashable, Any] = {}
        self._pending: list[tuple[_Layer, int, _Unit]] = []  # units being read ahead

    # -- lifecycle ------------------------------------------------------------------------
    def forget(self, live: Callable[[Hashable], Any]) -> None:
        """Drop the units of sequences whose table `live(key)` no longer returns (a
        finished sequence, a replaced table)."""
        gone = [k for k, t in self._tables.items() if live(k) is not t]
        for key in gone:
            del self._tables[key]
            for lk in [lk for lk in self._layers if lk[0] == key]:
                self._drop_layer(self._layers.pop(lk))

    def truncate(self, key: Hashable, num_tokens: int) -> None:
        """Table `key` keeps its first `num_tokens` tokens: units past them go."""
        bs = self.block_size
        for (k, _), layer in self._layers.items():
            if k == key:
                for b in [b for b in layer.units if (b + 1) * bs > num_tokens]:
                    self._drop(layer, b)
                layer.scores = {b: s for b, s in layer.scores.items() if (b + 1) * bs <= num_tokens}

    def settle(self) -> None:
        """Wait for the reads ahead still running: called before the store may move a
        block (a read names a slot as it was when issued). Free when none runs."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        t0 = time.perf_counter()
        waited = False
        for layer, b, unit in pending:
            if layer.units.get(b) is not unit or unit.future is None:
                continue
            waited = waited or not unit.future.done()
            try:
                unit.kv = self.wait(unit.future)
            except Exception:  # noqa: BLE001 - a failed read ahead is not held (a read
                self._drop(layer, b)  # when a step needs the unit reports the error)
            unit.future = None
        if waited:
            self.stats.stall_s += time.perf_counter() - t0

    def close(self) -> None:
        self.settle()
        for layer in self._layers.values():
            self._drop_layer(layer)
        self._layers.clear()
        self._tables.clear()

    # -- one step -------------------------------------------------------------------------
    def gather(
        self,
        key: Hashable,
        table: Any,
        local: int,
        needs: list[Need],
        weights: np.ndarray,
        read: Callable[[str, list[int]], tuple[torch.Tensor, torch.Tensor]],
        attend: Callable[[list[tuple[int, torch.Tensor, torch.Tensor]]], None],
        locate: Callable[[int], tuple[str, int] | None],
    ) -> None:
        """Attend the units `needs` (sorted by block) of one selecting decode step in
        local layer `local`: `attend(pieces)` gets (first token, k, v) pieces, every
        unit in block order; `read(tier, slots)` reads consecutive
        slots' layer as (k, v) [Hkv, n * bs, D] on the compute device. `weights[i]`:
        the chosen keys in needs[i] (the predictors rank by them); `locate(b)`: where
        full block b of the sequence is now, (tier, slot), if staged. Then the units
        the next step is predicted to need are kept, or fetched ahead."""
        if self._tables.get(key) is not table:
            self.forget(lambda k: None if k == key else self._tables[k])
            self._tables[key] = table
        layer = self._layers.setdefault((key, local), _Layer())
        st = self.stats
        st.attentions += 1
        st.needed += len(needs)
        held, missing = [], []
        for need in needs:
            unit = layer.units.get(need[0])
            (held if unit is not None else missing).append(need)
        reads = self._start_reads(missing, read)
        kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        t0 = time.perf_counter()
        for b, *_ in held:
            unit = layer.units[b]
            if unit.future is not None:
                unit.kv = self.wait(unit.future)
                unit.future = None
            unit.ahead = False  # a read ahead that paid
            kv[b] = unit.kv
        st.hits += len(held)
        st.misses += len(missing)
        fresh = {}
        bs = self.block_size
        for blocks, fut in reads:
            k, v = self.wait(fut)
            for i, b in enumerate(blocks):
                fresh[b] = (k[:, i * bs : (i + 1) * bs], v[:, i * bs : (i + 1) * bs])
        st.stall_s += time.perf_counter() - t0
        kv.update(fresh)
        # one attention over every unit in block order, held or not: the same sums in
        # the same order whatever was predicted (tokens equal to "off" bit for bit)
        attend([(b * bs, *kv[b]) for b, *_ in needs])
        self._predict(layer, needs, weights, fresh, read, locate)

    def _start_reads(
        self, missing: list[Need], read: Callable[[str, list[int]], Any]
    ) -> list[tuple[list[int], Future]]:
        """Reads of the missing units on the worker, one per tier (a tier reads a
        list of slots in one call): (block indices, Future of (k, v))."""
        groups: dict[str, tuple[list[int], list[int]]] = {}
        for b, tier, slot, _ in missing:
            blocks, slots = groups.setdefault(tier, ([], []))
            blocks.append(b)
            slots.append(slot)
        out = []
        for tier, (blocks, slots) in groups.items():
            nbytes = len(slots) * self.unit_bytes
            self.stats.read_bytes += nbytes
            out.append((blocks, self.submit(lambda t=tier, s=slots: read(t, s), nbytes)))
        return out

    def _predict(
        self,
        layer: _Layer,
        needs: list[Need],
        weights: np.ndarray,
        fresh: dict[int, tuple[torch.Tensor, torch.Tensor]],
        read: Callable[[str, list[int]], Any],
        locate: Callable[[int], tuple[str, int] | None],
    ) -> None:
        """Keep (or fetch ahead) the units predicted for the next step in this layer."""
        if self.policy == "off":
            for b in list(layer.units):
                self._drop(layer, b)
            return
        cap = self.budget // (self.unit_bytes * self.layers * max(1, len(self._tables)))
        full = {n[0]: n for n in needs if n[3] == self.block_size}  # only full blocks
        weight = {n[0]: float(w) for n, w in zip(needs, weights, strict=True)}
        if self.policy == "last":
            ranked = sorted(full, key=lambda b: -weight[b])
        else:
            decay, scores = DECAY, layer.scores
            for b in list(scores):
                scores[b] *= decay
                if scores[b] < 0.01:
                    del scores[b]
            for b in full:
                scores[b] = scores.get(b, 0.0) + (1 - decay)
            candidates = [b for b, s in scores.items() if s >= THRESHOLD]
            ranked = sorted(candidates, key=lambda b: (-scores[b], -weight.get(b, 0.0)))
        keep = set(ranked[:cap])
        self.stats.predicted += len(keep)
        for b in [b for b in layer.units if b not in keep]:
            self._drop(layer, b)
        for b in keep:
            if b in layer.units:
                continue
            if b in fresh:
                layer.units[b] = _Unit(fresh[b])
                self._held(+1)
            else:
                self._ahead(layer, b, read, locate)
        self.stats.peak_held_bytes = max(self.stats.peak_held_bytes, self.stats.held_bytes)

    def _ahead(
        self,
        layer: _Layer,
        b: int,
        read: Callable[[str, list[int]], Any],
        locate: Callable[[int], tuple[str, int] | None],
    ) -> None:
        """Fetch unit `b` ahead from where it is in this step (`settle` waits for the
        read before the store may move a block)."""
        where = locate(b)
        if where is None:
            return
        tier, slot = where
        self.stats.fetched_ahead += 1
        self.stats.read_bytes += self.unit_bytes
        unit = _Unit(None, self.submit(lambda: read(tier, [slot]), self.unit_bytes), True)
        layer.units[b] = unit
        self._pending.append((layer, b, unit))
        self._held(+1)

    def _drop(self, layer: _Layer, b: int) -> None:
        unit = layer.units.pop(b)
        if unit.ahead:
            self.stats.wasted_units += 1
            self.stats.wasted_bytes += self.unit_bytes
        if unit.future is not None:
            unit.future.cancel()
        self._held(-1)

    def _drop_layer(self, layer: _Layer) -> None:
        for b in list(layer.units):
            self._drop(layer, b)

    def _held(self, n: int) -> None:
        self.stats.held_bytes += n * self.unit_bytes
