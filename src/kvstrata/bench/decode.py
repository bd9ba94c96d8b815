"""`kvstrata bench decode`: decode tokens/s of TieredCache vs transformers' DynamicCache.

Model: a 4-layer LlamaForCausalLM (hidden 256, 4 query / 2 KV heads, head_dim 64,
intermediate 688, vocab 259), fp32, seeded random init, `--threads` torch threads.

Method (the same for every variant):
  1. Prefill the prompt once per context with DynamicCache + sdpa; keep each
     layer's K/V and the greedy first token.
  2. Per timed call: a fresh cache, filled by replaying that K/V through
     `cache.update(k, v, layer)` — the very calls a prefill forward makes — untimed.
  3. `--steps` greedy decode steps, one `model.forward` of one token each; only
     this loop is timed. tok/s = steps / loop seconds.
Variants run round-robin (one warm-up round, then `--repeats` rounds); the report
gives medians and two target ratios:
  b/a = TieredCache all-resident / DynamicCache at the short context (target >= 0.95)
  d/c = TieredCache 90 % on host / TieredCache all-resident at the long one (>= 0.85)
Every call's tokens must equal DynamicCache's at the same context; otherwise the
run fails (exit code 1).
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvstrata.bench import _timing

NAME = "decode"
HELP = "decode tok/s: TieredCache (resident / 90 % host) vs DynamicCache, tokens checked"

TARGET_RESIDENT = 0.95  # b/a
TARGET_HOST90 = 0.85  # d/c


@dataclass
class Prefilled:
    """A prompt after one exact prefill: per-layer K/V [1, Hkv, T, D] and the first
    greedy token."""

    context: int
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    first_token: torch.Tensor


@dataclass
class Decoded:
    """What one timed decode loop produced."""

    tokens: torch.Tensor  # [steps] greedy argmax of every step
    logits: torch.Tensor  # [steps, vocab]
    seconds: float


def tiny_llama(
    num_layers: int = 4, seed: int = 0, initializer_range: float = 0.3, max_positions: int = 16384
) -> torch.nn.Module:
    """The benchmark model: Llama geometry of the embedded byte-level model, random init.

    The larger `initializer_range` keeps the random model sensitive to old context
    (DESIGN.md testing notes), so identical tokens mean something.

    Returns:
        An fp32 LlamaForCausalLM in eval mode with sdpa attention.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=259,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=max_positions,
        initializer_range=initializer_range,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def kvstrata_twin(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` (same weights) switched to the "kvstrata" attention."""
    from kvstrata.integrations.hf import enable

    return enable(copy.deepcopy(model))


def prompt_ids(length: int, vocab: int = 259, seed: int = 1, flip: int = 0) -> torch.Tensor:
    """A seeded random prompt [1, length] avoiding the special ids 0-2; `flip` > 0
    changes its first `flip` tokens (to check that the output depends on them)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (1, length), generator=gen)
    ids[0, :flip] = (ids[0, :flip] - 3 + 1) % (vocab - 3) + 3
    return ids


# torch.no_grad, as model.generate uses, not inference_mode: TieredCache's staged path
# fills its staging buffer on transfer worker threads, which do not inherit inference
# mode, and an in-place copy into an inference tensor there raises.
@torch.no_grad()
def prefill(model: torch.nn.Module, context: int, seed: int = 1, flip: int = 0) -> Prefilled:
    """Run the exact prefill (DynamicCache + sdpa) of a `context`-token prompt."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    ids = prompt_ids(context, model.config.vocab_size, seed, flip)
    out = model(input_ids=ids, cache=cache)
    kv = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    return Prefilled(context, kv, out.logits[0, -1].argmax())


@torch.no_grad()
def replay(cache: Any, pre: Prefilled) -> Any:
    """Fill `cache` with the prefilled K/V through `update()`, layer by layer, as a
    prefill forward would. Returns the cache."""
    for layer, (k, v) in enumerate(pre.kv):
        cache.update(k.clone(), v.clone(), layer)
    return cache


@torch.no_grad()
def decode(
    model: torch.nn.Module,
    cache: Any,
    first_token: torch.Tensor,
    steps: int,
    forced: torch.Tensor | None = None,
) -> Decoded:
    """`steps` single-token forwards after the prefill; only this loop is timed.

    Args:
        model: the model (its attention must match the cache).
        cache: a cache holding the prompt.
        first_token: the token fed at the first step.
        steps: decode steps.
        forced: teacher forcing: feed forced[i] after step i instead of the argmax.

    Returns:
        Every step's argmax and logits, and the loop's seconds.
    """
    tok = first_token.view(1, 1)
    tokens, logits = [], []
    start = time.perf_counter()
    for i in range(steps):
        step_logits = model(input_ids=tok, cache=cache).logits[0, -1]
        nxt = step_logits.argmax()
        tokens.append(nxt)
        logits.append(step_logits)
        tok = (forced[i] if forced is not None else nxt).view(1, 1)
    seconds = time.perf_counter() - start
    return Decoded(torch.stack(tokens), torch.stack(logits), seconds)


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """Raw K+V bytes of one token over all layers (fp32)."""
    cfg = model.config
    return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 4


@dataclass
class Variant:
    """One compared configuration: a label, its context, and how to build its cache."""

    key: str
    label: str
    context: int
    model: torch.nn.Module
    make_cache: Callable[[], Any]
    results: list[Decoded]
    host_fraction: float | None = None
    held: dict[str, int] | None = None  # bytes per tier of the last call's cache
    stats: dict[str, Any] | None = None  # the last call's TieredCache.stats()


def _variants(args: argparse.Namespace, sdpa: torch.nn.Module) -> list[Variant]:
    from transformers import DynamicCache

    from kvstrata.integrations.hf.cache import TieredCache

    tiered = kvstrata_twin(sdpa)
    short, long = args.contexts
    bs = args.block_size

    def tiered_cache(ctx: int, **fields: Any) -> Callable[[], Any]:
        max_tokens = ctx + args.steps + bs
        host = kv_bytes_per_token(sdpa) * (max_tokens + 2 * bs)
        if "resident_fraction" not in fields:
            host = 0
        return lambda: TieredCache(
            sdpa.config, block_size=bs, max_tokens=max_tokens, host_budget=host, **fields
        )

    def dynamic() -> Any:
        return DynamicCache(config=sdpa.config)

    host90 = tiered_cache(long, resident_fraction=0.1)
    specs = [
        ("a", f"DynamicCache + sdpa @ {short}", short, sdpa, dynamic),
        ("b", f"TieredCache resident @ {short}", short, tiered, tiered_cache(short)),
        ("c", f"TieredCache resident @ {long}", long, tiered, tiered_cache(long)),
        ("d", f"TieredCache 90 % host @ {long}", long, tiered, host90),
        ("e", f"DynamicCache + sdpa @ {long}", long, sdpa, dynamic),
    ]
    if not args.no_stage:
        staged = tiered_cache(long, resident_fraction=0.1, cold_attention="stage")
        specs.append(("f", f"TieredCache 90 % host, staged @ {long}", long, tiered, staged))
    return [Variant(k, label, ctx, m, make, []) for k, label, ctx, m, make in specs]


def held_bytes(cache: Any) -> dict[str, int]:
    """KV bytes a cache holds: a TieredCache's used blocks x block bytes per tier and
    its device staging buffer ("staging"), a DynamicCache's K/V tensors (all "device").

    Returns:
        tier name -> bytes ("device" first).
    """
    stats = cache.stats() if hasattr(cache, "stats") else None
    if stats is None:
        layers = getattr(cache, "layers", [])
        held = sum(t.nbytes for layer in layers for t in (layer.keys, layer.values))
        return {"device": int(held)}
    if not stats.get("initialized"):
        return {"device": 0}
    held = {name: int(t["used_bytes"]) for name, t in stats["tiers"].items()}
    held["staging"] = int(stats["staging_bytes"])
    return held


def _host_fraction(cache: Any) -> float | None:
    stats = cache.stats() if hasattr(cache, "stats") else None
    if not stats or not stats.get("initialized"):
        return None
    used = {name: t["used_blocks"] for name, t in stats["tiers"].items()}
    total = sum(used.values())
    return used.get("host", 0) / total if total else None


def time_variants(
    variants: list[Variant],
    prefilled: dict[int, Prefilled],
    steps: int,
    repeats: int,
    threads: int,
) -> tuple[dict[str, list[float]], str | None]:
    """Time the decode loop of every variant, round-robin (the method of this module).

    Per call: a fresh cache from `make_cache`, filled by `replay` (untimed), then
    `steps` greedy steps (timed); the result, the cache's host fraction, bytes held
    per tier and stats are kept on the variant; the cache is closed.

    Args:
        variants: the compared configurations (keys unique).
        prefilled: context -> its exact prefill.
        steps: timed decode steps per call.
        repeats: timed rounds, after one warm-up round.
        threads: torch threads (for the machine-load warning).

    Returns:
        (variant key -> the `repeats` measured seconds, the load warning or None).
    """

    def call(v: Variant) -> Callable[[], float]:
        def once() -> float:
            cache = replay(v.make_cache(), prefilled[v.context])
            result = decode(v.model, cache, prefilled[v.context].first_token, steps)
            v.results.append(result)
            v.host_fraction = _host_fraction(cache)
            v.held = held_bytes(cache)
            v.stats = cache.stats() if hasattr(cache, "stats") else None
            if hasattr(cache, "close"):
                cache.close()
            return result.seconds

        return once

    fns = {v.key: call(v) for v in variants}
    return _timing.timed_with_load_check(fns, repeats, threads)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run the decode comparison; returns the report (see module docstring)."""
    from transformers import DynamicCache

    torch.set_num_threads(args.threads)
    sdpa = tiny_llama(args.layers, args.seed, initializer_range=args.init_range)
    pre = {ctx: prefill(sdpa, ctx, args.seed + 1) for ctx in sorted(set(args.contexts))}
    variants = _variants(args, sdpa)
    times, warning = time_variants(variants, pre, args.steps, args.repeats, args.threads)

    reference = {v.context: v.results[0].tokens for v in variants if v.key in ("a", "e")}
    # "Identical tokens" proves nothing if the model ignores old context: decode once
    # more after changing the first block of the prompt, the output must change.
    sensitive = {}
    for ctx, tokens in reference.items():
        flipped = prefill(sdpa, ctx, args.seed + 1, flip=min(32, ctx // 2))
        alt = decode(
            sdpa, replay(DynamicCache(config=sdpa.config), flipped), flipped.first_token, args.steps
        )
        sensitive[ctx] = not torch.equal(alt.tokens, tokens)
    rows = []
    all_identical = True
    for v in variants:
        identical = all(torch.equal(r.tokens, reference[v.context]) for r in v.results)
        all_identical &= identical
        secs = times[v.key]
        rows.append(
            {
                "key": v.key,
                "variant": v.label,
                "context": v.context,
                "tok_per_s": args.steps / _timing.median(secs),
                "spread": _timing.spread(secs),
                "host_fraction": v.host_fraction,
                "tokens_identical": identical,
            }
        )
    tps = {r["key"]: r["tok_per_s"] for r in rows}
    ratios = {
        "resident_vs_dynamic": tps["b"] / tps["a"],
        "host90_vs_resident": tps["d"] / tps["c"],
        "resident_vs_dynamic_long": tps["c"] / tps["e"],
    }
    if "f" in tps:
        ratios["staged_vs_resident"] = tps["f"] / tps["c"]
    return {
        "scenario": NAME,
        "method": (
            "exact prefill once (DynamicCache+sdpa), its K/V replayed into each fresh cache "
            "via Cache.update (untimed); timed: greedy single-token model.forward loop"
        ),
        "model": {
            "layers": args.layers,
            "hidden": 256,
            "heads": 4,
            "kv_heads": 2,
            "head_dim": 64,
            "dtype": "fp32",
            "threads": args.threads,
            "initializer_range": args.init_range,
        },
        "contexts": list(args.contexts),
        "steps": args.steps,
        "repeats": args.repeats,
        "block_size": args.block_size,
        "variants": rows,
        "ratios": ratios,
        "targets": {"resident_vs_dynamic": TARGET_RESIDENT, "host90_vs_resident": TARGET_HOST90},
        "tokens_identical": all_identical,
        "context_sensitive": sensitive,
        "load_warning": warning,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _timing.add_decode_arguments(
        parser,
        init_range=0.3,
        init_help="model initializer_range (0.3 keeps a random model sensitive to old "
        "context, so identical tokens mean something)",
    )
    parser.add_argument("--no-stage", action="store_true", help="skip the staged variant (f)")


def _resolve(args: argparse.Namespace) -> argparse.Namespace:
    return _timing.resolve_decode_args(args, "128,512", count=2, block_size=16)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and print a table (or JSON). Exit 1 if any tokens differ."""
    args = _resolve(args)
    report = measure(args)
    if args.json:
        _timing.print_json(report)
    else:
        r = report["ratios"]
        table_rows = [
            (
                f"({row['key']}) {row['variant']}",
                f"{row['tok_per_s']:.1f}",
                f"{100 * row['spread']:.0f} %",
                "-" if row["host_fraction"] is None else f"{100 * row['host_fraction']:.0f} %",
                "✓" if row["tokens_identical"] else "✗",
            )
            for row in report["variants"]
        ]
        notes = [
            f"b/a resident vs DynamicCache @ {args.contexts[0]}: "
            f"{r['resident_vs_dynamic']:.3f}x (target >= {TARGET_RESIDENT})",
            f"d/c 90 % host vs resident @ {args.contexts[1]}: "
            f"{r['host90_vs_resident']:.3f}x (target >= {TARGET_HOST90})",
            f"c/e resident vs DynamicCache @ {args.contexts[1]}: "
            f"{r['resident_vs_dynamic_long']:.3f}x",
        ]
        if "staged_vs_resident" in r:
            notes.append(f"f/c staged vs resident: {r['staged_vs_resident']:.3f}x")
        notes.append(
            "tokens identical across all variants: "
            + ("✓" if report["tokens_identical"] else "✗ FAILED")
        )
        for ctx, dep in report["context_sensitive"].items():
            notes.append(
                f"reference @ {ctx} changes when the first prompt tokens change: "
                + ("yes (the check is not blind)" if dep else "NO: the identity check is weak")
            )
        notes.append(f"method: {report['method']}")
        if report["load_warning"]:
            notes.append(f"[yellow]warning: {report['load_warning']}[/yellow]")
        _timing.print_table(
            f"decode, {args.layers}-layer Llama fp32, {args.steps} steps x {args.repeats} "
            f"repeats, {args.threads} threads (medians)",
            ("variant", "tok/s", "spread", "on host", "tokens"),
            table_rows,
            notes,
        )
    return 0 if report["tokens_identical"] else 1
