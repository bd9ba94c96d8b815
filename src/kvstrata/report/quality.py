"""The strategy table (the seeds' comparison of offloading strategies) and the codec
section (bits per element vs attention error, ΔPPL and speed).

Strategy: on the real model when it is installed (the embedded one otherwise), each
strategy is a TieredCache placement (`kvstrata.model.budgets.placement`, as `kvstrata eval`
builds them). Decode speed and bytes come from `kvstrata bench decode`'s method
(`time_variants`: exact prefill replayed into fresh caches, greedy steps timed, all
strategies round-robin, medians); ΔPPL and top-1 agreement as `kvstrata.quality.evaluate.compare`
computes them (teacher-forced, one token per forward, `kvstrata.quality.evaluate.perplexity`), each
cache watched for how many scored predictions attended over blocks in a lower tier; greedy
agreement from `kvstrata.quality.agreement.greedy_agreement`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from kvstrata.core.errors import ConfigError
from kvstrata.report.session import Session

# label, codec of the lower tiers, offloaded, with a disk tier
STRATEGIES: tuple[tuple[str, str, bool, bool], ...] = (
    ("all on device", "none", False, False),
    ("offload to host", "none", True, False),
    ("offload + int8", "int8", True, False),
    ("offload + int4", "int4", True, False),
    ("offload + int4 + disk", "int4", True, True),
)
DYNAMIC = "DynamicCache (transformers)"
SINK_TOKENS = 4  # kvstrata.model.budgets.placement's default sinks


def load(session: Session) -> tuple[Any, Any]:
    """The quality sections' model (fp32, sdpa) and tokenizer, with the session's threads."""
    import torch

    from kvstrata.workload.zoo import load_model, quiet_transformers

    quiet_transformers()
    torch.set_num_threads(session.threads)
    model, tokenizer = load_model(session.model)
    model.set_attn_implementation("sdpa")
    return model, tokenizer


def geometry_of(model: Any) -> dict[str, Any]:
    """The planner's view of a model as JSON: its KV geometry with the dtype it runs in
    and the parameters it really has (every decode step reads them)."""
    from kvstrata.model.geometry import KVGeometry, dtype_name

    dtype = dtype_name(next(model.parameters()).dtype)
    geometry = KVGeometry.from_hf_config(model.config)
    params = sum(p.numel() for p in model.parameters())
    return dataclasses.asdict(dataclasses.replace(geometry, dtype=dtype, num_params=params))


def _text(session: Session, tokenizer: Any, tokens: int, count: int) -> tuple[list, Any]:
    """Held-out windows and the bytes-of-text function of `kvstrata eval ppl`."""
    from kvstrata.quality.evaluate import heldout_windows
    from kvstrata.workload.zoo import is_byte_tokenizer

    byte_level = is_byte_tokenizer(tokenizer)
    windows = heldout_windows(
        session.model, tokens, count, tokenizer=None if byte_level else tokenizer
    )

    def bytes_of(ids: list[int]) -> int:
        return len(tokenizer.decode(ids, skip_special_tokens=True).encode())

    return windows, None if byte_level else bytes_of


def exact_span(block_size: int, residual_tokens: int, sink_tokens: int = SINK_TOKENS) -> int:
    """Tokens a placement's cache still holds exactly on the device whatever the codec:
    the sinks' and the residual window's blocks, which a lossy placement keeps on the
    device at least. Predictions up to here see no lossy block, so ΔPPL loses nothing
    when they are scored from one prefill forward."""
    return block_size * (-(-residual_tokens // block_size) + -(-sink_tokens // block_size))


class _LowerTierWatch:
    """A cache factory for `kvstrata.quality.evaluate.perplexity` that watches its caches: after
    each forward (the progress callback) it notes whether a lower tier (host or disk)
    holds blocks, so the next forward — one scored prediction — reads them back."""

    def __init__(self, make: Any) -> None:
        self._make = make
        self._cache: Any = None
        self._held = False
        self.predictions = 0  # scored predictions that attended over lower-tier blocks
        self.device_share = 1.0  # the last cache's share of blocks on the device

    def make(self, tokens: int) -> Any:
        self._cache, self._held = self._make(tokens), False
        return self._cache

    def after_forward(self, _forwards: int) -> None:
        self.predictions += self._held
        stats = self._cache.stats()
        if not stats.get("initialized"):
            return
        used = {name: t["used_blocks"] for name, t in stats["tiers"].items()}
        self._held = any(n for name, n in used.items() if name != "device")
        total = sum(used.values())
        self.device_share = used.get("device", 0) / total if total else 1.0


def score(
    model: Any,
    windows: list,
    configs: dict[str, dict[str, Any]],
    *,
    prefill: int,
    bytes_of: Any,
) -> tuple[Any, dict[str, dict[str, Any]]]:
    """ΔPPL and top-1 agreement of every TieredCache configuration against the exact
    cache (DynamicCache), as `kvstrata.quality.evaluate.compare` computes them, window-major.

    Returns:
        The exact run's `PplResult` and, per configuration, delta_ppl_pct,
        top1_agreement, predictions, lower_tier_predictions (scored predictions whose
        forward read blocks back from the host or disk tier: 0 means every prediction
        saw only exact device blocks) and device_fraction (blocks on the device at the
        end of the last window).
    """
    from kvstrata.quality.evaluate import (
        REFERENCE_ATTENTION,
        PplResult,
        exact_cache_factory,
        perplexity,
        tiered_cache_factory,
        top1_agreement,
    )

    exact = PplResult(0.0, 0, 0, [])
    results = {name: PplResult(0.0, 0, 0, []) for name in configs}
    watches = {
        name: _LowerTierWatch(tiered_cache_factory(model, **kw)) for name, kw in configs.items()
    }
    for window in windows:
        n = len(window)
        res = perplexity(
            model, window, exact_cache_factory(model), n, prefill=prefill, bytes_of=bytes_of
        )
        exact = exact.merged(res)
        for name, watch in watches.items():
            res = perplexity(
                model,
                window,
                watch.make,
                n,
                prefill=prefill,
                bytes_of=bytes_of,
                progress=watch.after_forward,
            )
            results[name] = results[name].merged(res)
    model.set_attn_implementation(REFERENCE_ATTENTION)  # as compare() leaves it
    scored = {
        name: {
            "delta_ppl_pct": 100.0 * (res.ppl / exact.ppl - 1.0),
            "top1_agreement": top1_agreement(exact.argmax_ids, res.argmax_ids),
            "predictions": res.num_tokens,
            "lower_tier_predictions": watches[name].predictions,
            "device_fraction": watches[name].device_share,
        }
        for name, res in results.items()
    }
    return exact, scored


def strategy_configs(
    model: Any, session: Session, context: int, disk_dir: Path
) -> dict[str, dict[str, Any]]:
    """Strategy label -> CacheConfig fields for a `context`-token sequence."""
    from kvstrata.model.budgets import placement

    scale = session.scale
    return {
        label: placement(
            model,
            context,
            codec=codec,
            resident=scale.resident if offload else 1.0,
            block_size=scale.block_size,
            residual_tokens=scale.residual_tokens,
            sink_tokens=SINK_TOKENS,
            disk_dir=str(disk_dir) if disk else None,
        )
        for label, codec, offload, disk in STRATEGIES
    }


def strategy(session: Session) -> dict[str, Any]:
    """Measure the strategy table: speed and bytes, ΔPPL, greedy agreement."""
    from transformers import DynamicCache

    from kvstrata.bench import _timing
    from kvstrata.bench.decode import Variant, kvstrata_twin, prefill, time_variants
    from kvstrata.quality.agreement import greedy_agreement
    from kvstrata.quality.evaluate import tiered_cache_factory
    from kvstrata.report.predicted import case

    scale = session.scale
    model, tokenizer = load(session)
    twin = kvstrata_twin(model)
    ctx, steps = scale.strategy_context, scale.strategy_steps
    pre = {ctx: prefill(model, ctx, seed=1)}
    configs = strategy_configs(model, session, ctx + steps, session.workdir / "decode")
    variants = [
        Variant("dynamic", DYNAMIC, ctx, model, lambda: DynamicCache(config=model.config), [])
    ]
    for i, (label, kwargs) in enumerate(configs.items()):
        make = tiered_cache_factory(twin, **kwargs)
        variants.append(Variant(f"s{i}", label, ctx, twin, lambda m=make: m(ctx + steps), []))
    times, warning = time_variants(variants, pre, steps, scale.repeats, session.threads)
    session.tick("strategy: decode speed")

    windows, bytes_of = _text(session, tokenizer, scale.ppl_window, scale.ppl_windows)
    ppl_configs = strategy_configs(model, session, scale.ppl_window, session.workdir / "ppl")
    exact_tokens = min(exact_span(scale.block_size, scale.residual_tokens), scale.ppl_window - 1)
    exact, ppl = score(model, windows, ppl_configs, prefill=exact_tokens, bytes_of=bytes_of)
    session.tick("strategy: ΔPPL")

    prompts, _ = _text(session, tokenizer, scale.greedy_prompt_tokens, scale.greedy_prompts)
    new = scale.greedy_new
    greedy_configs = strategy_configs(
        model, session, scale.greedy_prompt_tokens + new, session.workdir / "greedy"
    )
    greedy = greedy_agreement(model, prompts, greedy_configs, new)
    session.tick("strategy: greedy agreement")

    geometry = geometry_of(model)
    reference = variants[0].results[0].tokens
    asked = {label: scale.resident if offload else 1.0 for label, _, offload, _ in STRATEGIES}
    rows, cases = [], []
    for v in variants:
        med = _timing.median(times[v.key])
        held = v.held or {}
        row: dict[str, Any] = {
            "strategy": v.label,
            "tok_per_s": steps / med,
            "step_s": med / steps,
            "spread": _timing.spread(times[v.key]),
            "device_bytes": held.get("device", 0) + held.get("staging", 0),
            "stored_bytes": sum(b for tier, b in held.items() if tier != "staging"),
            "held": held,
            "device_fraction": _device_fraction(v.stats),
            "decode_tokens_identical": all(r.tokens.equal(reference) for r in v.results),
        }
        if v.label in configs:
            kwargs = configs[v.label]
            res = ppl[v.label]
            agree = greedy.rows[v.label]
            row.update(
                lower_codec=kwargs.get("host_codec", "none"),
                disk=kwargs.get("disk_dir") is not None,
                delta_ppl_pct=res["delta_ppl_pct"],
                top1_agreement=res["top1_agreement"],
                ppl_lower_tier_predictions=res["lower_tier_predictions"],
                ppl_device_fraction=res["device_fraction"],
                greedy_agreement=agree.agreement,
                greedy_identical=f"{agree.identical_runs}/{len(agree.identical)}",
            )
        kwargs = configs.get(v.label)
        cases.append(
            case("strategy", v.label, geometry, v, kwargs, med / steps, asked.get(v.label, 1.0))
        )
        rows.append(row)
    return {
        "model": session.model,
        "model_note": session.model_note,
        "geometry": geometry,
        "context": ctx,
        "steps": steps,
        "repeats": scale.repeats,
        "block_size": scale.block_size,
        "residual_tokens": scale.residual_tokens,
        "sink_tokens": SINK_TOKENS,
        "resident": scale.resident,
        "ppl": {
            "window": scale.ppl_window,
            "windows": scale.ppl_windows,
            "prefill": exact_tokens,
            "exact_ppl": exact.ppl,
            "predictions": exact.num_tokens,
        },
        "greedy": {
            "prompts": scale.greedy_prompts,
            "prompt_tokens": scale.greedy_prompt_tokens,
            "new": new,
        },
        "rows": rows,
        "cases": cases,
        "load_warning": warning,
        "command": session.section_command("strategy"),
    }


def _device_fraction(stats: dict[str, Any] | None) -> float:
    """Share of a cache's used blocks on the device (1.0 for a cache without tiers)."""
    if not stats or not stats.get("initialized"):
        return 1.0
    used = {name: t["used_blocks"] for name, t in stats["tiers"].items()}
    total = sum(used.values())
    return used.get("device", 0) / total if total else 1.0


def codecs(session: Session) -> dict[str, Any]:
    """Per codec: bits per element, encode / decode GB/s vs copy_ and the attention error
    of `kvstrata bench codecs`; ΔPPL and top-1 agreement with the codec on the host tier
    (the scale's device share, raised to the placement floor) on the embedded model."""
    import torch

    from kvstrata.bench.codecs import bench_codec
    from kvstrata.model.budgets import placement
    from kvstrata.model.geometry import dtype_name
    from kvstrata.workload.zoo import load_model

    scale = session.scale
    torch.set_num_threads(session.threads)
    rows, dtype = [], torch.float16
    for name in scale.codecs:
        rows.append(bench_codec(name, dtype, scale.codec_size_mib, scale.repeats))
        session.tick(f"codecs: {name} speed and error")
    model, _ = load_model("tiny")
    model.set_attn_implementation("sdpa")
    window = scale.codec_ppl_window
    windows, bytes_of = _text(
        dataclasses.replace(session, model="tiny"), _byte_tokenizer(), window, 1
    )
    configs, unusable = {}, {}
    for name in scale.codecs:
        try:  # e.g. int4-g128 groups values by 128 channels: not on a 64-wide head
            block_size = _block_size_for(model, name, scale.block_size)
        except ConfigError as exc:
            unusable[name] = str(exc)
            continue
        configs[name] = placement(
            model,
            window,
            codec=name,
            resident=scale.resident,
            block_size=block_size,
            residual_tokens=scale.residual_tokens,
            sink_tokens=SINK_TOKENS,
        )
    prefill = min(exact_span(scale.block_size, scale.residual_tokens), window - 1)
    exact, ppl = score(model, windows, configs, prefill=prefill, bytes_of=bytes_of)
    session.tick("codecs: ΔPPL")
    for row in rows:
        res = ppl.get(row["codec"], {})
        row["delta_ppl_pct"] = res.get("delta_ppl_pct")
        row["top1_agreement"] = res.get("top1_agreement")
        row["ppl_lower_tier_predictions"] = res.get("lower_tier_predictions")
        row["ppl_device_fraction"] = res.get("device_fraction")
        row["ppl_unavailable"] = unusable.get(row["codec"])
    return {
        "dtype": dtype_name(dtype),
        "size_mib": scale.codec_size_mib,
        "repeats": scale.repeats,
        "ppl_model": "tiny",
        "ppl_window": window,
        "ppl_prefill": prefill,
        "ppl_predictions": exact.num_tokens,
        "exact_ppl": exact.ppl,
        "resident": scale.resident,
        "rows": rows,
        "command": session.section_command("codecs"),
    }


def _block_size_for(model: Any, codec: str, block_size: int) -> int:
    """The smallest multiple of `block_size` (up to 4x) that `codec` accepts on this
    model's blocks (int4-g128 needs whole 128-token groups).

    Raises:
        ConfigError: the codec does not fit the model at all (the last refusal).
    """
    from kvstrata.codecs.registry import get_codec
    from kvstrata.model.budgets import group_layout

    impl = get_codec(codec)
    error = None
    for size in (block_size, 2 * block_size, 4 * block_size):
        try:
            impl.validate(group_layout(model, size))
        except ConfigError as exc:
            error = exc
            continue
        return size
    assert error is not None
    raise error


def _byte_tokenizer() -> Any:
    from kvstrata.workload.zoo import load_tokenizer

    return load_tokenizer("tiny")
