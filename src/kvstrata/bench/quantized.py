"""`kvstrata bench quantized`: kvstrata int4 host tier vs transformers' QuantizedCache.

Same model and method as `kvstrata bench decode` (exact prefill once, K/V replayed
into each fresh cache through `Cache.update`, only the decode loop timed), at two
contexts, three variants each:
  exact           DynamicCache + sdpa: the baseline and the reference logits
  kvstrata-int4   TieredCache, host_codec="int4" (g64), residual_tokens=128, a device
                  budget of just the residual window + sinks + one open block; the
                  rest of the context lives int4 on the host tier
  hf-quanto       transformers QuantizedCache(backend="quanto", nbits=4,
                  q_group_size=64, residual_length=128), needs the `quanto` extra
                  (optimum-quanto); hqq is tried next; when no backend imports, a
                  row says why and the rest still runs
Decoding is teacher-forced on the exact run's greedy tokens, so every variant sees
the same inputs; error = relative L2 error of each step's logits vs exact (final
step and mean), and top-1 agreement over the steps. Target: kvstrata int4 faster
than QuantizedCache at the long context.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

from kvstrata.bench import _timing
from kvstrata.bench.decode import (
    Decoded,
    decode,
    kv_bytes_per_token,
    kvstrata_twin,
    prefill,
    tiny_llama,
)
from kvstrata.bench.decode import replay as replay_kv

NAME = "quantized"
HELP = "kvstrata int4 host tier vs transformers QuantizedCache: tok/s and logits error"

BACKENDS = ("quanto", "hqq")


def quantized_cache_factory(
    config: Any, residual: int, group: int, backends: tuple[str, ...] = BACKENDS
) -> tuple[Callable[[], Any] | None, str]:
    """The first transformers QuantizedCache backend that works here.

    Args:
        config: the model config.
        residual: residual_length (full-precision newest tokens).
        group: q_group_size.
        backends: backends to try, in order.

    Returns:
        (factory, backend name) or (None, the reason none works).
    """
    try:
        from transformers.cache_utils import QuantizedCache
    except ImportError as exc:  # pragma: no cover - transformers without it
        return None, f"transformers has no QuantizedCache ({exc})"
    reasons = []
    for backend in backends:
        kwargs = dict(nbits=4, q_group_size=group, residual_length=residual)
        try:
            QuantizedCache(backend, config, **kwargs)
        except (ImportError, ValueError, RuntimeError) as exc:
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            reasons.append(f"{backend}: {first_line}")
            continue
        return (lambda b=backend, kw=kwargs: QuantizedCache(b, config, **kw)), backend
    reasons.append("install the extra: pip install 'kvstrata[quanto]'")
    return None, "; ".join(reasons)


def _errors(result: Decoded, exact: Decoded) -> dict[str, float]:
    diff = (result.logits - exact.logits).norm(dim=-1) / exact.logits.norm(dim=-1)
    return {
        "logits_rel_err_final": float(diff[-1]),
        "logits_rel_err_mean": float(diff.mean()),
        "top1_agreement": float((result.tokens == exact.tokens).float().mean()),
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run the comparison; returns the report (see module docstring)."""
    from transformers import DynamicCache

    from kvstrata.core.layout import BlockLayout
    from kvstrata.integrations.hf.cache import TieredCache

    torch.set_num_threads(args.threads)
    sdpa = tiny_llama(args.layers, args.seed, initializer_range=args.init_range)
    tiered = kvstrata_twin(sdpa)
    cfg = sdpa.config
    bs = args.block_size
    layout = BlockLayout(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, bs)
    sinks = 4
    # The smallest device budget TieredCache accepts with a lossy tier below: the
    # residual window + sinks + one open block.
    dev_blocks = 1 + -(-args.residual // bs) + -(-sinks // bs)
    label = f"kvstrata-{args.codec}"
    quant_factory, backend = quantized_cache_factory(cfg, args.residual, args.group)

    fns: dict[str, Callable[[], float]] = {}
    runs: dict[str, list[Decoded]] = {}
    meta: dict[str, dict[str, Any]] = {}
    for ctx in args.contexts:
        pre = prefill(sdpa, ctx, args.seed + 1)
        max_tokens = ctx + args.steps + bs
        variants = {
            "exact": (sdpa, lambda: DynamicCache(config=cfg)),
            label: (
                tiered,
                lambda max_tokens=max_tokens: TieredCache(
                    cfg,
                    block_size=bs,
                    max_tokens=max_tokens,
                    host_codec=args.codec,
                    residual_tokens=args.residual,
                    sink_tokens=sinks,
                    device_budget=dev_blocks * layout.raw_block_bytes,
                    host_budget=kv_bytes_per_token(sdpa) * (max_tokens + 2 * bs),
                ),
            ),
        }
        if quant_factory is not None:
            variants[f"hf-{backend}"] = (sdpa, quant_factory)
        for name, (model, make) in variants.items():
            key = f"{name}@{ctx}"
            runs[key] = []
            meta[key] = {"variant": name, "context": ctx}

            def once(key=key, model=model, make=make, pre=pre) -> float:
                # Teacher-forced on the exact run's tokens (the first exact call is
                # greedy and defines them; forcing its own tokens changes nothing).
                exact_runs = runs[f"exact@{pre.context}"]
                forced = exact_runs[0].tokens if exact_runs else None
                cache = replay_kv(make(), pre)
                result = decode(model, cache, pre.first_token, args.steps, forced)
                runs[key].append(result)
                return result.seconds

            fns[key] = once

    times, warning = _timing.timed_with_load_check(fns, args.repeats, args.threads)

    rows = []
    for key, secs in times.items():
        ctx = meta[key]["context"]
        exact = runs[f"exact@{ctx}"][0]
        row = {
            **meta[key],
            "tok_per_s": args.steps / _timing.median(secs),
            "spread": _timing.spread(secs),
            **_errors(runs[key][-1], exact),
        }
        rows.append(row)
    tps = {(r["variant"], r["context"]): r["tok_per_s"] for r in rows}
    ratios: dict[str, float | None] = {}
    for ctx in args.contexts:
        ours, exact = tps[(label, ctx)], tps[("exact", ctx)]
        q = tps.get((f"hf-{backend}", ctx)) if quant_factory else None
        ratios[f"kvstrata_vs_exact@{ctx}"] = ours / exact
        ratios[f"quantized_vs_exact@{ctx}"] = q / exact if q else None
        ratios[f"kvstrata_vs_quantized@{ctx}"] = ours / q if q else None
    return {
        "scenario": NAME,
        "method": (
            "exact prefill once, K/V replayed into each fresh cache via Cache.update "
            "(untimed); timed: single-token model.forward loop, teacher-forced on the "
            "exact greedy tokens"
        ),
        "model": {
            "layers": args.layers,
            "dtype": "fp32",
            "threads": args.threads,
            "initializer_range": args.init_range,
        },
        "contexts": list(args.contexts),
        "steps": args.steps,
        "repeats": args.repeats,
        "kvstrata": {
            "host_codec": args.codec,
            "residual_tokens": args.residual,
            "device_blocks": dev_blocks,
            "block_size": bs,
        },
        "quantized_cache": {
            "backend": backend if quant_factory else None,
            "available": quant_factory is not None,
            "unavailable_reason": None if quant_factory else backend,
            "nbits": 4,
            "q_group_size": args.group,
            "residual_length": args.residual,
        },
        "variants": rows,
        "ratios": ratios,
        "load_warning": warning,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _timing.add_decode_arguments(
        parser,
        init_range=0.02,
        init_help="model initializer_range (0.02: logits of realistic scale; 0.3 makes "
        "the random model's attention so peaky that any int4 cache flips half the tokens)",
    )
    parser.add_argument("--codec", default="int4", help="kvstrata host codec (int4 = g64)")
    parser.add_argument("--residual", type=int, default=128, help="full-precision newest tokens")
    parser.add_argument("--group", type=int, default=64, help="QuantizedCache q_group_size")


def _resolve(args: argparse.Namespace) -> argparse.Namespace:
    return _timing.resolve_decode_args(
        args, "384,640", extra_positive=("residual", "group"), residual=64
    )


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and print a table (or JSON)."""
    args = _resolve(args)
    report = measure(args)
    if args.json:
        _timing.print_json(report)
        return 0
    rows = [
        (
            r["variant"],
            str(r["context"]),
            f"{r['tok_per_s']:.1f}",
            f"{100 * r['spread']:.0f} %",
            f"{r['logits_rel_err_final']:.2e}",
            f"{r['logits_rel_err_mean']:.2e}",
            f"{100 * r['top1_agreement']:.1f} %",
        )
        for r in report["variants"]
    ]
    qc = report["quantized_cache"]
    if not qc["available"]:
        rows.append(("QuantizedCache: unavailable", "-", "-", "-", "-", "-", "-"))
    notes = []
    if not qc["available"]:
        notes.append(f"QuantizedCache backend unavailable: {qc['unavailable_reason']}")
    for ctx in args.contexts:
        r = report["ratios"]
        line = f"@ {ctx}: kvstrata {args.codec} / exact {r[f'kvstrata_vs_exact@{ctx}']:.3f}x"
        if r[f"kvstrata_vs_quantized@{ctx}"] is not None:
            line += (
                f", QuantizedCache / exact {r[f'quantized_vs_exact@{ctx}']:.3f}x, "
                f"kvstrata {args.codec} / QuantizedCache {r[f'kvstrata_vs_quantized@{ctx}']:.3f}x"
            )
        notes.append(line)
    notes.append("target: kvstrata int4 / QuantizedCache > 1 at the long context")
    notes.append(f"method: {report['method']}")
    if report["load_warning"]:
        notes.append(f"[yellow]warning: {report['load_warning']}[/yellow]")
    _timing.print_table(
        f"int4 KV: kvstrata host tier vs QuantizedCache ({qc['backend'] or 'unavailable'}), "
        f"{args.layers}-layer Llama fp32, {args.steps} steps x {args.repeats} repeats (medians)",
        ("variant", "context", "tok/s", "spread", "logit err last", "logit err mean", "top-1"),
        rows,
        notes,
    )
    return 0
