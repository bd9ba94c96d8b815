"""The compression section: ways of storing or reading fewer KV bytes ("modes"), each
measured on a model's real K/V and shown as its own sub-table.

    delta      delta coding along tokens before byte planes + zstd (`disk_delta`):
               bytes per token raw / byte-plane zstd / delta + zstd, whether it pays
               and what it costs, per dtype/codec and kind (`kvstrata.bench.delta`)
    calibrated low-rank keys and important heads (`lowrank-r<R>`, `heads<PCT>`) after a
               calibration pass: bytes per token, ΔPPL, top-1 and KL against the exact
               model (`kvstrata.bench.lowrank_heads`)
    selection  query-aware key selection (`attention_budget`) vs full attention over
               the same placement: ΔPPL, top-1, keys and bytes read, decode and
               attention time (`kvstrata.bench.selection`)

The section's data is {"modes": {mode: its sub-table}, "load_warning", "command"}; a
mode adds itself to MODES (title, measuring function, renderer, progress steps), and
report.md renders the sub-tables of MODES that the data holds, in MODES' order. The
module imports nothing heavy at the top: markdown.py imports it for the renderers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstrata.report.scale import Scale
from kvstrata.report.session import Session
from kvstrata.report.tables import table

NAME = "compression"


@dataclass(frozen=True)
class Mode:
    """One sub-table of the section.

    Fields:
        title: its heading in report.md.
        measure: the session -> the sub-table's data (JSON-able).
        render: the sub-table's data -> its Markdown (from the data alone).
        ticks: the scale -> progress steps `measure` reports (`session.tick`).
    """

    title: str
    measure: Callable[[Session], dict[str, Any]]
    render: Callable[[dict[str, Any]], str]
    ticks: Callable[[Scale], int]


def section(session: Session) -> dict[str, Any]:
    """Measure every mode (`kvstrata bench report --sections compression`)."""
    from kvstrata.bench._timing import load_warning

    modes = {name: mode.measure(session) for name, mode in MODES.items()}
    return {
        "modes": modes,
        "load_warning": load_warning(session.threads),
        "command": session.section_command(NAME),
    }


def ticks(scale: Scale) -> int:
    return sum(mode.ticks(scale) for mode in MODES.values())


def render(d: dict[str, Any]) -> str:
    """Every known mode's sub-table that `d` holds, in MODES' order (absent ones skipped)."""
    parts = [
        f"### {mode.title}\n\n{mode.render(d['modes'][name])}"
        for name, mode in MODES.items()
        if name in d["modes"]
    ]
    text = "\n".join(parts) or "No compression mode measured.\n"
    return text + f"\nCommand: `{d['command']}`\n"


# -- delta coding (disk_delta) --------------------------------------------------------------
def _model(session: Session) -> tuple[str, str]:
    """The mode's model and why: the scale's (smoke: the embedded one), else the report's."""
    if session.scale.compression_model is not None:
        return session.scale.compression_model, ""
    return str(session.model), session.model_note


def measure_delta(session: Session) -> dict[str, Any]:
    """`kvstrata.bench.delta.measure` of the variant the disk tier applies (`sub`) at each
    of the scale's contexts, on K/V captured once at the longest (a causal model's K/V of
    a prefix are the same at every length)."""
    import torch

    from kvstrata.bench import delta
    from kvstrata.codecs.compress import DEFAULT_LEVEL

    scale = session.scale
    torch.set_num_threads(session.threads)
    model, note = _model(session)
    contexts = scale.compression_contexts
    kv = delta.capture_kv(model, max(contexts))
    rows: list[dict[str, Any]] = []
    for context in contexts:
        rows += delta.measure(
            model,
            context,
            block_size=scale.block_size,
            variants=(delta.KEPT,),
            level=DEFAULT_LEVEL,
            repeats=scale.compression_repeats,
            kv=kv,
        )
        session.tick(f"compression: delta coding @ {context} tokens")
    return {
        "model": model,
        "model_note": note,
        "contexts": list(contexts),
        "block_size": scale.block_size,
        "level": DEFAULT_LEVEL,
        "repeats": scale.compression_repeats,
        "variant": delta.KEPT,
        "rows": rows,
    }


def _change(r: dict[str, Any]) -> float:
    """Delta + zstd bytes vs byte-plane zstd's: -0.098 is 9.8 % fewer bytes."""
    return r["bytes_per_token_delta"] / r["bytes_per_token_zstd"] - 1


def _span(rows: list[dict[str, Any]]) -> str:
    lo, hi = (f"{100 * f(_change(r) for r in rows):+.1f} %" for f in (min, max))
    return lo if lo == hi else f"{lo} to {hi}"


def render_delta(d: dict[str, Any]) -> str:
    rows = [
        [
            r["context"],
            r["dtype/codec"],
            {"k": "K", "v": "V"}[r["kind"]],
            f"{r['bytes_per_token_raw']:,.0f}",
            f"{r['bytes_per_token_zstd']:,.0f}",
            f"{r['bytes_per_token_delta']:,.0f}",
            f"{100 * _change(r):+.1f} %",
            "yes" if r["pays"] else "no",
            "yes" if r["kept"] else "no",
            f"{r['zstd_encode_ms_per_block']:.2f} → {r['encode_ms_per_block']:.2f}",
            f"{r['zstd_decode_ms_per_block']:.2f} → {r['decode_ms_per_block']:.2f}",
        ]
        for r in d["rows"]
    ]
    text = table(
        [
            "context",
            "dtype/codec",
            "kind",
            "raw B/token",
            "byte-plane zstd B/token",
            "delta + zstd B/token",
            "vs zstd",
            "pays",
            "disk_delta codes it",
            "encode ms/block: zstd → delta",
            "decode ms/block: zstd → delta",
        ],
        rows,
    )
    note = f" ({d['model_note']})" if d["model_note"] else ""
    rounds = f"{d['repeats']} interleaved round{'s' if d['repeats'] != 1 else ''}"
    text += (
        f"\n\nModel: {d['model']}{note}; the K/V (fp32, after RoPE) of one exact forward "
        f"pass over {max(d['contexts'])} tokens of held-out text (a shorter context is its "
        "prefix), cast to each dtype or quantized by each codec, each kind's fields laid "
        f"out as the disk tier lays them out, one frame per block of {d['block_size']} "
        "tokens, layer and kind (the raw bytes kept where a frame would not be smaller); "
        f"zstd level {d['level']}. Delta coding stores each token's row minus the previous "
        "one's (unsigned words of each field's element size) before the byte planes; every "
        f"frame was decoded again and checked bit-exact. Times: medians of {rounds}, one "
        "block = every layer of that kind, on this machine.\n"
    )
    keys = [r for r in d["rows"] if r["kept"]]
    others = [r for r in d["rows"] if not r["kept"]]
    if keys:
        best = min(keys, key=_change)
        text += (
            f"\n`disk_delta` codes the keys only: their compressed bytes change by "
            f"{_span(keys)}, the most saved by {best['dtype/codec']} at {best['context']} tokens "
            f"({100 * _change(best):+.1f} %; encode {best['encode_ms_per_block']:.2f} vs "
            f"{best['zstd_encode_ms_per_block']:.2f} ms, decode {best['decode_ms_per_block']:.2f}"
            f" vs {best['zstd_decode_ms_per_block']:.2f} ms per block)."
        )
    if others:
        paying = sum(r["pays"] for r in others)
        text += f" Values would change by {_span(others)} (smaller in {paying} of {len(others)})."
    return text + "\n"


# -- query-aware key selection (attention_budget) -----------------------------------------
SELECTION_BUDGETS = (0.125, 0.25)


def measure_selection(session: Session) -> dict[str, Any]:
    """`kvstrata.bench.selection.measure` at each of the scale's contexts: full attention
    and budgets of 1/8 and 1/4 of the context, 90 % of the KV on the host tier."""
    import torch

    from kvstrata.bench import selection

    scale = session.scale
    torch.set_num_threads(session.threads)
    model, note = _model(session)
    runs = []
    for context in scale.compression_contexts:
        runs.append(
            selection.measure(
                model,
                context,
                list(SELECTION_BUDGETS),
                scored=min(64, context // 8),
                block_size=scale.block_size,
            )
        )
        session.tick(f"compression: key selection @ {context} tokens")
    return {"model": model, "model_note": note, "runs": runs}


def render_selection(d: dict[str, Any]) -> str:
    rows = [
        [
            run["context"],
            r["config"],
            f"{r['delta_ppl_pct']:+.2f} %",
            f"{r['top1_agreement']:.1%}",
            f"{r['attended_share']:.1%}",
            f"{(r['kv_bytes_per_step'] + r['summary_bytes_per_step']) / 2**20:.2f}",
            f"{r['decode_ms']:.1f}",
            f"{r['attention_ms']:.1f}",
            f"{r['decode_speedup']:.2f}×",
            f"{r['attention_speedup']:.2f}×" if r["attention_speedup"] else "-",
        ]
        for run in d["runs"]
        for r in run["rows"]
    ]
    text = table(
        [
            "context",
            "config",
            "ΔPPL",
            "top-1 agree",
            "keys attended",
            "KV read MiB/step",
            "decode ms",
            "attention ms",
            "decode vs full",
            "attention vs full",
        ],
        rows,
    )
    note = f" ({d['model_note']})" if d["model_note"] else ""
    run = d["runs"][0]
    return text + (
        f"\n\nModel: {d['model']}{note}, fp32, {run['resident']:.0%} of the KV on the device "
        "and the rest on the host tier. Per context, one window of held-out text: all but "
        f"the last {run['scored']} tokens prefilled, those decoded one at a time "
        "(teacher-forced), full attention and each budget interleaved step by step; ΔPPL "
        "and top-1 agreement over the decoded tokens against full attention over the same "
        f"placement. Budgets are shares of the context; page summaries: {run['summary']} "
        f"of {run.get('page', '?')}-key pages, a KV head scoring a page by its query heads' "
        f"{run.get('score', '?')}, each query row over its {run.get('channels', '?')} "
        "largest-|q| channels (0: all; the summary values read are in the KV read). Lossy: "
        "the default stays exact attention.\n"
    )


# -- calibrated codecs: low-rank keys, important heads --------------------------------------
CALIBRATED = {  # (mode, setting) rows of bench.lowrank_heads' sweep the report keeps
    ("first", "int8"),
    ("first", "int4"),
    ("lowrank-post", "lowrank-r16"),
    ("lowrank-post", "lowrank-r32"),
    ("lowrank-post", "lowrank-r48"),
    ("lowrank-post", "lowrank-r32-int8"),
    ("lowrank-pre", "lowrank-pre-r16"),
    ("lowrank-pre", "lowrank-pre-r32"),
    ("lowrank-pre", "lowrank-pre-r28-int8"),
    ("lowrank-pre", "lowrank-pre-r29-int8"),
    ("lowrank-pre-true", "lowrank-pre-r29-int8"),
    ("heads", "heads33-int8-int4 by damage"),
    ("heads", "heads33-int8-int4 random"),
}
LOWRANK_MODES = ("lowrank-pre", "lowrank-post")  # the registered low-rank codecs


def lowrank_verdict(rows: list[dict[str, Any]]) -> str:
    """Which registered low-rank setting has >= 2x fewer key bytes than int8 at ΔPPL <= 1 %
    (issue #27's target), the fewest key bytes first; or the closest ones when none."""
    int8 = next((r for r in rows if r["setting"] == "int8"), None)
    lowrank = [r for r in rows if r["mode"] in LOWRANK_MODES]
    if int8 is None or not lowrank:
        return "No low-rank row was measured here (the model's calibration has none)."

    def say(r: dict[str, Any]) -> str:
        ratio = int8["key_bytes_per_token"] / r["key_bytes_per_token"]
        dppl = r["delta_ppl_pct"]
        return f"`{r['setting']}` ({ratio:.2f}x fewer key bytes than int8, ΔPPL {dppl:+.2f} %)"

    meets = [
        r
        for r in lowrank
        if 2 * r["key_bytes_per_token"] <= int8["key_bytes_per_token"] and r["delta_ppl_pct"] <= 1.0
    ]
    if meets:
        best = min(meets, key=lambda r: r["key_bytes_per_token"])
        return f"Chosen rank: {say(best)} meets >= 2x fewer key bytes than int8 at ΔPPL <= 1 %."
    small = [r for r in lowrank if 2 * r["key_bytes_per_token"] <= int8["key_bytes_per_token"]]
    good = [r for r in lowrank if r["delta_ppl_pct"] <= 1.0]
    parts = []
    if small:
        parts.append(
            "at >= 2x fewer bytes the best is " + say(min(small, key=lambda r: r["delta_ppl_pct"]))
        )
    if good:
        parts.append(
            "at ΔPPL <= 1 % the smallest is "
            + say(min(good, key=lambda r: r["key_bytes_per_token"]))
        )
    return (
        "No low-rank setting meets both >= 2x fewer key bytes than int8 and ΔPPL <= 1 %: "
        + ("; ".join(parts) or "none comes near")
        + "."
    )


def measure_calibrated(session: Session) -> dict[str, Any]:
    """Calibrate the model (`kvstrata calibrate`, into a temporary file), then
    `kvstrata.bench.lowrank_heads.measure` of the CALIBRATED settings on one held-out
    window at the scale's first context."""
    import tempfile

    import torch

    from kvstrata.bench import lowrank_heads
    from kvstrata.quality.calibrate import check_calibration, write_calibration
    from kvstrata.quality.evaluate import heldout_windows
    from kvstrata.workload.zoo import load_model

    scale = session.scale
    torch.set_num_threads(session.threads)
    name, note = _model(session)
    model, tokenizer = load_model(name)
    context = scale.compression_contexts[0]
    with tempfile.TemporaryDirectory(prefix="kvstrata-calibration-") as tmp:
        path = f"{tmp}/calibration.safetensors"
        write_calibration(
            model,
            tokenizer,
            path,
            model_name=name,
            tokens=2 * context,
            context=context,
            block_size=scale.block_size,
        )
        cal = check_calibration(model, path)
    from kvstrata.workload.zoo import is_byte_tokenizer

    byte_level = is_byte_tokenizer(tokenizer)
    windows = heldout_windows(name, context, 1, tokenizer=None if byte_level else tokenizer)
    rows = lowrank_heads.measure(
        model,
        windows,
        cal,
        context=context,
        block_size=scale.block_size,
        only=lambda mode, setting: (mode, setting) in CALIBRATED,
    )
    session.tick(f"compression: calibrated codecs @ {context} tokens")
    return {"model": name, "model_note": note, "context": context, "rows": rows}


def render_calibrated(d: dict[str, Any]) -> str:
    rows = [
        [
            r["mode"],
            r["setting"],
            f"{r['key_bytes_per_token']:,.0f}",
            f"{r['value_bytes_per_token']:,.0f}",
            f"{r['delta_ppl_pct']:+.2f} %",
            f"{r['top1_agreement']:.1%}",
            f"{r['kl_nats_per_token']:.1e}",
        ]
        for r in d["rows"]
    ]
    text = table(
        ["mode", "setting", "key B/token", "value B/token", "ΔPPL", "top-1 agree", "KL nats/token"],
        rows,
    )
    note = f" ({d['model_note']})" if d["model_note"] else ""
    return text + (
        f"\n\nModel: {d['model']}{note}, one held-out window of {d['context']} tokens, "
        "calibrated on other text (`kvstrata calibrate`). `lowrank-post` is the codec on "
        "post-RoPE keys; `lowrank-pre` the codec on pre-RoPE keys, each block's start found "
        "from its keys (a codec is not told positions); `lowrank-pre-true` the same "
        "projection given the true positions (the bound on what finding them can reach); "
        "`heads` keeps a third "
        "of each layer's KV heads in int8 and the rest in int4, chosen by calibration "
        "(damage) or at random (the control at equal bytes). ΔPPL, top-1 and KL against "
        "the exact model from a one-forward simulation of the tiered cache "
        "(`kvstrata.quality.kvsim`: every block but the sinks and the residual window "
        "decoded), not from a token-by-token run.\n\n" + lowrank_verdict(d["rows"]) + "\n"
    )


MODES: dict[str, Mode] = {
    "delta": Mode(
        title="Delta coding along tokens before byte planes + zstd (`disk_delta`)",
        measure=measure_delta,
        render=render_delta,
        ticks=lambda scale: len(scale.compression_contexts),
    ),
    "calibrated": Mode(
        title="Low-rank keys and important heads (calibrated codecs; lossy)",
        measure=measure_calibrated,
        render=render_calibrated,
        ticks=lambda scale: 1,
    ),
    "selection": Mode(
        title="Query-aware key selection (`attention_budget`, Quest-style; lossy)",
        measure=measure_selection,
        render=render_selection,
        ticks=lambda scale: len(scale.compression_contexts),
    ),
}
