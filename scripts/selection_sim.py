"""A fast simulation of query-aware key selection (`attention_budget`) for sweeping its
settings: the teacher-forced decode of a window's last 127 tokens as one chunk forward
whose rows are each masked to the keys the selector would choose (sinks, chosen pages,
the newest share of the budget; `KeySelector.bounds`' arithmetic), after an exact
prefill that is cached in /tmp. ΔPPL against exact attention over the same tokens; on
smollm2 at 8k it reproduced `kvstrata bench selection` within 0.3 points.

usage: PYTHONPATH=src python scripts/selection_sim.py 8192 2 \
    '[{"budget": 0.125}, {"budget": 0.125, "reduce": "sum", "page": 8}]'
config keys: budget (share), summary (minmax|mean), page, recent (share of the budget),
reduce (max|sum|softmax over a KV head's query heads), dense (first layers exact), sink
(tokens always attended at the start), shared (with channels: one channel set per KV
head, its query rows' largest sum |q_d|), q8 (min/max summaries quantized to int8 per
page, max rounded up and min down), group (two-level scoring: coarse summaries of this
many pages; 0: one level) with refine (pages of the best ceil(refine * choose / group)
coarse groups are scored and chosen from), channels (score with each query row's this
many largest-|q| channels only, SparQ-style; 0: all)."""

import json
import math
import sys
import time

import torch
from transformers import AttentionInterface, DynamicCache

from kvstrata.quality.evaluate import heldout_windows
from kvstrata.workload.zoo import load_model

torch.set_num_threads(2)
CTX = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
SCORED = 127
WINDOWS = int(sys.argv[2]) if len(sys.argv) > 2 else 2
CFG = {}  # current config


def bounds(total, budget_share, page, recent_share, sink=4):
    budget = int(budget_share * total)
    if budget >= total:
        return None
    recent_start = max(0, (total - max(page, int(budget * recent_share))) // page * page)
    sink_end = min(recent_start, -(-max(sink, 1) // page) * page)
    choose = max(0, budget - sink_end - (total - recent_start)) // page
    if choose >= (recent_start - sink_end) // page:
        return None
    return sink_end, recent_start, choose


STATS = {"att": 0, "ctx": 0}


def _refined(row, crow, c0, c1, group, choose, refine):
    """Fine scores row [hkv, c1 - c0] with every page outside the best groups set to
    -inf: of the groups wholly inside [c0, c1) (coarse scores crow [hkv, groups]), the
    best ceil(refine * choose / group); pages of groups cut by c0 or c1 stay."""
    g0, g1 = -(-c0 // group), c1 // group
    if g1 <= g0:
        return row
    n = min(g1 - g0, max(1, math.ceil(refine * choose / group)))
    best = torch.topk(crow[:, g0:g1], n, dim=-1).indices + g0  # [hkv, n]
    keep = torch.zeros(row.shape[0], g1, dtype=torch.bool)
    keep.scatter_(1, best, True)
    fine = torch.ones_like(row, dtype=torch.bool)
    idx = torch.arange(c0, c1)
    inside = (idx >= g0 * group) & (idx < g1 * group)
    fine[:, inside] = keep[:, idx[inside] // group]
    # how many groups an exact refinement would open: bound >= the k-th best page
    kth = torch.topk(row, choose, dim=-1).values[:, -1:]
    STATS["need"] = STATS.get("need", 0) + int((crow[:, g0:g1] >= kth).sum())
    STATS["groups"] = STATS.get("groups", 0) + row.shape[0] * (g1 - g0)
    return row.masked_fill(~fine, float("-inf"))


def quest_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
    # query [1, Hq, T, D], key/value [1, Hkv, S, D]
    _, hq, t, d = query.shape
    hkv, s = key.shape[1], key.shape[2]
    r = hq // hkv
    q = query[0].reshape(hkv, r, t, d)
    k, v = key[0], value[0]
    logits = torch.einsum("hrtd,hsd->hrts", q, k) * scaling
    past = s - t
    pos = torch.arange(s)
    qpos = torch.arange(past, s)
    allowed = (pos[None, :] <= qpos[:, None])[None].expand(hkv, t, s).clone()  # [hkv, t, s]
    layer = module.layer_idx
    cfg = CFG
    if cfg and layer >= cfg.get("dense", 0):
        page = cfg.get("page", 16)
        npages = s // page
        kp = k[:, : npages * page].reshape(hkv, npages, page, d)
        qs = q
        top = cfg.get("channels", 0)
        if top and cfg.get("shared"):  # one channel set per KV head: by its rows' sum |q|
            mag = q.abs().sum(1, keepdim=True)
            kth = mag.topk(top, dim=-1).values[..., -1:]
            qs = q * (mag >= kth)
        elif top:  # score with each query row's `top` largest |q_d| channels only (SparQ)
            kth = q.abs().topk(top, dim=-1).values[..., -1:]
            qs = q * (q.abs() >= kth)
        if cfg.get("summary", "minmax") == "minmax":
            summ = torch.cat([kp.amax(2), kp.amin(2)], -1)  # [hkv, P, 2D]
            if cfg.get("q8"):  # int8 per page, max rounded up and min down: still a bound
                scale = summ.abs().amax(-1, keepdim=True).clamp(min=1e-30) / 127
                summ = (
                    torch.cat(
                        [torch.ceil(summ[..., :d] / scale), torch.floor(summ[..., d:] / scale)], -1
                    )
                    * scale
                )
            qq = torch.cat([qs.clamp(min=0), qs.clamp(max=0)], -1)
        else:
            summ = kp.mean(2)
            qq = qs
        sc = torch.einsum("hrtd,hpd->hrtp", qq, summ)  # [hkv, r, t, P]
        red = cfg.get("reduce", "max")
        if red == "max":
            sc = sc.amax(1)
        elif red == "sum":
            sc = sc.sum(1)
        elif red == "softmax":  # normalise per query head over pages, then sum
            sc = torch.softmax(sc * scaling, -1).sum(1)
        group = cfg.get("group", 0)
        if group:  # coarse summaries of `group` pages: a bound of each of their pages'
            ng = npages // group
            kg = k[:, : ng * group * page].reshape(hkv, ng, group * page, d)
            if cfg.get("summary", "minmax") == "minmax":
                cs = torch.cat([kg.amax(2), kg.amin(2)], -1)
            else:
                cs = kg.mean(2)
            csc = torch.einsum("hrtd,hpd->hrtp", qq, cs)
            csc = csc.amax(1) if red == "max" else csc.sum(1)
        for i in range(t):
            total = past + i + 1
            b = bounds(total, cfg["budget"], page, cfg.get("recent", 0.25), cfg.get("sink", 4))
            STATS["ctx"] += hkv * total
            if b is None:
                STATS["att"] += hkv * total
                continue
            sink_end, recent_start, choose = b
            c0, c1 = sink_end // page, recent_start // page
            row = sc[:, i, c0:c1]
            group = cfg.get("group", 0)
            if group and choose:  # two levels: refine only the best groups' pages
                row = _refined(row, csc[:, i], c0, c1, group, choose, cfg.get("refine", 2.0))
            chosen = torch.topk(row, choose, dim=-1).indices + c0  # [hkv, choose]
            m = torch.zeros(hkv, s, dtype=torch.bool)
            m[:, :sink_end] = True
            m[:, recent_start:total] = True
            pm = torch.zeros(hkv, npages, dtype=torch.bool)
            pm.scatter_(1, chosen, True)
            m[:, : npages * page] |= pm.repeat_interleave(page, 1)
            allowed[:, i] &= m
            STATS["att"] += int(m[:, :total].sum())
    elif cfg:
        for i in range(t):
            STATS["ctx"] += hkv * (past + i + 1)
            STATS["att"] += hkv * (past + i + 1)
    logits = logits.masked_fill(~allowed[:, None], float("-inf"))
    probs = torch.softmax(logits, -1)
    out = torch.einsum("hrts,hsd->hrtd", probs, v).reshape(1, hq, t, d).transpose(1, 2)
    return out.contiguous(), None


AttentionInterface.register("quest_sim", quest_attention)


def main(configs):
    model, tok = load_model("smollm2")
    model.eval()
    texts = heldout_windows("smollm2", CTX, WINDOWS, tok)
    res = {json.dumps(c, sort_keys=True): 0.0 for c in configs}
    shares = {k: [0, 0, 0, 0] for k in res}
    ref = 0.0
    for wi, ids in enumerate(texts):
        ids = torch.tensor(ids)[None]
        pre = CTX - SCORED
        t0 = time.time()
        model.set_attn_implementation("sdpa")
        import os

        path = f"/tmp/kvstrata-selection-sim-kv-{CTX}-{wi}.pt"
        cache = DynamicCache(config=model.config)
        if os.path.exists(path):
            kv = torch.load(path)
            for li, (k, v) in enumerate(kv):
                cache.update(k, v, li)
        else:
            with torch.inference_mode():
                model(ids[:, :pre], past_key_values=cache, use_cache=True)
            torch.save([(lay.keys, lay.values) for lay in cache.layers], path)
        print(f"prefill {time.time() - t0:.1f}s", file=sys.stderr, flush=True)
        model.set_attn_implementation("quest_sim")
        chunk, target = ids[:, pre : CTX - 1], ids[0, pre + 1 : CTX]

        def nll(cfg, chunk=chunk, cache=cache, pre=pre, target=target):
            CFG.clear()
            CFG.update(cfg)
            STATS.update(att=0, ctx=0, need=0, groups=0)
            with torch.inference_mode():
                out = model(chunk, past_key_values=cache, use_cache=True)
            cache.crop(-(CTX - 1 - pre))
            lp = torch.nn.functional.cross_entropy(out.logits[0].float(), target, reduction="sum")
            return float(lp)

        ref += nll({})
        for c in configs:
            k = json.dumps(c, sort_keys=True)
            res[k] += nll(c)
            shares[k][0] += STATS["att"]
            shares[k][1] += STATS["ctx"]
            shares[k][2] += STATS["need"]
            shares[k][3] += STATS["groups"]
    n = len(texts) * (SCORED - 1)
    for k, v in res.items():
        d = 100 * (math.exp((v - ref) / n) - 1)
        extra = ""
        if shares[k][3]:
            extra = f"  exact refinement opens {shares[k][2] / shares[k][3]:.3f} of the groups"
        print(
            f"{k}: dPPL {d:+.2f} %  attended {shares[k][0] / shares[k][1]:.3f}{extra}",
            flush=True,
        )
    print(f"ref ppl {math.exp(ref / n):.4f}", flush=True)


if __name__ == "__main__":
    configs = json.loads(sys.argv[3])
    main(configs)
