"""Scoring a sequence's pages from their summaries in torch / numpy (selection/selector.py):
the path of a device without the native kernel (CUDA, or a CPU where it did not
build), and the reference the native kernel (platform/csrc/select.cpp) is tested
against. A page's score for a query row is sum_d max(q_d max_d, q_d min_d) with
min/max summaries — an upper bound of any of its logits — or q . mean; a KV head
takes its query rows' best score or their sum, each row over its largest-|q|
channels (SparQ), in one level or two (groups of pages first)."""

from __future__ import annotations

import numpy as np
import torch


def page_scores(q: torch.Tensor, summaries: torch.Tensor) -> torch.Tensor:
    """Scores [Hkv, pages, R] of packed queries q [Hkv, R, D] against page summaries
    [Hkv, pages, W]: with the per-channel max and min (W = 2D),
    sum_d max(q_d max_d, q_d min_d) — at least any logit q . k of the page; with the
    mean (W = D), q . mean. One batched product over the summaries' rows as stored."""
    if summaries.shape[-1] != q.shape[-1]:
        q = torch.cat([q.clamp(min=0), q.clamp(max=0)], dim=-1)
    return summaries @ q.transpose(1, 2)


def _scoring(
    qp: torch.Tensor, width: int, score: str, device: torch.device, channels: int = 0
) -> torch.Tensor:
    """Packed queries qp [Hkv, R, D] as the vectors summaries of `width` are scored with
    [Hkv, R', width]: each row kept to its `channels` largest |q_d| (0: all; ties: the
    lower channel), then (q+, q-) for min/max, the rows summed for "sum" (the scores
    are linear in them)."""
    q = qp.detach().to(device, torch.float32)
    dim = q.shape[-1]
    if 0 < channels < dim:
        mag = q.abs().nan_to_num(nan=float("inf"))
        # a stable descending sort: equal magnitudes keep the lower channel first
        order = torch.sort(mag, dim=-1, descending=True, stable=True).indices
        keep = torch.zeros_like(q, dtype=torch.bool).scatter_(-1, order[..., :channels], True)
        q = q * keep
    if width != dim:
        q = torch.cat([q.clamp(min=0), q.clamp(max=0)], dim=-1)
    return q.sum(dim=1, keepdim=True) if score == "sum" else q


def _scores(rows: torch.Tensor, q: torch.Tensor) -> torch.Tensor | np.ndarray:
    """Each page's score [Hkv, n] from its summary rows [Hkv, n, W] and scoring vectors
    q [Hkv, R', W]: the best vector's. As the native kernel: a NaN among the values a
    vector reads (nonzero coefficient) makes the page +inf (chosen first); a value it
    does not read counts for nothing. numpy on the CPU (no torch dispatch per op)."""
    if rows.device.type == "cpu":
        r, v = rows.float().numpy(), q.numpy().transpose(0, 2, 1)
        bad = np.isnan(r)
        sc = np.matmul(np.where(bad, 0.0, r), v)
        if bad.any():
            sc[np.matmul(bad.astype(np.float32), (v != 0).astype(np.float32)) > 0] = np.inf
        return sc.max(-1)
    r = rows.float()
    bad = r.isnan()
    sc = r.nan_to_num(nan=0.0) @ q.transpose(1, 2)
    sc = sc.masked_fill((bad.float() @ (q != 0).float().transpose(1, 2)) > 0, float("inf"))
    return sc.amax(dim=-1)


def _best(scores: torch.Tensor | np.ndarray, k: int) -> np.ndarray:
    """Each row's k best indices of scores [Hkv, n] (+inf first), ascending."""
    if isinstance(scores, np.ndarray):
        return np.sort(np.argpartition(scores, -k, axis=-1)[:, -k:], axis=-1)
    return torch.topk(scores, k, dim=-1, sorted=False).indices.sort(dim=-1).values.cpu().numpy()


def choose_pages(
    summaries: torch.Tensor, qp: torch.Tensor, choose: int, score: str = "max", channels: int = 0
) -> np.ndarray:
    """Each KV head's `choose` best pages [Hkv, choose] (sorted) from its summaries
    [Hkv, pages, W] and packed queries qp [Hkv, R, D], a page scored by its best query
    row's score (`score` "max") or their sum ("sum"), each row over its `channels`
    largest-|q| channels (0: all). A NaN score is chosen first."""
    if choose == 0:
        return np.empty((qp.shape[0], 0), dtype=np.int64)
    q = _scoring(qp, summaries.shape[-1], score, summaries.device, channels)
    return _best(_scores(summaries, q), choose)


def _choose(
    summaries: torch.Tensor,
    groups: torch.Tensor | None,
    q: torch.Tensor,
    c0: int,
    c1: int,
    choose: int,
    group: int,
    refine: int,
) -> tuple[np.ndarray, int]:
    """(the `choose` best pages of [c0, c1) relative to c0 [Hkv, choose], pages scored
    per head) from a layer's page summaries [Hkv, capacity, W] — and group summaries,
    two levels (`choose_two_level`) — and scoring vectors q (`_scoring`); choose >= 1."""
    g0, g1 = (-(-c0 // group), c1 // group) if groups is not None else (0, 0)
    if groups is None or g1 - g0 <= refine:
        return _best(_scores(summaries[:, c0:c1], q), choose), c1 - c0
    heads, dev = q.shape[0], summaries.device
    kept = torch.from_numpy(_best(_scores(groups[:, g0:g1], q), refine)).to(dev) + g0
    inner = (kept[..., None] * group + torch.arange(group, device=dev)).reshape(heads, -1)
    left = torch.arange(c0, g0 * group, device=dev).expand(heads, -1)
    right = torch.arange(g1 * group, c1, device=dev).expand(heads, -1)
    cand = torch.cat([left, inner, right], dim=1)  # [Hkv, candidates], ascending
    rows = summaries[torch.arange(heads, device=dev)[:, None], cand]
    pick = torch.from_numpy(_best(_scores(rows, q), choose)).to(dev)
    return (cand.gather(1, pick) - c0).cpu().numpy(), (g1 - g0) + cand.shape[1]


def choose_two_level(
    summaries: torch.Tensor,
    groups: torch.Tensor,
    qp: torch.Tensor,
    c0: int,
    c1: int,
    choose: int,
    group: int,
    refine: int,
    score: str = "max",
    channels: int = 0,
) -> tuple[np.ndarray, int]:
    """(each KV head's `choose` best pages of [c0, c1), relative to c0 [Hkv, choose]
    sorted; summaries scored per head) with two levels: a layer's page summaries
    [Hkv, capacity, W] and group summaries [Hkv, capacity // group, W] (group g of
    pages [g * group, (g + 1) * group)). Each head scores the groups wholly inside
    [c0, c1), keeps its `refine` best, and chooses among their pages and the pages of
    the groups c0 or c1 cut — every page when no more than `refine` groups lie inside
    (then it is `choose_pages`). As the native kernel (select.cpp) chooses."""
    if choose == 0:
        return np.empty((qp.shape[0], 0), dtype=np.int64), c1 - c0
    q = _scoring(qp, summaries.shape[-1], score, summaries.device, channels)
    return _choose(summaries, groups, q, c0, c1, choose, group, refine)
