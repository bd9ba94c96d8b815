"""Two decode sweeps on `kvstrata bench decode`'s model and method (`time_variants`: the
K/V replayed into a fresh cache per call, only the greedy decode loop timed, every
variant round-robin, medians):

  resident  device share 1-100 % -> decode tok/s, one line per lower-tier codec
  context   1k-32k tokens -> device KV bytes (DynamicCache grows, a TieredCache with
            a fixed device share stays flat) and the decode step time
"""

from __future__ import annotations

import json
from typing import Any

from kvstrata.report.session import Session

DYNAMIC = "DynamicCache"
# The context sweep's caches: label -> codec of the host tier
CONTEXT_CACHES = {"TieredCache, host fp32": "none", "TieredCache, host int4": "int4"}


def _model(session: Session, max_tokens: int) -> tuple[Any, Any]:
    """`kvstrata bench decode`'s 4-layer Llama (sdpa) and its kvstrata twin."""
    import torch

    from kvstrata.bench.decode import kvstrata_twin, tiny_llama

    torch.set_num_threads(session.threads)
    sdpa = tiny_llama(4, seed=0, initializer_range=0.3, max_positions=max_tokens + 1)
    return sdpa, kvstrata_twin(sdpa)


def _describe(model: Any) -> tuple[str, str]:
    """The sweeps' model in words, and its dtype ("fp32")."""
    from kvstrata.model.geometry import dtype_name

    cfg = model.config
    dtype = dtype_name(next(model.parameters()).dtype)
    return (
        f"bench decode's {cfg.num_hidden_layers}-layer Llama (hidden {cfg.hidden_size}, "
        f"{cfg.num_key_value_heads} KV heads x {cfg.head_dim}, {dtype}, random init)"
    ), dtype


def _tiered(model: Any, kwargs: dict[str, Any]) -> Any:
    from kvstrata.integrations.hf.cache import TieredCache

    return TieredCache(model.config, **kwargs)


def _row(v: Any, times: list[float], steps: int) -> dict[str, Any]:
    from kvstrata.bench import _timing

    med = _timing.median(times)
    held = v.held or {}
    return {
        "variant": v.label,
        "context": v.context,
        "tok_per_s": steps / med,
        "step_s": med / steps,
        "spread": _timing.spread(times),
        "device_bytes": held.get("device", 0) + held.get("staging", 0),
        "stored_bytes": sum(b for tier, b in held.items() if tier != "staging"),
        "held": held,
        "device_fraction": 1.0 - (v.host_fraction or 0.0),
    }


def resident(session: Session) -> dict[str, Any]:
    """Decode tok/s at each device share and lower-tier codec (plus DynamicCache)."""
    from transformers import DynamicCache

    from kvstrata.bench.decode import Variant, prefill, time_variants
    from kvstrata.model.budgets import placement

    scale = session.scale
    ctx, steps, bs = scale.resident_context, scale.decode_steps, scale.block_size
    sdpa, twin = _model(session, ctx + steps + bs)
    variants = [
        Variant("dynamic", DYNAMIC, ctx, sdpa, lambda: DynamicCache(config=sdpa.config), [])
    ]
    # one variant per distinct cache: below a lossy codec's device floor, or with
    # everything on the device, several (codec, fraction) asks build the same cache
    asked: dict[str, list[tuple[str, float]]] = {"dynamic": []}
    seen: dict[str, str] = {}
    for codec in scale.resident_codecs:
        for fraction in scale.resident_fractions:
            kwargs = placement(sdpa, ctx + steps, codec=codec, resident=fraction, block_size=bs)
            signature = json.dumps(kwargs, sort_keys=True)
            if signature in seen:
                asked[seen[signature]].append((codec, fraction))
                continue
            key = seen[signature] = f"{codec}@{fraction:g}"
            asked[key] = [(codec, fraction)]
            variants.append(
                Variant(
                    key,
                    f"{codec} @ {fraction:.0%}",
                    ctx,
                    twin,
                    lambda kw=kwargs: _tiered(sdpa, kw),
                    [],
                )
            )
    pre = {ctx: prefill(sdpa, ctx, seed=1)}
    times, warning = time_variants(variants, pre, steps, scale.repeats, session.threads)
    session.tick("resident: decode sweep")
    reference = variants[0].results[0].tokens
    rows = []
    for v in variants:
        row = _row(v, times[v.key], steps)
        codecs = list(dict.fromkeys(codec for codec, _ in asked[v.key]))
        row.update(
            codec=codecs[0] if codecs else None,
            codecs=codecs,
            asked=[{"codec": c, "fraction": f} for c, f in asked[v.key]],
            tokens_identical=all(r.tokens.equal(reference) for r in v.results),
        )
        rows.append(row)
    model, dtype = _describe(sdpa)
    return {
        "model": model,
        "dtype": dtype,
        "context": ctx,
        "steps": steps,
        "repeats": scale.repeats,
        "block_size": bs,
        "rows": rows,
        "load_warning": warning,
        "command": session.section_command("resident"),
    }


def synthetic_prefill(model: Any, context: int, seed: int = 1) -> Any:
    """A `context`-token prompt's per-layer K/V drawn at random (standard normal) in
    the model's geometry, without running the model: the context sweep measures bytes
    and step time, which do not depend on the values, and an exact prefill of 32k
    tokens is quadratic (tens of seconds per context on 2 cores)."""
    import torch

    from kvstrata.bench.decode import Prefilled

    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    shape = (1, cfg.num_key_value_heads, context, cfg.head_dim)
    kv = [
        (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
        for _ in range(cfg.num_hidden_layers)
    ]
    return Prefilled(context, kv, torch.tensor(3))


def context(session: Session) -> dict[str, Any]:
    """Device KV bytes and step time from 1k to 32k tokens: DynamicCache vs TieredCaches
    that keep the newest `context_resident` tokens on the device."""
    from transformers import DynamicCache

    from kvstrata.bench.decode import Variant, time_variants
    from kvstrata.model.budgets import placement
    from kvstrata.report.predicted import case
    from kvstrata.report.quality import geometry_of

    scale = session.scale
    steps, bs = scale.decode_steps, scale.block_size
    sdpa, twin = _model(session, max(scale.contexts) + steps + bs)
    variants, configs, asked = [], {}, {}

    def dynamic() -> Any:
        return DynamicCache(config=sdpa.config)

    for ctx in scale.contexts:
        variants.append(Variant(f"dynamic@{ctx}", DYNAMIC, ctx, sdpa, dynamic, []))
        share = min(1.0, scale.context_resident / (ctx + steps))
        for label, codec in CONTEXT_CACHES.items():
            kwargs = placement(sdpa, ctx + steps, codec=codec, resident=share, block_size=bs)
            key = f"{codec}@{ctx}"
            configs[key], asked[key] = kwargs, share
            variants.append(Variant(key, label, ctx, twin, lambda kw=kwargs: _tiered(sdpa, kw), []))
    pre = {ctx: synthetic_prefill(sdpa, ctx) for ctx in scale.contexts}
    times, warning = time_variants(variants, pre, steps, scale.repeats, session.threads)
    session.tick("context: device bytes and step time")
    geometry = geometry_of(sdpa)
    rows = [_row(v, times[v.key], steps) for v in variants]
    cases = [
        case(
            "context",
            f"{v.label} @ {v.context}",
            geometry,
            v,
            configs.get(v.key),
            row["step_s"],
            asked.get(v.key, 1.0),
        )
        for v, row in zip(variants, rows, strict=True)
    ]
    return {
        "model": _describe(sdpa)[0],
        "kv": "random K/V replayed into each cache (no prefill: bytes and time do not "
        "depend on the values)",
        "contexts": list(scale.contexts),
        "resident_tokens": scale.context_resident,
        "steps": steps,
        "repeats": scale.repeats,
        "block_size": bs,
        "geometry": geometry,
        "rows": rows,
        "cases": cases,
        "load_warning": warning,
        "command": session.section_command("context"),
    }
