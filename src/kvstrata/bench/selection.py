"""`kvstrata bench selection`: query-aware key selection (`attention_budget`, lossy) against
full attention over the same placement (by default 90 % of the KV on the host tier).

Model: `--model` (smollm2 when installed, else the embedded one), fp32. Per window of
`--context` tokens of held-out text, the first context - `--scored` tokens are
prefilled, the last `--scored` decoded one at a time, teacher-forced, through one
TieredCache per configuration — full attention and each `--budget` — the
configurations interleaved step by step (so machine load hits them alike).

Per configuration, over the decoded tokens:
  ΔPPL % and top-1 agreement   against full attention over the same placement
  attended                     share of the (key, KV head) pairs full attention reads
  KV read / step               K and V bytes of the attended keys, all layers, plus the
                               page summaries scored (which live on the compute device);
                               then each as a share of full attention's K and V bytes
  decode ms / step             a whole forward (median over steps)
  attention ms / step          inside the store's attention, all layers (median)
and the ratios to full attention. `--needle` adds passkey retrieval accuracy (depths
10-90 %) at the context for every configuration (`kvstrata.quality.needle`); `--engine N`
adds greedy decoding of N tokens through one Engine that computes the prompt once
(`_selection_engine`): decode and attention ms per token, their ratios to full
attention, and greedy agreement;
`--windows 0` leaves the teacher-forced rows out (speed only). `--positions P` runs the
model with max_position_embeddings raised to P, its weights unchanged: a model of the same
shape with longer positions, for speed at contexts beyond its own (RoPE past its trained
range: its ΔPPL and agreement there say nothing about the model's quality).
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from typing import Any

from kvstrata.bench import _timing

NAME = "selection"
HELP = "query-aware key selection (attention_budget) vs full attention: ΔPPL, bytes, speed"
FULL = "full attention"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="auto", help="auto (smollm2 if installed), or a name")
    parser.add_argument("--context", default="8k", help="tokens per window (default 8k)")
    parser.add_argument("--scored", type=int, default=64, help="decoded tokens per window")
    parser.add_argument(
        "--windows", type=int, default=1, help="held-out windows (0: speed rows only)"
    )
    parser.add_argument(
        "--budget", default="0.125", help="comma-separated attention budgets (tokens or shares)"
    )
    parser.add_argument("--summary", default="minmax", help="page summary: minmax or mean")
    parser.add_argument("--page", type=int, default=None, help="keys per page (config's: 4)")
    parser.add_argument(
        "--score", default=None, help="a page's score for a KV head: max or sum of its heads'"
    )
    parser.add_argument(
        "--coarse",
        type=int,
        default=None,
        help="pages per group summary (0, one level: the default)",
    )
    parser.add_argument(
        "--refine", type=float, default=None, help="groups refined per page chosen (config's: 2)"
    )
    parser.add_argument(
        "--channels", type=int, default=None, help="query channels scored (config's: 16; 0: all)"
    )
    parser.add_argument(
        "--dense-layers", type=int, default=0, help="first layers attending every key"
    )
    parser.add_argument("--resident", type=float, default=0.1, help="device share of the KV")
    parser.add_argument("--disk", action="store_true", help="the cold half of the KV on disk")
    parser.add_argument(
        "--disk-share",
        type=float,
        default=None,
        metavar="F",
        help="this share of the KV on the disk tier, the rest of the cold KV on the host "
        "(e.g. 0.9 with --resident 0.1: none on the host)",
    )
    parser.add_argument(
        "--o-direct",
        action="store_true",
        help="disk reads with O_DIRECT: from the device, not the page cache (KV beyond RAM)",
    )
    parser.add_argument(
        "--prefetch",
        default="off",
        help="comma-separated attention_prefetch policies per budget: off, last, learned, "
        "each with an optional :BYTES attention_prefetch_budget (last:256MiB; the next "
        "step's disk blocks predicted and held: docs/selection.md)",
    )
    parser.add_argument("--needle", action="store_true", help="also passkey retrieval accuracy")
    parser.add_argument(
        "--engine",
        type=int,
        default=0,
        metavar="N",
        help="also decode N tokens greedily through the Engine, per configuration",
    )
    parser.add_argument("--repeats", type=int, default=2, help="engine decode repeats")
    parser.add_argument(
        "--positions",
        type=int,
        default=0,
        metavar="P",
        help="raise the model's max_position_embeddings to P (same weights; speed only)",
    )
    parser.add_argument("--block-size", type=int, default=64, help="tokens per KV block")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


def _model_name(name: str) -> str:
    from kvstrata.workload.zoo import model_names

    if name != "auto":
        return name
    try:
        from kvstrata.workload.zoo import resolve_model_dir

        resolve_model_dir("smollm2")
        return "smollm2"
    except Exception:  # noqa: BLE001 - not installed: the embedded model
        return "default" if "default" in model_names() else "tiny"


def measure(
    model_name: str,
    context: int,
    budgets: list[int | float],
    *,
    scored: int = 64,
    windows: int = 1,
    summary: str = "minmax",
    page: int | None = None,
    score: str | None = None,
    coarse: int | None = None,
    refine: float | None = None,
    channels: int | None = None,
    dense_layers: int = 0,
    resident: float = 0.1,
    disk: bool = False,
    disk_share: float | None = None,
    o_direct: bool = False,
    prefetch: tuple[str, ...] = ("off",),
    block_size: int = 64,
    needle: bool = False,
    engine_tokens: int = 0,
    repeats: int = 2,
    positions: int = 0,
    progress: Any = None,
) -> dict[str, Any]:
    """Full attention and each budget over the same placement (see the module docstring).
    Returns {"rows": [...], "model", "context", ...} with one row per configuration."""
    import torch

    from kvstrata.integrations.hf import TieredCache, enable
    from kvstrata.quality.evaluate import heldout_windows
    from kvstrata.workload.zoo import load_model

    model, tokenizer = load_model(model_name)
    enable(model)
    cfg = model.config
    _check_span(cfg, context, windows, positions, engine_tokens or needle)
    from kvstrata.workload.zoo import is_byte_tokenizer

    byte_level = is_byte_tokenizer(tokenizer)
    texts = heldout_windows(model_name, context, max(windows, 1), None if byte_level else tokenizer)
    windowed = texts[:windows]
    configs = [(b, p) for b in budgets for p in prefetch]
    names = [FULL] + [_name(b, p) for b, p in configs]
    from kvstrata.config import CacheConfig

    page = CacheConfig.attention_page if page is None else page
    score = CacheConfig.attention_score if score is None else score
    coarse = CacheConfig.attention_coarse if coarse is None else coarse
    refine = CacheConfig.attention_refine if refine is None else refine
    channels = CacheConfig.attention_channels if channels is None else channels
    fields = {FULL: {}} | {
        n: {
            "attention_budget": b,
            "attention_summary": summary,
            "attention_page": page,
            "attention_score": score,
            "attention_coarse": coarse,
            "attention_refine": refine,
            "attention_channels": channels,
            "attention_dense_layers": dense_layers,
            **_prefetch_fields(p),
        }
        for n, (b, p) in zip(names[1:], configs, strict=True)
    }
    acc = {n: {"nll": 0.0, "top1": 0, "steps": [], "attn": [], "kv": 0, "sum": 0} for n in names}
    heads = cfg.num_key_value_heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_key = 2 * dim * 4  # fp32 K and V of one key in one KV head and layer
    with tempfile.TemporaryDirectory(prefix="kvstrata-selection-") as tmp:
        for w, ids in enumerate(windowed):
            ids = torch.tensor(ids)
            caches, timers = {}, {}
            for i, name in enumerate(names):
                where = f"{tmp}/{w}-{i}" if disk else None
                place = _placement(
                    model, context, resident, block_size, where, disk_share, o_direct
                )
                cache = TieredCache(cfg, **place, **fields[name])
                with torch.inference_mode():
                    model(ids[None, : context - scored], cache=cache, use_cache=True)
                caches[name], timers[name] = cache, _timing.time_attention(cache.store.runtime)[0]
            ref_top = []
            for pos in range(context - scored, context - 1):
                for name in names:
                    timers[name][0] = 0.0
                    t0 = time.perf_counter()
                    with torch.inference_mode():
                        out = model(ids[None, pos : pos + 1], cache=caches[name], use_cache=True)
                    a = acc[name]
                    a["steps"].append(time.perf_counter() - t0)
                    a["attn"].append(timers[name][0])
                    logits = out.logits[0, -1].float()
                    a["nll"] += float(
                        torch.nn.functional.cross_entropy(logits[None], ids[pos + 1 : pos + 2])
                    )
                    top = int(logits.argmax())
                    if name == FULL:
                        ref_top.append(top)
                    a["top1"] += top == ref_top[-1]
                    a["kv"] += (pos + 1) * heads * cfg.num_hidden_layers * per_key
                if progress:
                    progress(1)
            for name in names:
                sel = caches[name].store.runtime.selector
                if sel is not None:  # the layers that selected read only what they chose
                    s, a = sel.stats, acc[name]
                    a["kv"] += (s.keys_attended - s.keys_in_context) * per_key
                    a["sum"] += s.summary_bytes
                    a["pairs"] = a.get("pairs", 0) + s.keys_in_context
                    a["chosen"] = a.get("chosen", 0) + s.keys_attended
                caches[name].close()
    n = windows * (scored - 1)
    full = acc[FULL]
    rows = []
    for name in names if windows else []:
        a = acc[name]
        step, attn = _timing.median(a["steps"]), _timing.median(a["attn"])
        rows.append(
            {
                "config": name,
                "ppl": math.exp(a["nll"] / n),
                "delta_ppl_pct": 100 * (math.exp((a["nll"] - full["nll"]) / n) - 1),
                "top1_agreement": a["top1"] / n,
                "attended_share": a["chosen"] / a["pairs"] if a.get("pairs") else 1.0,
                "kv_bytes_per_step": a["kv"] / n,
                "summary_bytes_per_step": a["sum"] / n,
                "kv_share": a["kv"] / full["kv"],
                "summary_share": a["sum"] / full["kv"],
                "decode_ms": 1000 * step,
                "attention_ms": 1000 * attn,
                "decode_speedup": _timing.median(full["steps"]) / step,
                "attention_speedup": _timing.median(full["attn"]) / attn if attn else None,
            }
        )
    result = {
        "model": model_name,
        "context": context,
        "scored": scored,
        "windows": windows,
        "summary": summary,
        "page": page,
        "score": score,
        "coarse": coarse,
        "refine": refine,
        "channels": channels,
        "dense_layers": dense_layers,
        "resident": resident,
        "disk": disk,
        "disk_share": disk_share,
        "o_direct": o_direct,
        "prefetch": list(prefetch),
        "rows": rows,
        "positions": getattr(cfg, "max_position_embeddings", None),
    }
    if needle:
        result["needle"] = _needle(model, tokenizer, context, fields, resident, block_size)
    if engine_tokens:
        from kvstrata.bench._selection_engine import engine_decode

        prompt = list(texts[0][: context - engine_tokens])
        with tempfile.TemporaryDirectory(prefix="kvstrata-selection-") as tmp:
            where = tmp if disk else None
            place = _placement(model, context, resident, block_size, where, disk_share, o_direct)
            per = {name: {**place, **f} for name, f in fields.items()}
            base = {_name(b, p): _name(b, prefetch[0]) for b, p in configs}
            result["engine"] = engine_decode(
                model, tokenizer, prompt, per, engine_tokens, repeats, progress, base
            )
    return result


def _prefetch_fields(entry: str) -> dict[str, Any]:
    """CacheConfig fields of a --prefetch entry, "policy" or "policy:budget"."""
    policy, _, budget = entry.partition(":")
    out: dict[str, Any] = {"attention_prefetch": policy}
    if budget:
        out["attention_prefetch_budget"] = budget
    return out


def _name(budget: int | float, prefetch: str) -> str:
    return f"budget {budget:g}" + ("" if prefetch == "off" else f" prefetch={prefetch}")


def _placement(
    model: Any,
    context: int,
    resident: float,
    block_size: int,
    disk_dir: str | None,
    disk_share: float | None,
    o_direct: bool,
) -> dict[str, Any]:
    """placement()'s fields, and O_DIRECT on its disk tier."""
    from kvstrata.model.budgets import placement

    place = placement(
        model,
        context,
        resident=resident,
        block_size=block_size,
        disk_dir=disk_dir,
        disk_share=disk_share if disk_dir else None,
    )
    if disk_dir is not None:
        place["disk_o_direct"] = o_direct
    return place


def _check_span(cfg: Any, context: int, windows: int, positions: int, other: Any) -> None:
    """ConfigError unless there is something to measure and the context fits the model's
    positions; `positions` (> 0) raises the model's max_position_embeddings first."""
    from kvstrata.core.errors import ConfigError

    if windows < 0 or (windows == 0 and not other):
        raise ConfigError.field(
            "windows", windows, "at least 1 held-out window, or 0 with --engine N or --needle"
        )
    limit = getattr(cfg, "max_position_embeddings", None)
    if positions:
        if positions < context:
            raise ConfigError.field("positions", positions, f"at least the context ({context})")
        cfg.max_position_embeddings = limit = positions
    if limit is not None and context > limit:
        raise ConfigError.field(
            "context",
            context,
            f"at most the model's max_position_embeddings ({limit}); "
            "--positions P runs it with longer positions (speed only)",
        )


def _needle(model, tokenizer, context, fields, resident, block_size) -> dict[str, float]:
    from kvstrata.model.budgets import placement
    from kvstrata.quality.needle import needle_cases, needle_sweep
    from kvstrata.workload.prompts import uses_chat

    cases = needle_cases(
        tokenizer, [context], [0.1, 0.3, 0.5, 0.7, 0.9], 1, chat=uses_chat(tokenizer)
    )
    configs = {
        name: (
            lambda n, f=f: {**placement(model, n, resident=resident, block_size=block_size), **f}
        )
        for name, f in fields.items()
    }
    report = needle_sweep(model, tokenizer, cases, configs)
    return {name: report.accuracy(name) for name in [*fields, "exact"] if name in report.answers}


def run(args: argparse.Namespace) -> int:
    import torch

    from kvstrata.config import CacheConfig
    from kvstrata.core.units import parse_tokens

    context = parse_tokens(args.context, "context")
    if args.engine == 1 or args.engine < 0:  # a step after the first token is what it times
        from kvstrata.core.errors import ConfigError

        raise ConfigError.field("engine", args.engine, "0 (off) or at least 2 tokens")
    budgets = [
        CacheConfig(attention_budget=v.strip()).attention_budget
        for v in args.budget.split(",")
        if v.strip()
    ]
    chosen = {
        "attention_page": args.page,
        "attention_score": args.score,
        "attention_coarse": args.coarse,
        "attention_refine": args.refine,
        "attention_channels": args.channels,
    }
    CacheConfig(**{k: v for k, v in chosen.items() if v is not None})  # one-line errors first
    prefetch = tuple(p.strip() for p in args.prefetch.split(",") if p.strip()) or ("off",)
    for p in prefetch:
        CacheConfig(**_prefetch_fields(p))
    if args.disk_share is not None and not 0 < args.disk_share < 1:
        from kvstrata.core.errors import ConfigError

        raise ConfigError.field("disk_share", args.disk_share, "a share in (0, 1), e.g. 0.9")
    if (args.disk_share is not None or args.o_direct) and not args.disk:
        from kvstrata.core.errors import ConfigError

        flag = "disk_share" if args.disk_share is not None else "o_direct"
        raise ConfigError.field(flag, getattr(args, flag), "it needs the disk tier: add --disk")
    torch.set_num_threads(args.threads)
    result = measure(
        _model_name(args.model),
        context,
        budgets,
        scored=args.scored,
        windows=args.windows,
        summary=args.summary,
        page=args.page,
        score=args.score,
        coarse=args.coarse,
        refine=args.refine,
        channels=args.channels,
        dense_layers=args.dense_layers,
        resident=args.resident,
        disk=args.disk,
        disk_share=args.disk_share,
        o_direct=args.o_direct,
        prefetch=prefetch,
        block_size=args.block_size,
        needle=args.needle,
        engine_tokens=args.engine,
        repeats=args.repeats,
        positions=args.positions,
    )
    if args.json:
        _timing.print_json(result)
        return 0
    cols = [
        "config",
        "ΔPPL %",
        "top-1",
        "attended",
        "KV read/step",
        "KV + summaries",
        "decode ms",
        "attn ms",
        "decode ×",
        "attn ×",
    ]
    rows = [
        [
            r["config"],
            f"{r['delta_ppl_pct']:+.2f}",
            f"{r['top1_agreement']:.1%}",
            f"{r['attended_share']:.1%}",
            f"{(r['kv_bytes_per_step'] + r['summary_bytes_per_step']) / 2**20:.1f} MiB",
            f"{r['kv_share']:.1%} + {r['summary_share']:.1%}",
            f"{r['decode_ms']:.1f}",
            f"{r['attention_ms']:.1f}",
            f"{r['decode_speedup']:.2f}",
            f"{r['attention_speedup']:.2f}" if r["attention_speedup"] else "-",
        ]
        for r in result["rows"]
    ]
    if rows:
        title = f"Query-aware selection, {result['model']} @ {context} tokens"
        _timing.print_table(title, cols, rows)
    if "needle" in result:
        print("needle accuracy:", {k: f"{v:.0%}" for k, v in result["needle"].items()})
    if "engine" in result:
        from kvstrata.bench._selection_engine import print_engine_rows

        print_engine_rows(result["engine"], args.engine, context)
    return 0
