"""report.md from the measured data alone: the machine, then one part per section with
its figure, caption, command and table."""

from __future__ import annotations

from typing import Any

from kvstrata.core.units import format_bytes
from kvstrata.report import compression, predicted
from kvstrata.report.tables import mib as _mib
from kvstrata.report.tables import table as _table

SECTION_TITLES = {
    "strategy": "Offloading strategies (seed kv-cache-optimization §4, kv-offloading §5-6)",
    "resident": "Resident fraction vs decode speed",
    "context": "Context length vs device memory and step time",
    "block_size": "Block size vs tier transfers (seed kv-offloading §4.2.3)",
    "codecs": "Codec bits vs attention error, ΔPPL and speed",
    "compression": "Compression modes on real K/V: bytes stored or read, and their cost",
    "serving": "Prefix reuse and engine concurrency",
    "planner": "kvstrata plan next to the measurement",
}


PPL_LABEL = "ΔPPL vs DynamicCache"  # the exact reference of every ΔPPL: one wording


def _pct(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{100 * x:.{digits}f} %"


def _signed(x: float) -> str:
    """+0.006 %; float rounding of a lossless row (-1e-7) shows as +0.000 %, not -0.000 %."""
    return f"{round(x, 3) + 0.0:+.3f} %"


def _figure(name: str, file: str, caption: str, number: int, data: dict[str, Any]) -> str:
    text = f"![{SECTION_TITLES.get(name, name)}]({file})\n\n*Figure {number}.* {caption}"
    text += f"\nCommand: `{data['command']}`"
    if data.get("bench_command"):
        text += f" (the same measurement alone: `{data['bench_command']}`)"
    return text + "\n"


def machine(report: dict[str, Any]) -> str:
    m = report["machine"]
    v = m["versions"]
    rows = [
        ["cores", m["cores"]],
        ["CPU", m["cpu"]],
        ["memory", format_bytes(m["ram_bytes"])],
        ["accelerator", m["accelerator"]],
        ["OS / Python", f"{m['os']} / {m['python']}"],
        ["versions", ", ".join(f"{k} {val}" for k, val in v.items() if val)],
        ["commit", m["commit"] or "–"],
        ["torch threads", m["threads"]],
        ["load average (1 min), start / end", f"{m['load_before']:.2f} / {m['load_after']:.2f}"],
    ]
    text = "## Machine\n\n" + _table(["", ""], rows) + "\n"
    # the benchmarks call it load_warning (decode), machine_warning (prefix), warning (serve)
    busy = {}
    for name, d in report["sections"].items():
        warning = d.get("load_warning") or d.get("machine_warning") or d.get("warning")
        if warning:
            busy[name] = warning
    if busy:
        first = next(iter(busy.values()))
        text += (
            f"\n> **Warning:** the machine was busy while {', '.join(busy)} ran; the first "
            f"warning: {first}\n"
        )
    return text


def strategy(d: dict[str, Any]) -> str:
    rows = d["rows"]
    base = next(r for r in rows if "delta_ppl_pct" not in r)
    table = []
    for r in rows:
        quality = [
            _signed(r["delta_ppl_pct"]) if "delta_ppl_pct" in r else "reference",
            _pct(r.get("top1_agreement")),
            (
                f"{_pct(r['greedy_agreement'])} ({r['greedy_identical']} identical)"
                if "greedy_agreement" in r
                else "reference"
            ),
        ]
        table.append(
            [
                r["strategy"],
                _pct(r["device_fraction"], 0),
                f"{r['tok_per_s']:.1f}",
                f"{r['tok_per_s'] / base['tok_per_s']:.2f}x",
                _mib(r["device_bytes"]),
                _mib(r["stored_bytes"]),
                *quality,
            ]
        )
    text = _table(
        [
            "strategy",
            "blocks on device",
            "decode tok/s",
            "vs DynamicCache",
            "device KV",
            "stored KV (all tiers)",
            PPL_LABEL,
            "top-1 agreement",
            "greedy agreement",
        ],
        table,
    )
    ppl, greedy = d["ppl"], d["greedy"]
    speed_tokens = d["context"] + d["steps"]
    greedy_tokens = greedy["prompt_tokens"] + greedy["new"]
    scoring = "; ".join(
        f"{r['strategy']}: {_pct(r['ppl_device_fraction'], 0)} of the blocks on the device, "
        f"{r['ppl_lower_tier_predictions']} of {ppl['predictions']} scored predictions read "
        "blocks back from the host / disk tier"
        for r in rows
        if r.get("ppl_lower_tier_predictions") is not None
    )
    text += (
        f"\n\nModel: {d['model']}{' (' + d['model_note'] + ')' if d['model_note'] else ''}; "
        f"{d['context']}-token random prompt, {d['steps']} decode steps x {d['repeats']} "
        f"rounds; block size {d['block_size']}. Device KV counts the device blocks and the "
        f"staging buffer. ΔPPL and top-1: teacher-forced over {ppl['windows']} held-out "
        f"window(s) of {ppl['window']} tokens (exact PPL {ppl['exact_ppl']:.3f}), one token "
        f"per forward after the first {ppl['prefill']}, which every strategy holds exactly "
        f"(the sinks and the {_residual(d)}residual window on the device) and so scores in one "
        "forward; greedy agreement: share of the exact run's tokens reproduced before the "
        f"first difference, {greedy['prompts']} held-out prompt(s) of {greedy['prompt_tokens']} "
        f"tokens + {greedy['new']} new.\n\n"
        f"Each row measures three caches built for the same strategy and asked device share "
        f"({d['resident']:.0%} when offloaded), not one: speed, bytes and blocks on device "
        f"come from a {speed_tokens}-token cache, ΔPPL and top-1 from {ppl['window']}-token "
        f"caches, greedy agreement from {greedy_tokens}-token caches. A lossy codec keeps the "
        "sinks, the residual window and the open block on the device whatever the share, "
        "which is a different share of each length. In the ΔPPL caches: "
        f"{scoring or 'no tiered cache'}.\n"
    )
    full = next((r for r in rows if r["strategy"] == "all on device"), None)
    if full is not None:
        text += (
            "\nWhat each strategy buys and costs here (the seed's decision guide, measured):\n\n"
        )
        for r in rows:
            if "delta_ppl_pct" not in r or r is full:
                continue
            saved = 1 - r["device_bytes"] / full["device_bytes"]
            less = f"{saved:.0%} less" if saved >= 0 else f"{-saved:.0%} more (staging buffer)"
            text += (
                f"- **{r['strategy']}**: {less} device KV than all on device, "
                f"{r['tok_per_s'] / full['tok_per_s']:.2f}x its decode speed, ΔPPL "
                f"{_signed(r['delta_ppl_pct'])}.\n"
            )
    return text


def _residual(d: dict[str, Any]) -> str:
    return f"{d['residual_tokens']}-token " if d.get("residual_tokens") else ""


def resident(d: dict[str, Any]) -> str:
    rows = [
        [
            r["variant"] if r["codec"] is None else " = ".join(r["codecs"]),
            ", ".join(f"{a['codec']} {a['fraction']:.0%}" for a in r["asked"]) or "–",
            _pct(r["device_fraction"]),
            f"{r['tok_per_s']:.1f}",
            f"{100 * r['spread']:.0f} %",
            _mib(r["device_bytes"]),
            "yes" if r["tokens_identical"] else "no",
        ]
        for r in d["rows"]
    ]
    return (
        _table(
            [
                "host codec",
                "asked (codec, device share)",
                "blocks on device",
                "decode tok/s",
                "spread",
                "device KV",
                "tokens = DynamicCache's",
            ],
            rows,
        )
        + "\n\nLossy codecs change tokens by design; lossless rows must match.\n"
    )


def _device(r: dict[str, Any]) -> str:
    staging = r["held"].get("staging", 0)
    return _mib(r["device_bytes"]) + (f" ({_mib(staging)} staging)" if staging else "")


def context(d: dict[str, Any]) -> str:
    labels = list(dict.fromkeys(r["variant"] for r in d["rows"]))
    by = {(r["variant"], r["context"]): r for r in d["rows"]}
    header = ["context"] + [f"{lab}: device KV" for lab in labels]
    header += [f"{lab}: ms/step" for lab in labels]
    rows = [
        [c]
        + [_device(by[(lab, c)]) for lab in labels]
        + [f"{1e3 * by[(lab, c)]['step_s']:.2f}" for lab in labels]
        for c in d["contexts"]
    ]
    text = _table(header, rows) + f"\n\nK/V: {d['kv']}."
    if any(r["held"].get("staging") for r in d["rows"]):
        text += (
            " The staging buffer is where a cache decodes lossy host blocks for the "
            "attention: one layer's K and V for up to 2 x max_tokens tokens, capped at "
            "CacheConfig.staging_tokens."
        )
    return text + "\n"


def block_size(d: dict[str, Any]) -> str:
    sweep = d["sweep"]
    tiers = [k for k in sweep[0] if isinstance(sweep[0][k], dict)]
    header = ["block tokens", "block bytes"] + [f"{t} µs / GB/s" for t in tiers]
    rows = [
        [r["block_size"], format_bytes(r["block_bytes"])]
        + [f"{r[t]['latency_us']:.0f} / {r[t]['gb_per_s']:.2f}" for t in tiers]
        for r in sweep
    ]
    text = _table(header, rows)
    tp = d["throughput"]
    tp_rows = []
    for tier in (k for k in tp if isinstance(tp[k], dict)):
        g = tp[tier]["gb_per_s"]
        tp_rows.append(
            [
                tier,
                f"{g['tier write']:.2f}",
                f"{g['raw write']:.2f}",
                f"{g['tier read']:.2f}",
                f"{g['raw read']:.2f}",
            ]
        )
    text += (
        f"\n\nTier vs raw copies of the same {format_bytes(tp['bytes'])} ({tp['blocks']} blocks of "
        f"{tp['block_size']} tokens; host: tensor `copy_`, disk: pwrite/preadv of one file), "
        "GB/s:\n\n"
    )
    text += _table(["tier", "tier write", "raw write", "tier read", "raw read"], tp_rows)
    return text + "\n"


def codecs(d: dict[str, Any]) -> str:
    rows = [
        [
            r["codec"],
            f"{r['bits']:.3f}",
            f"{100 * r['attn_rel_err']:.2f} %",
            "n/a" if r["delta_ppl_pct"] is None else _signed(r["delta_ppl_pct"]),
            _pct(r["top1_agreement"]),
            f"{r['enc']:.2f}",
            f"{r['dec']:.2f}",
            f"{r['copy']:.2f}",
        ]
        for r in d["rows"]
    ]
    text = _table(
        [
            "codec",
            "bits/element",
            "attention error",
            PPL_LABEL,
            "top-1 agreement",
            "encode GB/s",
            "decode GB/s",
            "copy_ GB/s",
        ],
        rows,
    )
    text += f"\n\nExact PPL of the embedded model on the window: {d['exact_ppl']:.3f}."
    reads = [
        f"{r['codec']} {r['ppl_lower_tier_predictions']}"
        for r in d["rows"]
        if r.get("ppl_lower_tier_predictions") is not None
    ]
    if reads and d.get("ppl_predictions"):
        text += (
            f" Scored predictions (of {d['ppl_predictions']}) that read host blocks back: "
            f"{', '.join(reads)}."
        )
    text += "".join(
        f" No ΔPPL for {r['codec']}: {r['ppl_unavailable']}."
        for r in d["rows"]
        if r["ppl_unavailable"]
    )
    return text + "\n"


def serving(prefix: dict[str, Any] | None, serve: dict[str, Any] | None) -> str:
    text = ""
    if prefix is not None:
        rows = [
            [
                v["variant"],
                f"{v['ttft_ms']:.1f}",
                f"{100 * v['spread']:.0f} %",
                ", ".join(f"{t}={n}" for t, n in v["hit_tokens_by_tier"].items()) or "–",
                "yes" if v["tokens_identical"] else "no",
            ]
            for v in prefix["variants"]
        ]
        text += _table(
            [
                "prefix cache",
                "TTFT ms",
                "spread",
                "hit tokens per tier",
                "first token = DynamicCache's",
            ],
            rows,
        )
        r = prefix["ratios"]
        text += (
            f"\n\ncold / warm {r['cold/warm']:.1f}x, empty disk / restart "
            f"{r['cold_disk/restart']:.1f}x. Command: `{prefix['command']}` (alone: "
            f"`{prefix['bench_command']}`)\n\n"
        )
    if serve is not None:
        rows = [
            [
                name,
                f"{v['tokens_per_s']:.1f}",
                f"{v['median_s']:.2f}",
                {True: "yes", False: "no"}.get(v.get("exact_vs_baseline"), "reference"),
            ]
            for name, v in serve["variants"].items()
        ]
        text += _table(["engine variant", "output tok/s", "median s", "tokens = generate's"], rows)
        ratios = ", ".join(f"{k} {v:.2f}x" for k, v in serve["ratios"].items())
        text += f"\n\n{ratios}. Command: `{serve['command']}` (alone: `{serve['bench_command']}`)\n"
    return text


RENDERERS = {
    "strategy": strategy,
    "resident": resident,
    "context": context,
    "block_size": block_size,
    "codecs": codecs,
    "compression": compression.render,
    "planner": predicted.render,
}


def _header(report: dict[str, Any]) -> str:
    """Which command(s) measured the report: a run of some sections merged into an
    earlier report names every run."""
    runs = report.get("runs") or [
        {"command": report["command"], "date": report["date"], "seconds": report["seconds"]}
    ]
    first, later = runs[0], runs[1:]
    text = (
        f"Measured by `{first['command']}` ({report['scale']} scale) on {first['date']}, "
        f"{first['seconds'] / 60:.1f} minutes"
    )
    for run in later:
        again = ", ".join(run["sections"]) or "no section"
        text += (
            f"; then {again} measured again by `{run['command']}` on "
            f"{run['date']}, {run['seconds'] / 60:.1f} minutes"
        )
        if run.get("failed"):
            text += f" ({', '.join(run['failed'])} failed there; earlier data of it stays)"
    what = "these runs (the machine table is the last one's)" if later else "this run"
    return text + f". Every number and figure below comes from {what}; "


def _failed(name: str, data: dict[str, Any]) -> str:
    return f"section failed: {data['error']}\n\nCommand: `{data['command']}`\n"


def render(report: dict[str, Any], captions: dict[str, tuple[str, str]]) -> str:
    """The whole report.md.

    Args:
        report: the run's JSON data.
        captions: section -> (figure file, caption) of the figures drawn.
    """
    sections = report["sections"]
    text = (
        "# kvstrata evidence report\n\n"
        + _header(report)
        + "the raw data is [report.json](report.json). Compared variants ran interleaved "
        "(round-robin, one warm-up round) and the tables quote medians. On a machine without "
        "a GPU the device tier is host RAM: device bytes are what a GPU would hold, speeds "
        "are CPU speeds.\n\n"
    )
    text += machine(report)
    number = 0
    for name, title in SECTION_TITLES.items():
        if name == "serving":
            if "prefix" not in sections and "serve" not in sections:
                continue
        elif name not in sections:
            continue
        number += 1
        text += f"\n## {number}. {title}\n\n"
        if name in captions:
            file, caption = captions[name]
            data = sections.get(name) or sections.get("prefix") or sections.get("serve")
            if name == "serving":
                text += f"![{title}]({file})\n\n*Figure {number}.* {caption}\n"
            else:
                text += _figure(name, file, caption, number, data)
            text += "\n"
        if name == "serving":
            ok = {}
            for part in ("prefix", "serve"):
                data = sections.get(part)
                if data is not None and "error" in data:
                    text += f"{part}: " + _failed(part, data) + "\n"
                else:
                    ok[part] = data
            text += serving(ok.get("prefix"), ok.get("serve"))
        elif "error" in sections[name]:
            text += _failed(name, sections[name])
        else:
            text += RENDERERS[name](sections[name])
    return text
