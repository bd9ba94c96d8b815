"""Query-aware selection of the keys a decode step attends (Quest: Tang et al., "Quest:
Query-Aware Sparsity for Efficient Long-Context LLM Inference", ICML 2024) — lossy,
opt-in (`CacheConfig.attention_budget`).

Keys are summarised per page of `page` tokens (`CacheConfig.attention_page`), per layer
and KV head: the per-channel min and max (Quest's), or the mean. A decode step scores
each page of a sequence from the query — with min/max sum_d max(q_d min_d, q_d max_d),
an upper bound of any of the page's logits; with the mean q . mean, an estimate of their
average — a KV head taking its query heads' best score for a page, or their sum
(`attention_score`), and each KV head attends its own best pages within the budget,
plus the sink pages and the newest keys, which every head always attends. Only the
chosen pages are read, from whichever tier holds them. A query row may score over its
`channels` largest-|q| channels only (SparQ: Ribar et al., "SparQ Attention:
Bandwidth-Efficient LLM Inference", 2023), and pages may be scored in two levels
(`coarse`: a summary per group of pages first). Smaller pages and the best head's
score lose less perplexity than larger pages or summing, and scoring over 16 channels
lost no more than over every channel (`scripts/selection_sim.py` compares them; the
figures: docs/MEASUREMENTS.md).

Summaries live on the compute device in fp32 (fp16 on a CPU whose native kernel scores
them), channel-major — a row over the pages per channel's max, min or mean — so a
query row reads only its channels' rows: 2 x D values per page, layer and KV head with
min/max (1/page of the K and V bytes of fp32 pages), D with the mean (bf16 summaries
were measured slower to score on a CPU without bf16 arithmetic). They are computed from
a prefill chunk's new keys as it is attended, or, for keys that did not pass through
one (a prefix hit, decode steps, a chunk that starts inside a page), read from the tier
holding them: every whole page stored at once, so the next such read comes when the
newest keys have moved on by the budget's newest share.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvstrata.attention.selection.scores import _choose, _scoring
from kvstrata.attention.selection.sharing import (
    RETAINED,
    BlockHashes,
    best_donor,
    copy_prefix,
    table_hashes,
)
from kvstrata.config import CacheConfig
from kvstrata.platform.host_memory import cpu_empty

# keys per summary by default (CacheConfig.attention_page): Quest's pages are 16; smaller
# pages lose less perplexity (module docstring; docs/MEASUREMENTS.md for 4 against 8)
PAGE_TOKENS = CacheConfig.attention_page
RECENT_SHARE = 0.25  # the newest keys always attended: this share of the budget


@dataclass
class _Summaries:
    """Key summaries of one sequence's pages in one layer group."""

    table: Any  # the block table described; a new table (a new sequence) starts over
    # [layers, Hkv, W, capacity], channel-major: per-channel max then min (W = 2D), or
    # mean (W = D), each a row over the pages
    data: torch.Tensor | None  # (None only while _start makes it)
    filled: list[int]  # per local layer: pages 0 .. filled - 1 are summarised
    # [layers, Hkv, W, capacity // group]: each group of `group` pages' summary (two
    # levels), or None
    groups: torch.Tensor | None = None
    hashes: list[bytes] = field(default_factory=list)  # the table's first blocks' (shared)


@dataclass
class Choice:
    """One selecting decode attention's inputs: the layer's summaries [Hkv, W,
    capacity] (channel-major), the pages c0 .. c1 - 1 it chooses `choose` of, the sinks
    [start, sink_end) and the newest keys [recent_start, total)."""

    summaries: torch.Tensor
    c0: int
    c1: int
    choose: int
    start: int
    sink_end: int
    recent_start: int
    total: int
    groups: torch.Tensor | None = None  # the layer's group summaries (two levels)
    refine: int = 0  # groups each head refines (two levels)


@dataclass
class SelectionStats:
    """What selection did, summed over the decode attentions it served."""

    layers: int = 0  # (sequence, layer) decode attentions that selected
    keys_attended: int = 0  # (key, KV head) pairs they attended
    keys_in_context: int = 0  # (key, KV head) pairs full attention would have attended
    pages_summarised_from_tiers: int = 0  # (page, layer) summaries read from a tier
    pages_shared: int = 0  # (page, layer) summaries copied from a common prefix's
    summary_bytes: int = 0  # bytes of summary values read (pages scored x terms)

    def as_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        ctx = self.keys_in_context
        out["attended_share"] = self.keys_attended / ctx if ctx else None
        return out


def _ranges(
    pages: np.ndarray,
    c0: int,
    start: int,
    sink_end: int,
    recent_start: int,
    total: int,
    page: int = PAGE_TOKENS,
) -> np.ndarray:
    """Every head's key ranges as rows (head, lo, hi), grouped by head, each head's
    sorted and disjoint with touching ones merged: the sinks [start, sink_end), its
    chosen pages of `page` keys (`pages[h]`, sorted, relative to page c0), the newest
    keys."""
    heads, n = pages.shape
    lo = np.empty((heads, n + 2), dtype=np.int64)
    hi = np.empty_like(lo)
    lo[:, 0], hi[:, 0], lo[:, -1], hi[:, -1] = start, sink_end, recent_start, total
    lo[:, 1:-1] = (c0 + pages) * page
    hi[:, 1:-1] = lo[:, 1:-1] + page
    first = np.ones(lo.shape, dtype=bool)
    first[:, 1:] = lo[:, 1:] != hi[:, :-1]
    last = np.ones(lo.shape, dtype=bool)
    last[:, :-1] = first[:, 1:]
    head = np.broadcast_to(np.arange(heads)[:, None], lo.shape)
    return np.stack([head[first], lo[first], hi[last]], axis=1)


def union(chosen: np.ndarray) -> list[tuple[int, int]]:
    """The key ranges any head attends (rows (head, lo, hi)), sorted and merged."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(map(tuple, chosen[:, 1:].tolist())):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(hi, out[-1][1]))
        else:
            out.append((lo, hi))
    return out


@dataclass
class KeySelector:
    """Chooses, per decode step, sequence, layer and KV head, the keys to attend.

    Args:
        budget: keys attended per head and step: a count, or a fraction (< 1) of the
            sequence's context.
        summary: "minmax" or "mean".
        page: keys per summary.
        score: a page's score for a KV head: its query heads' best ("max") or sum.
        sink_tokens: first keys always attended (rounded up to whole pages).
        device: where summaries are kept and scored.
        dense_layers: the first model layers, which attend every key (the runtime
            does not select in them).
        half: keep summaries in fp16 (half the bytes each step scores; the native CPU
            kernel's path, which converts them with F16C). A max or min rounded to
            fp16 moves a page's bound by at most 1 part in 2048.
        coarse: pages per group summary (two levels: a head scores the groups, then
            only the pages of its best); 0 for one level.
        channels: each query row is scored over its this many largest-|q| channels
            only (SparQ's approximation), reading only those channels' summary rows;
            0 for every channel.
        refine: with two levels, the groups each head refines per page it chooses
            (at least a whole group's worth: ceil(refine * choose / coarse)).
    """

    budget: int | float
    summary: str
    sink_tokens: int
    device: torch.device
    dense_layers: int = 0
    half: bool = False
    page: int = PAGE_TOKENS
    score: str = "max"
    coarse: int = 0
    refine: float = 2.0
    channels: int = 0
    stats: SelectionStats = field(default_factory=SelectionStats)
    blocks: BlockHashes | None = None  # tables' block hashes: summaries of shared prefixes
    _seqs: dict[Hashable, _Summaries] = field(default_factory=dict)
    _retired: list[tuple[Hashable, _Summaries]] = field(default_factory=list)
    _last_bounds: tuple = (None, None)  # ((start, total), bounds): every layer asks the same

    @classmethod
    def from_config(
        cls, cc: CacheConfig, device: torch.device, half: bool, blocks: BlockHashes | None = None
    ) -> KeySelector | None:
        """The selector of `cc`'s attention_* fields (sharing the summaries of common
        prefixes when it can read `blocks`' hashes); None without a budget."""
        if cc.attention_budget is None:
            return None
        return cls(
            cc.attention_budget,
            cc.attention_summary,
            cc.sink_tokens,
            device,
            cc.attention_dense_layers,
            half=half,
            page=cc.attention_page,
            score=cc.attention_score,
            coarse=cc.attention_coarse,
            refine=cc.attention_refine,
            channels=cc.attention_channels,
            blocks=blocks,
        )

    def bounds(self, start: int, total: int) -> tuple[int, int, int] | None:
        """(sink_end, recent_start, pages to choose) when a decode over keys [start,
        total) selects; None when the budget covers them all (exact attention)."""
        asked, known = self._last_bounds
        if asked == (start, total):
            return known
        known = self._bounds(start, total)
        self._last_bounds = ((start, total), known)
        return known

    def _bounds(self, start: int, total: int) -> tuple[int, int, int] | None:
        page, context = self.page, total - start
        budget = self.budget if isinstance(self.budget, int) else int(self.budget * context)
        if budget >= context:
            return None
        recent_start = max(start, (total - max(page, int(budget * RECENT_SHARE))) // page * page)
        sink_end = min(recent_start, -(-(start + max(self.sink_tokens, 1)) // page) * page)
        choose = max(0, budget - (sink_end - start) - (total - recent_start)) // page
        if choose >= (recent_start - sink_end) // page:
            return None
        return sink_end, recent_start, choose

    def forget(self, live: Callable[[Hashable], Any]) -> None:
        """Drop the summaries of sequences whose table `live(key)` no longer returns (the
        RETAINED last of them wait for a prefix hit); note the live ones' new block
        hashes (once a step: select_shared)."""
        kept = {}
        for k, s in self._seqs.items():
            if live(k) is s.table:
                kept[k] = s
                if self.blocks is not None:
                    s.hashes = table_hashes(s.table, self.blocks.hash_of, s.hashes)
            elif s.hashes:
                self._retired = [*self._retired, (k, s)][-RETAINED:]
        self._seqs = kept

    def truncate(self, key: Hashable, num_tokens: int) -> None:
        """Table `key` keeps its first `num_tokens` tokens: pages past them are
        summarised again from the keys stored there next (groups too: `_put` redoes
        the group a first page falls in)."""
        entry = self._seqs.get(key)
        if entry is not None:
            entry.filled = [min(f, num_tokens // self.page) for f in entry.filled]
            if self.blocks is not None:  # blocks past the cut are written again
                entry.hashes = entry.hashes[: num_tokens // self.blocks.block_size]

    def _entry(self, key: Hashable, table: Any, layers: int, heads: int, dim: int, pages: int):
        entry = self._seqs.get(key)
        if entry is None or entry.table is not table:  # a new sequence
            entry = self._seqs[key] = self._start(key, table, layers, heads, dim, pages)
        elif entry.data.shape[3] < pages:
            self._grow(entry, layers, heads, dim, pages)
        return entry

    def _start(
        self, key: Hashable, table: Any, layers: int, heads: int, dim: int, pages: int
    ) -> _Summaries:
        """A new sequence's summaries, with room for `pages` pages, starting from those
        of the longest prefix of blocks it shares with another sequence of its group
        (select_shared): a finished one's taken over whole, a live one's copied."""
        entry = _Summaries(table, None, [0] * layers)
        donor, n = None, 0
        if self.blocks is not None:
            entry.hashes = table_hashes(table, self.blocks.hash_of, [])
            donor, n = best_donor(key, entry.hashes, [*self._seqs.items(), *self._retired])
        if donor is not None and donor.data.shape[:3] != (layers, heads, self._width(dim)):
            donor = None
        shared = n * self.blocks.block_size // self.page if donor is not None else 0
        finished = [i for i, (_, s) in enumerate(self._retired) if s is donor]
        if finished:  # no one else writes them: taken over, no copy
            del self._retired[finished[0]]
            entry.data, entry.groups = donor.data, donor.groups
            entry.filled = [min(f, shared) for f in donor.filled]
            self.stats.pages_shared += sum(entry.filled)
        if entry.data is None or entry.data.shape[3] < pages:
            self._grow(entry, layers, heads, dim, pages)
        if donor is not None and not finished:
            self.stats.pages_shared += copy_prefix(entry, donor, shared, self.coarse)
        return entry

    def _grow(self, entry: _Summaries, layers: int, heads: int, dim: int, pages: int) -> None:
        """Room for `pages` pages in `entry`, its summaries kept."""
        old = entry.data.shape[3] if entry.data is not None else 0
        # headroom past a prefill's pages: growing copies every summary, a stall of one
        # decode step at long contexts that the next few pages would pay
        cap = max(pages + pages // 4, 256, 2 * old)
        width = self._width(dim)
        dtype = torch.float16 if self.half else torch.float32
        data = cpu_empty((layers, heads, width, cap), dtype, self.device)
        groups = None
        if self.coarse:
            groups = cpu_empty((layers, heads, width, cap // self.coarse), dtype, self.device)
        if old:
            data[..., :old] = entry.data
            if groups is not None:
                groups[..., : entry.groups.shape[3]] = entry.groups
        entry.data, entry.groups = data, groups

    def _width(self, dim: int) -> int:
        """Summary values per page and KV head."""
        return 2 * dim if self.summary == "minmax" else dim

    def refined(self, choose: int) -> int:
        """Groups each head refines when it chooses `choose` pages (two levels)."""
        return max(math.ceil(self.refine * choose / self.coarse), 1)

    def _put(self, entry: _Summaries, local: int, first: int, keys: torch.Tensor) -> None:
        """Summarise whole pages first, first + 1, ... from keys [Hkv, n * page, D]."""
        heads, n, dim = keys.shape
        pages = keys.reshape(heads, n // self.page, self.page, dim).float()
        if self.half:  # beyond fp16's range: its largest finite value, not inf
            pages = pages.clamp(-65504.0, 65504.0)
        end = first + pages.shape[1]
        rows = entry.data[local].transpose(1, 2)  # [Hkv, capacity, W] view
        if self.summary == "minmax":
            rows[:, first:end, :dim] = pages.amax(dim=2).to(self.device)
            rows[:, first:end, dim:] = pages.amin(dim=2).to(self.device)
        else:
            rows[:, first:end] = pages.mean(dim=2).to(self.device)
        entry.filled[local] = end
        group = self.coarse
        if group and end // group > first // group:  # the groups these pages complete
            ga, gb = first // group, end // group
            fine = rows[:, ga * group : gb * group].float()
            fine = fine.reshape(heads, gb - ga, group, fine.shape[-1])
            out = entry.groups[local].transpose(1, 2)[:, ga:gb]
            if self.summary == "minmax":  # the bound of every page's bound
                out[..., :dim] = fine[..., :dim].amax(dim=2)
                out[..., dim:] = fine[..., dim:].amin(dim=2)
            else:
                out[:] = fine.mean(dim=2)

    def observe(
        self, key: Hashable, table: Any, layers: int, local: int, new_k: torch.Tensor, past: int
    ) -> None:
        """A prefill chunk's new keys new_k [Hkv, Q, D] at positions [past, past + Q):
        summarise the whole pages they complete when every earlier page is done."""
        page = self.page
        heads, num, dim = new_k.shape
        end = (past + num) // page
        entry = self._entry(key, table, layers, heads, dim, end)
        first = entry.filled[local]
        if first * page >= past and end > first:
            self._put(entry, local, first, new_k[:, first * page - past : end * page - past])

    def prepare(
        self,
        key: Hashable,
        table: Any,
        layers: int,
        local: int,
        qp: torch.Tensor,
        start: int,
        total: int,
        read_keys: Callable[[int, int], torch.Tensor],
    ) -> Choice | None:
        """What the decode of packed queries qp [Hkv, R, D] over keys [start, total)
        chooses from, with every page's summary in place; None when the budget covers
        every key (exact attention). `read_keys(lo, hi)` returns stored keys
        [Hkv, hi - lo, D] of pages that have no summary yet."""
        bounds = self.bounds(start, total)
        if bounds is None:
            return None
        sink_end, recent_start, choose = bounds
        page = self.page
        c0, c1 = sink_end // page, recent_start // page
        heads, _, dim = qp.shape
        entry = self._entry(key, table, layers, heads, dim, total // page)
        filled = entry.filled[local]
        if filled < c1:  # every whole page stored: the next read is a window's pages away
            upto = total // page
            self._put(entry, local, filled, read_keys(filled * page, upto * page))
            self.stats.pages_summarised_from_tiers += upto - filled
        groups = entry.groups[local] if entry.groups is not None else None
        refine = self.refined(choose) if groups is not None else 0
        return Choice(
            entry.data[local],
            c0,
            c1,
            choose,
            start,
            sink_end,
            recent_start,
            total,
            groups,
            refine,
        )

    def ranges(self, choice: Choice, qp: torch.Tensor) -> np.ndarray:
        """The key ranges each KV head attends, as rows (head, lo, hi) grouped by head
        (each head's sorted and disjoint)."""
        c = choice
        summaries = c.summaries.transpose(1, 2)  # [Hkv, capacity, W] views
        groups = c.groups.transpose(1, 2) if c.groups is not None else None
        scored = 0
        if c.choose:
            q = _scoring(qp, summaries.shape[-1], self.score, summaries.device, self.channels)
            pages, rows = _choose(summaries, groups, q, c.c0, c.c1, c.choose, self.coarse, c.refine)
            scored = rows * int(torch.count_nonzero(q))  # the summary values read
        else:
            pages = np.empty((qp.shape[0], 0), dtype=np.int64)
        out = _ranges(pages, c.c0, c.start, c.sink_end, c.recent_start, c.total, self.page)
        self.record(c, qp.shape[0], int((out[:, 2] - out[:, 1]).sum()), scored)
        return out

    def record(self, choice: Choice, heads: int, attended: int, scored: int) -> None:
        """Count one selecting decode attention that attended `attended` (key, KV head)
        pairs and read `scored` summary values (over its heads; none when it chose no
        page)."""
        c = choice
        self.stats.layers += 1
        self.stats.keys_attended += attended
        self.stats.keys_in_context += heads * (c.total - c.start)
        if c.choose:
            self.stats.summary_bytes += scored * c.summaries.element_size()

    def select(
        self,
        key: Hashable,
        table: Any,
        layers: int,
        local: int,
        qp: torch.Tensor,
        start: int,
        total: int,
        read_keys: Callable[[int, int], torch.Tensor],
    ) -> np.ndarray | None:
        """The key ranges each KV head attends in the decode of packed queries qp
        [Hkv, R, D] over keys [start, total), as rows (head, lo, hi) grouped by head
        (each head's sorted and disjoint); None for all of them. `read_keys(lo, hi)`
        returns stored keys [Hkv, hi - lo, D] of pages that have no summary yet."""
        choice = self.prepare(key, table, layers, local, qp, start, total, read_keys)
        return None if choice is None else self.ranges(choice, qp)
