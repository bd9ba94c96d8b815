"""`kvstrata bench selection --engine`: decode speed of query-aware key selection where a
user meets it — the engine's greedy generation (its lean forward and native decode
projections), full attention and each budget over the same placement.

One Engine (with the first configuration's placement and prefix caching) computes the
prompt (the window's first context - `tokens` tokens) once; then each configuration in
turn, per repeat, decodes `tokens` tokens greedily from the cached prompt — its
attention_* fields set on the store between requests (`set_selection`), so every
configuration reads the same blocks where they lie. Reported per configuration: decode
ms per token (median of the gaps between outputs, over repeats), attention ms per decode
step (inside the store's attention, all layers, median), both as ratios to full
attention, the share of decoded tokens equal to full attention's (greedy agreement: the
first token that differs changes every later input, so this is a prefix) and the prompt
tokens the request found cached.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

from kvstrata.bench import _timing


def _one(engine: Any, ids: list[int], tokens: int) -> dict:
    """One greedy decode of `tokens` tokens after prompt `ids` through `engine`."""
    from kvstrata.engine import SamplingParams

    spent, undo = _timing.time_attention(engine.store.runtime)
    outs: list[tuple[float, float, list[int]]] = []
    cached = [0]
    done = threading.Event()

    def on_output(out: Any) -> None:
        outs.append((time.perf_counter(), spent[0], list(out.token_ids)))
        cached[0] = max(cached[0], int(getattr(out, "cached_tokens", 0) or 0))
        if out.finished:
            done.set()

    try:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        engine.submit(ids, params, on_output=on_output, first_output=True)
        done.wait()
    finally:
        undo()
    # outs[0]: the prompt's first token; each later output: the tokens of its steps
    steps = [
        (b[0] - a[0], b[1] - a[1], len(b[2])) for a, b in zip(outs, outs[1:], strict=False) if b[2]
    ]
    return {
        "token_ids": [t for _, _, new in outs for t in new],
        "step_s": [d / n for d, _, n in steps],
        "attention_s": [a / n for _, a, n in steps],
        "cached": cached[0],
    }


def engine_decode(
    model: Any,
    tokenizer: Any,
    ids: list[int],
    configs: dict[str, dict],
    tokens: int = 64,
    repeats: int = 2,
    progress: Any = None,
    same_as: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Rows (config, decode_ms, attention_ms, decode_speedup, attention_speedup,
    agreement, cached_tokens, prefetch, same_as_base) of greedy decoding through one
    Engine; the first config is the baseline. `configs` maps a name to CacheConfig
    fields: every config's must give the first's placement (only the attention_*
    fields may differ). `same_as[name]`: a config whose tokens `name`'s must equal
    (selection with prediction against the same budget without): `same_as_base` is
    the share of its decoded tokens that do, a prefix as `agreement` is. `prefetch`:
    the prediction's counters over the config's runs (None when it read no staged
    tier)."""
    from kvstrata.config import CacheConfig
    from kvstrata.engine import Engine, EngineConfig

    runs: dict[str, list[dict]] = {name: [] for name in configs}
    predicted: dict[str, dict] = {}
    first = next(iter(configs.values()))
    config = EngineConfig(max_num_seqs=1)  # one request: the device holds one open block
    engine = Engine(model, tokenizer, config=config, prefix_caching=True, **first)
    try:
        runtime = engine.store.runtime
        _one(engine, ids, 1)  # the prompt, computed once (then cached)
        for _ in range(repeats):
            for name, fields in configs.items():
                runtime.set_selection(CacheConfig(**fields))
                runs[name].append(_one(engine, ids, tokens))
                if runtime.prefetch is not None and runtime.prefetch.stats.attentions:
                    _add(predicted.setdefault(name, {}), runtime.prefetch.stats.as_dict())
                if progress:
                    progress(1)
    finally:
        engine.shutdown()
    base = next(iter(configs))
    ref = runs[base][0]["token_ids"]

    def med(name: str, key: str) -> float:
        return statistics.median(v for run in runs[name] for v in run[key])

    rows = []
    for name in configs:
        got = runs[name][0]["token_ids"]
        same = _same(got, ref)
        other = (same_as or {}).get(name)
        pf = predicted.get(name)
        if pf:
            pf["hit_rate"] = pf["hits"] / pf["needed"] if pf["needed"] else None
            pf["precision"] = pf["hits"] / pf["predicted"] if pf["predicted"] else None
        step, attn = med(name, "step_s"), med(name, "attention_s")
        rows.append(
            {
                "config": name,
                "decode_ms": 1000 * step,
                "attention_ms": 1000 * attn,
                "decode_speedup": med(base, "step_s") / step,
                "attention_speedup": med(base, "attention_s") / attn if attn else None,
                "agreement": same / max(1, len(ref)),
                "cached_tokens": min(run["cached"] for run in runs[name]),
                "prefetch": pf,
                "same_as_base": (
                    None
                    if other is None or other == name
                    else _same(got, runs[other][0]["token_ids"]) / max(1, len(got))
                ),
            }
        )
    return rows


def _same(got: list[int], ref: list[int]) -> int:
    """How many of `got`'s first tokens equal `ref`'s."""
    return next(
        (i for i, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b),
        min(len(got), len(ref)),
    )


def _add(total: dict, stats: dict) -> None:
    """Sum one run's prediction counters into `total` (rates are recomputed)."""
    for key, value in stats.items():
        if isinstance(value, int | float) and key not in ("hit_rate", "precision"):
            if key in ("held_bytes", "peak_held_bytes"):
                total[key] = max(total.get(key, 0), value)
            else:
                total[key] = total.get(key, 0) + value


def print_engine_rows(rows: list[dict[str, Any]], tokens: int, context: int) -> None:
    """`engine_decode`'s rows as a table."""
    cols = [
        "config",
        "decode ms/token",
        "attn ms/token",
        "decode ×",
        "attn ×",
        "greedy =",
        "= no prediction",
        "hit rate",
        "wasted",
        "prompt cached",
    ]

    def prefetch(r: dict, key: str, fmt: str) -> str:
        pf = r.get("prefetch")
        return "-" if not pf or pf.get(key) is None else format(pf[key], fmt)

    table = [
        [
            r["config"],
            f"{r['decode_ms']:.1f}",
            f"{r['attention_ms']:.1f}",
            f"{r['decode_speedup']:.2f}",
            f"{r['attention_speedup']:.2f}",
            f"{r['agreement']:.0%}",
            "-" if r.get("same_as_base") is None else f"{r['same_as_base']:.0%}",
            prefetch(r, "hit_rate", ".0%"),
            prefetch(r, "wasted_bytes", ",d") + (" B" if r.get("prefetch") else ""),
            str(r["cached_tokens"]),
        ]
        for r in rows
    ]
    title = f"Engine greedy decode, {tokens} tokens after {context - tokens}"
    _timing.print_table(title, cols, table)
