"""Attention over the keys query-aware selection chose (`attention.select`), each KV head
over its own ranges, reading nothing else.

When the native kernel reads every key in place, one native call scores, chooses and
attends (`native_selected`). Otherwise the runs the native CPU kernel reads in place
become one descriptor array per KV head
(the step's read plan's parts, moved to the chosen rows and to that head), attended in
one batched native call with one head per "sequence". Staged pieces (the disk tier,
lossy or staged host blocks) are read as whole (block, layer) units, each unit some
head chose a key in read once — or found held by the prediction of the step before
(`prefetch.py`) — and attended in one partial masked to each head's ranges. Other
pieces (device arenas) are viewed for the union of the heads' ranges, each head's
partial masked to its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from kvstrata.attention.native import (
    NATIVE_MAX_DIM,
    native_attention_batch,
    native_select_attention,
)
from kvstrata.attention.reads import ReadPlan
from kvstrata.attention.selection.selector import Choice, union


def _clip(pieces: list[tuple[bool, Any, int, int]], ranges: list[tuple[int, int]]) -> list[tuple]:
    """The pieces (staged, run, lo, hi) clipped to sorted `ranges`."""
    return [
        (staged, run, max(lo, a), min(hi, b))
        for staged, run, lo, hi in pieces
        for a, b in ranges
        if max(lo, a) < min(hi, b)
    ]


def _views(rt: Any, local: int, pieces: list[tuple]) -> Iterator[tuple[int, Any, Any]]:
    """(first token, k, v) views [Hkv, T, D] of pieces (staged, run, lo, hi) in local
    layer `local`: arena views in place, staged ones through the stager's buffers (each
    piece's first chunk starts loading while the previous piece is attended; a view is
    valid until the generator resumes)."""
    staged = [(run, lo, hi) for st, run, lo, hi in pieces if st]
    nxt = 0
    for is_staged, run, lo, hi in pieces:
        if is_staged:
            nxt += 1
            after = None
            if nxt < len(staged):
                r, a, b = staged[nxt]
                first, count, _ = rt.stager.chunks(r, a, b)[0]
                after = (local, r.tier, first, count)
            t = lo
            for k, v in rt.stager.parts(local, run, lo, hi, after):
                yield t, k, v
                t += k.shape[1]
            continue
        k, v = rt.tiers[run.tier].layer_view(local, run.first_slot, run.num_slots)
        off = run.token_start
        yield lo, k[:, lo - off : hi - off], v[:, lo - off : hi - off]


def read_keys(rt: Any, local: int, group: int, seq_id: int, lo: int, hi: int) -> torch.Tensor:
    """Stored keys [lo, hi) of a sequence in a group's local layer, [Hkv, hi - lo, D] on
    the compute device (pages selection has no summary of yet)."""
    plan = rt.reads.read_plan(group, seq_id, lo, hi, native=False)
    keys = [k.to(rt.device, copy=True) for _, k, _ in _views(rt, local, plan.pieces)]
    return torch.cat(keys, dim=1) if len(keys) > 1 else keys[0]


def _masked_partial(
    qp: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed queries qp [Hkv, R, D] over keys k/v [Hkv, T, D] where allowed [Hkv, T]:
    (out [Hkv, R, Dv], lse [Hkv, R]); a head with no allowed key has lse -inf, out 0."""
    q = qp.to(k.device, torch.float32)
    scores = torch.einsum("hrd,htd->hrt", q, k.float()) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed[:, None, :].to(k.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]).nan_to_num_(0.0)
    out = torch.einsum("hrt,htd->hrd", probs, v.float())
    return out.to(qp.device, qp.dtype), lse.to(qp.device)


def native_selected(
    rt: Any,
    local: int,
    plan: ReadPlan,
    choice: Choice,
    qp: torch.Tensor,
    scale: float,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The partial (out [Hkv, R, Dv], lse [Hkv, R]) of packed decode queries qp over
    the keys each KV head chooses, scored, chosen and attended in one native call, when
    the native kernel reads every key of the step's `plan` in place and the summaries
    are on the CPU; else None."""
    c = choice
    if (
        plan.native is None
        or plan.pieces
        or c.summaries.device.type != "cpu"
        or max(qp.shape[-1], rt.layout.dim_v) > NATIVE_MAX_DIM
    ):
        return None
    starts = plan.starts()
    sel = rt.selector
    coarse = (c.groups, sel.coarse, c.refine) if c.groups is not None else None
    out, lse, attended, scored = native_select_attention(
        qp,
        plan.native.at(local),
        plan.native.num_parts,
        starts,
        c.summaries,
        sel.page,
        (c.c0, c.c1, c.choose),
        (c.start, c.sink_end, c.recent_start, c.total),
        rt.layout.dim_v,
        scale,
        softcap,
        score=sel.score,
        coarse=coarse,
        channels=sel.channels,
    )
    sel.record(c, qp.shape[0], attended, scored)
    return out, lse


def selected_partials(
    rt: Any,
    local: int,
    group: int,
    seq_id: int,
    plan: ReadPlan,
    chosen: np.ndarray,
    qp: torch.Tensor,
    scale: float,
    softcap: float | None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Partials (out [Hkv, R, Dv], lse [Hkv, R]) of packed decode queries qp over the
    keys each KV head chose (rows (head, lo, hi) of `KeySelector.select`), read from
    the step's `plan`."""
    hkv, rows, dim = qp.shape
    parts = []
    if plan.native is not None:
        spans = np.asarray(plan.spans, dtype=np.int64)  # [S, 2]
        # every (range, span) pair at once, range-major: still grouped by head
        lo = np.maximum(chosen[:, 1:2], spans[None, :, 0])
        hi = np.minimum(chosen[:, 2:3], spans[None, :, 1])
        r_, i_ = np.nonzero(lo < hi)
        if len(r_):
            lo, hi = lo[r_, i_], hi[r_, i_]
            off, h_ = lo - spans[i_, 0], chosen[r_, 0]
            descs = plan.native.per_head(local, h_, i_, off, hi - lo, hkv)
            out, lse = native_attention_batch(
                qp.reshape(hkv, 1, rows, dim),
                descs.addresses,
                descs.counts,
                rt.layout.dim_v,
                scale,
                softcap,
            )
            parts.append((out[:, 0], lse[:, 0]))
    pieces = plan.pieces
    if pieces and rt.prefetch is not None and plan.has_staged:
        staged = [p for p in pieces if p[0]]
        pieces = [p for p in pieces if not p[0]]
        parts.extend(_staged_partials(rt, local, group, seq_id, staged, chosen, qp, scale, softcap))
    if pieces:
        for t0, k, v in _views(rt, local, _clip(pieces, union(chosen))):
            allowed = torch.from_numpy(_inside(chosen, hkv, t0, k.shape[1]))
            parts.append(_masked_partial(qp, k, v, allowed, scale, softcap))
    return parts


def _inside(chosen: np.ndarray, heads: int, t0: int, n: int) -> np.ndarray:
    """[heads, n] bool: whether key t0 + i lies in one of its head's chosen ranges."""
    # +1 where a head's range starts, -1 where it ends: the running sum is > 0 inside
    # its ranges (each head's are disjoint)
    edges = np.zeros((heads, n + 1), dtype=np.int32)
    np.add.at(edges, (chosen[:, 0], np.clip(chosen[:, 1] - t0, 0, n)), 1)
    np.add.at(edges, (chosen[:, 0], np.clip(chosen[:, 2] - t0, 0, n)), -1)
    return np.cumsum(edges[:, :n], axis=1) > 0


def _staged_partials(
    rt: Any,
    local: int,
    group: int,
    seq_id: int,
    staged: list[tuple],
    chosen: np.ndarray,
    qp: torch.Tensor,
    scale: float,
    softcap: float | None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Partials of packed decode queries qp over the chosen keys in staged runs: each
    (block, layer) unit the heads' ranges touch read once (or found held by the
    prediction, `rt.prefetch`), all of them attended in block order in one masked
    attention (the same sums whatever was held)."""
    bs, hkv = rt.layout.block_size, qp.shape[0]
    end = max(hi for *_, hi in staged)
    nb = -(-end // bs)
    mask = np.zeros((hkv, nb * bs), dtype=bool)
    for _, _, lo, hi in staged:
        mask[:, lo:hi] = True
    mask &= _inside(chosen, hkv, 0, nb * bs)
    per_block = mask.reshape(hkv, nb, bs).sum(axis=(0, 2))
    needs, weights = [], []
    for _, run, lo, hi in staged:
        first = run.token_start // bs
        for b in np.nonzero(per_block[lo // bs : -(-hi // bs)])[0] + lo // bs:
            b = int(b)
            valid = min(hi, run.token_start + run.num_tokens, (b + 1) * bs) - b * bs
            needs.append((b, run.tier, run.first_slot + b - first, valid))
            weights.append(per_block[b])
    parts: list[tuple[torch.Tensor, torch.Tensor]] = []
    if not needs:
        return parts

    def attend(pieces: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        k = torch.cat([p[1] for p in pieces], dim=1) if len(pieces) > 1 else pieces[0][1]
        v = torch.cat([p[2] for p in pieces], dim=1) if len(pieces) > 1 else pieces[0][2]
        pos = (np.array([t for t, _, _ in pieces])[:, None] + np.arange(bs)).ravel()
        allowed = torch.from_numpy(mask[:, pos])
        parts.append(_masked_partial(qp, k, v, allowed, scale, softcap))

    def read(tier: str, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        lay = rt.layout
        n = len(slots) * bs
        k = torch.empty((lay.num_kv_heads, n, lay.head_dim), dtype=lay.dtype)
        v = torch.empty((lay.num_kv_heads, n, lay.dim_v), dtype=lay.dtype)
        with torch.inference_mode(inference):
            rt.tiers[tier].read_layer(local, slots, k, v)
        return k.to(rt.device), v.to(rt.device)

    inference = torch.is_inference_mode_enabled()  # worker threads do not inherit it
    runs = rt.manager.runs((seq_id, group))

    def locate(b: int) -> tuple[str, int] | None:
        for run in runs:
            first = run.token_start // bs
            if first <= b and (b + 1) * bs <= run.token_start + run.num_tokens:
                staged_tier = run.tier not in rt.local and run.tier not in rt.native
                return (run.tier, run.first_slot + b - first) if staged_tier else None
        return None

    key = (seq_id, group)
    table = rt.manager.state.tables[key]
    rt.prefetch.gather(key, table, local, needs, np.asarray(weights), read, attend, locate)
    return parts
