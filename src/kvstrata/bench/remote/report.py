"""The summary and the printed table of `kvstrata bench remote` (see kvstrata.bench.remote):
medians, ratios against cold B, agreement with cold B's text, the remote round trip
per block, the slow link's figures, and the done-when verdicts of issue #28."""

from __future__ import annotations

import statistics
from typing import Any

# Done-when targets of issue #28 (reported, never asserted by the tests)
TARGET_SPEEDUP, TARGET_SLOW_WITHIN = 3.0, 0.10


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v == v]
    return statistics.median(values) if values else None


def summarize(out: dict[str, Any]) -> dict[str, Any]:
    """Medians, ratios against B cold, agreement with B cold's text, the round trip per
    block, the slow link's decisions, and the done-when verdicts."""
    recs = out["records"]
    cold_text = [r["text"] for r in recs["cold"]]
    rows: dict[str, dict[str, Any]] = {}
    for kind, records in recs.items():
        if not records:
            continue
        ttft = _median([r["ttft_s"] for r in records])
        same = [r["text"] == c for r, c in zip(records, cold_text, strict=False)]
        rows[kind] = {
            "ttft_s": ttft,
            "ttft_all_s": [r["ttft_s"] for r in records],
            "load_1m": [r["load_1m"] for r in records],
            "cached_tokens": _median([r["cached_tokens"] or 0 for r in records]),
            "remote_hits": sum(r["remote"]["hits"] for r in records),
            "decisions_load": sum(r["remote"]["load"] for r in records),
            "decisions_recompute": sum(r["remote"]["recompute"] for r in records),
            "timeouts": sum(r["remote"]["timeouts"] for r in records),
            "same_as_cold": f"{sum(same)}/{len(same)}",
            "identical": all(same) and len(same) == len(records),
            "complete": all(
                r["error"] is None and r["completion_tokens"] == r["max_tokens"] for r in records
            ),
        }
    cold = rows.get("cold", {}).get("ttft_s")
    for row in rows.values():
        row["vs_cold"] = cold / row["ttft_s"] if cold and row["ttft_s"] else None
    hits = sum(r["remote"]["hits"] for r in recs["remote"])
    read_s = sum(r["remote"]["read_s"] for r in recs["remote"])
    nbytes = sum(r["remote"]["bytes_read"] for r in recs["remote"])
    per_block = {
        "blocks": hits,
        "reads": sum(r["remote"]["reads"] for r in recs["remote"]),
        "read_s": read_s,
        "ms_per_block": 1e3 * read_s / hits if hits else None,
        "bytes_per_block": nbytes / hits if hits else None,
        "mb_per_s": nbytes / read_s / 1e6 if read_s else None,
    }
    verdicts: dict[str, Any] = {}
    if "remote" in rows and cold:
        r = rows["remote"]
        verdicts["remote_speedup"] = r["vs_cold"]
        verdicts["remote_target_met"] = bool(
            r["vs_cold"] and r["vs_cold"] >= TARGET_SPEEDUP and r["identical"]
        )
    if "slow_remote" in rows and cold:
        slow = rows["slow_remote"]["ttft_s"]
        own = rows.get("slow_cold", {}).get("ttft_s")
        verdicts["slow_vs_cold"] = slow / cold - 1
        verdicts["slow_vs_own_cold"] = slow / own - 1 if own else None
        # B_slow's own cold run is the fair comparison: the same process, minutes apart
        # at most, where B cold ran in another phase (other loads, other processes)
        ref = own or cold
        verdicts["slow_target_met"] = abs(slow / ref - 1) <= TARGET_SLOW_WITHIN
    predicted = {}
    link = out.get("slow_link") or {}
    if link.get("latency_s") is not None and per_block["bytes_per_block"]:
        blocks = out["doc_tokens"] // out["block_tokens"]
        load = link["latency_s"] + (
            blocks * per_block["bytes_per_block"] / link["bytes_per_s"]
            if link.get("bytes_per_s")
            else 0.0
        )
        predicted = {"load_s": load, "blocks": blocks}
        if link.get("compute_tok_s"):
            predicted["recompute_s"] = blocks * out["block_tokens"] / link["compute_tok_s"]
    return {"rows": rows, "round_trip": per_block, "predicted": predicted, "verdicts": verdicts}


LABELS = {
    "A": "A (writes the document)",
    "cold": "B cold (fresh salt)",
    "remote": "B remote hit (A's blocks)",
    "disk": "B own disk tier (restarted)",
    "slow_cold": "B_slow cold (fresh salt)",
    "slow_remote": "B_slow, A's doc (slow link)",
}


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None or x != x else format(x, fmt)


def report_lines(out: dict[str, Any]) -> list[str]:
    s = out["summary"]
    lines = [
        f"kvstrata bench remote: {out['model']}, {out['prompt_tokens']}-token prompts "
        f"({out['doc_tokens']}-token documents), {out['repeats']} repeat(s), "
        f"{out['max_tokens']} greedy tokens, {out['block_tokens']}-token blocks, "
        f"{out['cores']} cores",
        f"{'configuration':30} {'TTFT s':>8} {'x cold':>7} {'cached':>7} {'remote':>7} "
        f"{'load/recomp':>11} {'same as cold':>12} {'load 1m':>12}",
    ]
    for kind, row in s["rows"].items():
        loads = ",".join(f"{x:.1f}" for x in row["load_1m"])
        lines.append(
            f"{LABELS[kind]:30} {_f(row['ttft_s']):>8} {_f(row['vs_cold'], '.2f'):>7} "
            f"{_f(row['cached_tokens'], '.0f'):>7} {row['remote_hits']:>7.0f} "
            f"{row['decisions_load']:>5.0f}/{row['decisions_recompute']:<5.0f} "
            f"{row['same_as_cold']:>12} {loads:>12}"
        )
    rt = s["round_trip"]
    lines.append(
        f"remote round trip (B's hits): {rt['blocks']:.0f} blocks in {rt['reads']:.0f} batched "
        f"read(s), {_f(rt['ms_per_block'])} ms/block, {_f(rt['bytes_per_block'], ',.0f')} "
        f"bytes/block, {_f(rt['mb_per_s'], '.0f')} MB/s"
    )
    link = out.get("slow_link") or {}
    if link:
        p, bw = s["predicted"], (link.get("bytes_per_s") or 0) / 1e6
        lines.append(
            f"slow link ({out['delay_ms']} ms per answer chunk, "
            f"{out.get('link_mb_s') or 'unlimited'} MB/s): link model latency "
            f"{_f(link.get('latency_s'))} s, bandwidth {_f(bw, '.1f')}"
            f" MB/s, prefill {_f(link.get('compute_tok_s'), '.0f')} tok/s -> predicted load "
            f"{_f(p.get('load_s'), '.2f')} s vs recompute {_f(p.get('recompute_s'), '.2f')} s for "
            f"{p.get('blocks', '-')} blocks; decisions load {link['load']:.0f} / recompute "
            f"{link['recompute']:.0f}, timeouts {link['timeouts']:.0f}, reads {link['reads']:.0f}"
        )
        lines.append(
            f"B_slow's last lookup (its /metrics): predicted load "
            f"{_f(link.get('last_load_s'), '.2f')} s vs recompute "
            f"{_f(link.get('last_recompute_s'), '.2f')} s"
        )
    v = s["verdicts"]
    if "remote_speedup" in v:
        lines.append(
            f"target B remote >= {TARGET_SPEEDUP:.0f}x faster than cold B, identical tokens: "
            f"{_f(v['remote_speedup'], '.2f')}x -> {'met' if v['remote_target_met'] else 'NOT met'}"
        )
    if "slow_vs_cold" in v:
        own = v["slow_vs_own_cold"]
        lines.append(
            f"target slow link within {100 * TARGET_SLOW_WITHIN:.0f} % of cold: "
            f"{_f(None if own is None else 100 * own, '+.1f')} % vs B_slow's own cold "
            f"({100 * v['slow_vs_cold']:+.1f} % vs B cold, another phase) -> "
            f"{'met' if v['slow_target_met'] else 'NOT met'}"
        )
    lines.append(
        f"load average (1 min) at start {out['load_start']:.2f}, at end {out['load_end']:.2f}; "
        f"Redis held {out.get('redis_used_bytes', 0) / 2**20:.0f} MiB; logs {out['log_dir']}"
    )
    return lines
