"""The report's PNG figures, drawn from the measured data alone (matplotlib, Agg).

Each `draw_*` takes one section's data and a path and returns the figure's caption;
`FIGURES` lists them in report order. Axes carry units, log scales where the data
spans decades, and every line or bar series has a legend entry.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvstrata.platform.plotting import pyplot
from kvstrata.report.markdown import PPL_LABEL

__all__ = ["FIGURES", "pyplot"]

MIB = 2**20
DPI = 110
# One colour per series kind, the same in every figure.
COLOURS = {
    "none": "#1f77b4",
    "fp8": "#9467bd",
    "int8": "#2ca02c",
    "int4": "#d62728",
    "int4-g32": "#ff7f0e",
    "int4-g128": "#8c564b",
    "DynamicCache": "#7f7f7f",
}


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    import matplotlib.pyplot as plt

    plt.close(fig)


def _log(ax: Any, axis: str = "y", base: int = 10) -> None:
    """A log axis labelled in plain numbers (0.5, 1, 2, 5, 10, ...), not 5x10^-1."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    target = ax.yaxis if axis == "y" else ax.xaxis
    (ax.set_yscale if axis == "y" else ax.set_xscale)("log", base=base)
    if base == 10:
        target.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    target.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    target.set_minor_formatter(NullFormatter())


def _at_least(ax: Any, half_span: float, axis: str = "x") -> None:
    """Widen a linear axis around 0 to +-half_span at least (float rounding of a
    lossless row, 1e-6 %, must not look like a bar)."""
    lo, hi = ax.get_xlim() if axis == "x" else ax.get_ylim()
    lo, hi = min(lo, -half_span), max(hi, half_span)
    (ax.set_xlim if axis == "x" else ax.set_ylim)(lo, hi)


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _share_range(shares: list[float]) -> str:
    """Measured device shares as "12 %" or "12-24 %"."""
    if not shares:
        return "none"
    lo, hi = round(100 * min(shares)), round(100 * max(shares))
    return f"{lo} %" if lo == hi else f"{lo}–{hi} %"


def draw_strategy(data: dict[str, Any], path: Path) -> str:
    """Strategy comparison: device / stored KV bytes, decode tok/s, ΔPPL, greedy agreement."""
    plt = pyplot()
    rows = data["rows"][::-1]  # the first row on top
    y = list(range(len(rows)))
    fig, (ax_b, ax_s, ax_q, ax_g) = plt.subplots(
        1, 4, figsize=(15, 4.4), sharey=True, gridspec_kw={"width_ratios": [1.3, 1, 1, 1]}
    )
    h = 0.38
    ax_b.barh(
        [i + h / 2 for i in y],
        [r["device_bytes"] / MIB for r in rows],
        h,
        label="on the device (blocks + staging)",
        color="#1f77b4",
    )
    ax_b.barh(
        [i - h / 2 for i in y],
        [r["stored_bytes"] / MIB for r in rows],
        h,
        label="stored in all tiers",
        color="#aec7e8",
    )
    _log(ax_b, "x")
    ax_b.set_xlabel("KV bytes (MiB, log)")
    ax_b.set_yticks(y, [r["strategy"] for r in rows])
    ax_b.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), fontsize=8, ncol=1)
    bars = ax_s.barh(y, [r["tok_per_s"] for r in rows], 0.6, color="#2ca02c")
    ax_s.bar_label(bars, fmt="%.1f", fontsize=8, padding=2)
    ax_s.margins(x=0.18)
    ax_s.set_xlabel("decode tokens/s (median)")
    ax_s.set_title("Speed")
    quality = [r for r in rows if "delta_ppl_pct" in r]
    bars = ax_q.barh(
        [y[rows.index(r)] for r in quality],
        [r["delta_ppl_pct"] for r in quality],
        0.6,
        color="#d62728",
    )
    labels = [f"{round(r['delta_ppl_pct'], 3) + 0.0:+.3f}" for r in quality]  # no "-0.000"
    ax_q.bar_label(bars, labels=labels, fontsize=8, padding=2)
    ax_q.axvline(0, color="black", lw=0.8)
    _at_least(ax_q, 0.1)
    lo, hi = ax_q.get_xlim()
    ax_q.set_xlim(lo - 0.25 * (hi - lo) * (lo < 0), hi + 0.25 * (hi - lo))  # room for labels
    ax_q.set_xlabel(f"{PPL_LABEL} (%)")
    ax_q.set_title("Perplexity change")
    agreement = [100 * r["greedy_agreement"] for r in quality]
    bars = ax_g.barh([y[rows.index(r)] for r in quality], agreement, 0.6, color="#9467bd")
    ax_g.bar_label(bars, fmt="%.0f", fontsize=8, padding=2)
    ax_g.set_xlim(0, 115)
    ax_g.set_xlabel("tokens before the first difference (%)")
    ax_g.set_title("Greedy agreement")
    ax_b.set_title("KV memory")
    for ax in (ax_q, ax_g):
        for r in rows:
            if "delta_ppl_pct" not in r:
                at = (0.5, y[rows.index(r)])
                ax.annotate(
                    "reference",
                    at,
                    xycoords=("axes fraction", "data"),
                    ha="center",
                    va="center",
                    fontsize=8,
                )
    shares = [r["device_fraction"] for r in rows if r["device_fraction"] < 1]
    fig.suptitle(
        f"Offloading strategies: {data['model']} ({data['geometry']['dtype']}), "
        f"{_tokens(data['context'])}-token context, {_share_range(shares)} of the blocks on "
        f"the device when offloaded (asked {100 * data['resident']:.0f} %)"
    )
    _save(fig, path)
    return (
        f"Offloading strategies on {data['model']}: KV bytes on the device and stored in all "
        f"tiers, decode speed at {data['context']} tokens (median of {data['repeats']} "
        f"interleaved rounds of {data['steps']} steps) and quality (ΔPPL over "
        f"{data['ppl']['predictions']} held-out tokens, greedy agreement over "
        f"{data['greedy']['prompts']} x {data['greedy']['new']} new tokens)."
    )


def draw_resident(data: dict[str, Any], path: Path) -> str:
    """Decode tok/s vs the measured device share, one line per lower-tier codec."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    dynamic = [r for r in data["rows"] if r["codec"] is None]
    codecs = dict.fromkeys(c for r in data["rows"] if r["codec"] is not None for c in r["codecs"])
    for codec in codecs:
        pts = sorted(
            (r["device_fraction"], r["tok_per_s"]) for r in data["rows"] if codec in r["codecs"]
        )
        name = f"{data.get('dtype', 'exact')} (none)" if codec == "none" else codec
        ax.plot(
            [100 * x for x, _ in pts],
            [t for _, t in pts],
            marker="o",
            color=COLOURS.get(codec),
            label=f"TieredCache, host {name}",
        )
    for r in dynamic:
        ax.axhline(
            r["tok_per_s"],
            color=COLOURS["DynamicCache"],
            ls="--",
            label="DynamicCache (all in memory)",
        )
    _log(ax, "x")
    ax.set_xlim(0.8, 125)
    ax.set_xlabel("KV blocks on the device (%, log)")
    ax.set_ylabel("decode tokens/s")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=9)
    ax.set_title(f"Resident fraction vs decode speed, {_tokens(data['context'])} context")
    _save(fig, path)
    return (
        f"Decode tokens/s at {data['context']} tokens against the share of KV blocks on "
        f"the device (measured), the rest on the host in each codec; median of "
        f"{data['repeats']} interleaved rounds of {data['steps']} steps. Lossy codecs keep "
        "the residual window and the sinks on the device, which sets their smallest share."
    )


def draw_context(data: dict[str, Any], path: Path) -> str:
    """Device KV bytes and step time vs context, DynamicCache vs TieredCaches."""
    plt = pyplot()
    fig, (ax_m, ax_t) = plt.subplots(1, 2, figsize=(12, 4.3))
    for label in dict.fromkeys(r["variant"] for r in data["rows"]):
        pts = sorted((r["context"], r) for r in data["rows"] if r["variant"] == label)
        codec = "DynamicCache" if label == "DynamicCache" else label.rsplit(" ", 1)[-1]
        colour = COLOURS.get("none" if codec == "fp32" else codec)
        xs = [c for c, _ in pts]
        ax_m.plot(
            xs, [r["device_bytes"] / MIB for _, r in pts], marker="o", color=colour, label=label
        )
        ax_t.plot(xs, [1e3 * r["step_s"] for _, r in pts], marker="o", color=colour, label=label)
    for ax in (ax_m, ax_t):
        ax.set_xscale("log", base=2)
        ax.set_xticks(data["contexts"], [_tokens(c) for c in data["contexts"]])
        ax.set_xlabel("context (tokens, log)")
        ax.legend(fontsize=9)
    _log(ax_m)
    ax_m.set_ylabel("KV bytes on the device (MiB, log)")
    ax_m.set_title(f"Device KV: newest {data['resident_tokens']} tokens resident")
    _log(ax_t)
    ax_t.set_ylabel("decode step (ms, log)")
    ax_t.set_title("Decode step time")
    _save(fig, path)
    return (
        f"KV bytes on the device (blocks + staging buffer) and decode step time from "
        f"{_tokens(data['contexts'][0])} to {_tokens(data['contexts'][-1])} tokens: "
        f"DynamicCache grows with the context, the TieredCaches keep the newest "
        f"{data['resident_tokens']} tokens on the device and the rest on the host; median "
        f"of {data['repeats']} interleaved rounds of {data['steps']} steps."
    )


def draw_block_size(data: dict[str, Any], path: Path) -> str:
    """Single-block read latency and GB/s vs block size, per tier."""
    plt = pyplot()
    sweep = data["sweep"]
    tiers = [k for k in sweep[0] if isinstance(sweep[0][k], dict)]
    sizes = [r["block_size"] for r in sweep]
    fig, (ax_l, ax_g) = plt.subplots(1, 2, figsize=(12, 4.3))
    for tier in tiers:
        ax_l.plot(sizes, [r[tier]["latency_us"] for r in sweep], marker="o", label=f"{tier} tier")
        ax_g.plot(sizes, [r[tier]["gb_per_s"] for r in sweep], marker="o", label=f"{tier} tier")
    labels = [f"{s}\n{r['block_bytes'] / 1024:.0f} KiB" for s, r in zip(sizes, sweep, strict=True)]
    for ax in (ax_l, ax_g):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, labels, fontsize=8)
        ax.set_xlabel("block size (tokens / bytes, log)")
        _log(ax)
        ax.legend(fontsize=9)
    ax_l.set_ylabel("single-block read, median (µs, log)")
    ax_l.set_title("Latency per block")
    ax_g.set_ylabel("read throughput (GB/s, log)")
    ax_g.set_title("Throughput of one-block reads")
    _save(fig, path)
    return (
        f"One-block reads from each tier against the block size ({data['token_bytes']:,} B "
        f"per token, {data['dtype']}; {data['samples']} random reads per point, medians; "
        "page cache warm): small blocks pay the per-call cost, large ones move bytes a step "
        "may not need."
    )


def draw_codecs(data: dict[str, Any], path: Path) -> str:
    """Bits per element vs attention error, ΔPPL and encode/decode speed."""
    plt = pyplot()
    rows = data["rows"]
    fig, (ax_e, ax_p, ax_s) = plt.subplots(1, 3, figsize=(14, 4.2))
    for r in rows:
        colour = COLOURS.get(r["codec"])
        if r["attn_rel_err"] > 0:
            ax_e.scatter(r["bits"], 100 * r["attn_rel_err"], color=colour, label=r["codec"])
            ax_e.annotate(f" {r['codec']}", (r["bits"], 100 * r["attn_rel_err"]), fontsize=8)
        if r["delta_ppl_pct"] is not None:
            ax_p.scatter(r["bits"], r["delta_ppl_pct"], color=colour, label=r["codec"])
            ax_p.annotate(f" {r['codec']}", (r["bits"], r["delta_ppl_pct"]), fontsize=8)
        ax_s.scatter(r["bits"], r["dec"], color=colour, marker="o")
        ax_s.scatter(r["bits"], r["enc"], color=colour, marker="^")
        ax_s.annotate(f" {r['codec']}", (r["bits"], r["dec"]), fontsize=8)
    ax_s.scatter([], [], color="grey", marker="o", label="decode")
    ax_s.scatter([], [], color="grey", marker="^", label="encode")
    _log(ax_e)
    ax_e.set_ylabel("attention output error (% rel. L2, log)")
    ax_e.set_title("Attention error (synthetic K/V, outliers)")
    exact = [r["codec"] for r in rows if r["attn_rel_err"] == 0]
    if exact:
        ax_e.annotate(
            f"exact (error 0): {', '.join(exact)}",
            (0.98, 0.96),
            xycoords="axes fraction",
            ha="right",
            va="top",
            fontsize=8,
        )
    ax_p.axhline(0, color="black", lw=0.8)
    _at_least(ax_p, 0.1, "y")
    ax_p.set_ylabel(f"{PPL_LABEL} (%)")
    shares = [r["ppl_device_fraction"] for r in rows if r.get("ppl_device_fraction") is not None]
    ax_p.set_title(f"ΔPPL, embedded model, {_share_range(shares)} on the device")
    _log(ax_s)
    ax_s.set_ylabel(f"GB/s of {data['dtype']} input (log)")
    ax_s.set_title("Codec speed")
    for ax, where in ((ax_e, "lower left"), (ax_p, "lower left"), (ax_s, "lower right")):
        ax.set_xlabel("stored bits per element (incl. scales)")
        ax.legend(fontsize=7, ncol=2, loc=where)
    _save(fig, path)
    return (
        f"Each codec's stored bits per element (scales counted) against the attention error "
        f"on synthetic K/V with outlier channels, ΔPPL of the embedded model with the codec on "
        f"the host tier ({data['ppl_window']}-token held-out window) and encode / decode GB/s "
        f"({data['size_mib']} MiB of {data['dtype']} K and V, median of {data['repeats']})."
    )


PREFIX_LABELS = {
    "cold": "cold\n(full prefill)",
    "warm": "warm\n(hit in memory)",
    "restart": "after a restart\n(hit on disk)",
    "cold_disk": "cold, empty disk\n(full prefill)",
}


def draw_serving(prefix: dict[str, Any] | None, serve: dict[str, Any] | None, path: Path) -> str:
    """Prefix reuse TTFT and engine throughput vs concurrency."""
    plt = pyplot()
    panels = [p for p in (prefix, serve) if p is not None]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2), squeeze=False)
    axes = list(axes[0])
    parts = []
    if prefix is not None:
        ax = axes.pop(0)
        names = [PREFIX_LABELS.get(v["variant"], v["variant"]) for v in prefix["variants"]]
        bars = ax.bar(
            names,
            [v["ttft_ms"] for v in prefix["variants"]],
            color="#1f77b4",
            label="time to first token (median)",
        )
        ax.bar_label(bars, fmt="%.0f ms", fontsize=8, padding=2)
        ax.margins(y=0.12)
        ax.tick_params(axis="x", labelsize=8)
        ax.set_ylabel("time to first token (ms)")
        ax.set_xlabel("state of the prefix cache")
        ax.set_title(
            f"Prefix reuse: {prefix['prefix_tokens']} cached + {prefix['suffix_tokens']} new tokens"
        )
        ax.legend(fontsize=9)
        parts.append(
            f"time to first token with a {prefix['prefix_tokens']}-token prefix cold, warm "
            "(in memory), after a restart (from disk) and with an empty disk "
            f"(`{prefix['command']}`)"
        )
    if serve is not None:
        ax = axes.pop(0)
        v = serve["variants"]
        levels = [c for c in (1, 4, 8) if f"c{c}" in v]
        ax.plot(
            levels,
            [v[f"c{c}"]["tokens_per_s"] for c in levels],
            marker="o",
            label="kvstrata engine",
        )
        ax.axhline(
            v["baseline"]["tokens_per_s"],
            color=COLOURS["DynamicCache"],
            ls="--",
            label="generate + DynamicCache, one at a time",
        )
        if "c8_dev25" in v:
            share = serve["dev25_device_share"]
            what = f"{share:.0%} of" if share < 1 else "a device budget >="
            ax.scatter(
                [8],
                [v["c8_dev25"]["tokens_per_s"]],
                marker="s",
                color="#d62728",
                label=f"engine, {what} the running KV on the device",
            )
        ax.set_xticks(levels)
        ax.set_xlabel("requests running at once")
        ax.set_ylabel("output tokens/s")
        ax.set_ylim(bottom=0)
        ax.set_title(f"Engine: {serve['requests']} requests x {serve['max_tokens']} tokens")
        ax.legend(fontsize=9)
        parts.append(f"engine output tokens/s at concurrency 1 / 4 / 8 (`{serve['command']}`)")
    _save(fig, path)
    text = "; ".join(parts)
    return text[0].upper() + text[1:] + "; embedded model, medians of interleaved rounds."


def draw_planner(data: dict[str, Any], path: Path) -> str:
    """Predicted vs measured bytes per tier and step time."""
    plt = pyplot()
    rows = data["rows"]
    fig, (ax_b, ax_t) = plt.subplots(1, 2, figsize=(12, 4.8))
    markers = {"device": "o", "host": "s", "disk": "^"}
    lo, hi = float("inf"), 0.0
    for tier, marker in markers.items():
        pts = [
            (r["predicted"][tier], r["measured"][tier])
            for r in rows
            if r["predicted"][tier] or r["measured"][tier]
        ]
        if not pts:
            continue
        xs, ys = [p / MIB for p, _ in pts], [m / MIB for _, m in pts]
        label = "device tier (excl. staging)" if tier == "device" else f"{tier} tier"
        ax_b.scatter(xs, ys, marker=marker, label=label, alpha=0.8)
        lo, hi = min(lo, *xs, *ys), max(hi, *xs, *ys)
    if hi > 0:
        ax_b.plot([lo, hi], [lo, hi], color="black", lw=0.8, label="predicted = measured")
    _log(ax_b, "x")
    _log(ax_b)
    ax_b.set_xlabel("predicted by kvstrata plan (MiB, log)")
    ax_b.set_ylabel("measured in the cache (MiB, log)")
    ax_b.set_title("KV bytes per tier")
    ax_b.legend(fontsize=9)
    for section, marker in (("strategy", "o"), ("context", "s")):
        sel = [r for r in rows if r["section"] == section]
        if not sel:
            continue
        ok = [r for r in sel if not r["step_off_by_more_than_2x"]]
        off = [r for r in sel if r["step_off_by_more_than_2x"]]
        for group, colour, what in ((ok, "#2ca02c", "within 2x"), (off, "#d62728", "off > 2x")):
            if group:
                ax_t.scatter(
                    [1e3 * r["predicted"]["step_s"] for r in group],
                    [1e3 * r["measured"]["step_s"] for r in group],
                    marker=marker,
                    color=colour,
                    label=f"{section} cases, {what}",
                )
    times = [1e3 * r[k]["step_s"] for r in rows for k in ("predicted", "measured")]
    if times:
        a, b = min(times) / 3, max(times) * 3
        ax_t.plot([a, b], [a, b], color="black", lw=0.8, label="predicted = measured")
        ax_t.fill_between(
            [a, b], [a / 2, b / 2], [2 * a, 2 * b], color="grey", alpha=0.15, label="within 2x"
        )
    _log(ax_t, "x")
    _log(ax_t)
    ax_t.set_xlabel("predicted step bound (ms, log)")
    ax_t.set_ylabel("measured step (ms, log)")
    ax_t.set_title("Decode step time")
    ax_t.legend(fontsize=8)
    _save(fig, path)
    return (
        "kvstrata plan's bytes per tier (device without the staging buffer, which the table "
        "compares on its own) and decode-step bound for every measured cache, given this "
        "machine's measured copy and tier bandwidths and each cache's asked device share, "
        "against the bytes the cache held and the median step time."
    )


Drawer = Callable[[dict[str, Any], Path], str]
FIGURES: dict[str, tuple[str, Drawer]] = {
    "strategy": ("strategy.png", draw_strategy),
    "resident": ("resident.png", draw_resident),
    "context": ("context.png", draw_context),
    "block_size": ("block_size.png", draw_block_size),
    "codecs": ("codecs.png", draw_codecs),
    "planner": ("planner.png", draw_planner),
}
SERVING_FIGURE = "serving.png"
