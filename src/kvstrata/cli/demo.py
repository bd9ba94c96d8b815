"""`kvstrata demo` (what `make demo` runs): plan, generate across tiers, check exactness.

1. a short memory plan for the embedded model;
2. greedy generation from 'def fibonacci(n):' with a TieredCache that keeps a small
   fraction of the KV on the device and the rest on the host, streamed, with the stats;
3. the same generation with transformers' DynamicCache: the tokens must be identical
   (exit 1 otherwise).

Without the embedded model it says so in one line and prints the plan only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvstrata.cli.generate import (
    DEFAULT_PROMPT,
    apply_threads,
    check_positions,
    generate_ids,
    parse_threads,
    prompt_then_stream,
    quiet_transformers,
    render_stats,
)
from kvstrata.errors import ConfigError
from kvstrata.units import format_bytes, parse_tokens

PLAN_GPU = "l4"
PLAN_CONTEXT = 32 * 1024
DEMO_BLOCK_SIZE = 16  # small blocks so a 200-token generation spans many of them
# Plain greedy decoding of the 3M-parameter embedded model falls into a run of spaces
# after 'def fibonacci(n):'; forbidding repeated 16-grams keeps it writing code-like text
# and is still deterministic, so the DynamicCache comparison stays exact.
DEMO_NO_REPEAT_NGRAM = 16


def print_plan(spec: str, name: str) -> None:
    """Print a few-line memory plan of a model (a preset name or a model directory).

    Args:
        spec: What kvstrata.geometry.load_geometry accepts.
        name: The model's name to show.
    """
    from kvstrata.geometry import load_geometry
    from kvstrata.hardware import make_hardware
    from kvstrata.planner import Workload, plan

    result = plan(
        load_geometry(spec), make_hardware(PLAN_GPU), Workload(context_tokens=PLAN_CONTEXT)
    )
    row = next((r for r in result.table if r.context_tokens == PLAN_CONTEXT), None)
    shown = [c for c in ("int8", "int4") if row is not None and c in row.per_request]
    codecs = ""
    if shown:
        codecs = " (" + ", ".join(f"{c} {format_bytes(row.per_request[c])}" for c in shown) + ")"
    print(
        f"plan: {name}: {result.geometry.describe()}, {result.bytes_per_token:,.0f} B/token; "
        f"{PLAN_CONTEXT // 1024}k context = {format_bytes(result.kv_per_request_bytes)} "
        f"per request{codecs}"
    )
    tiers = result.tiers
    if tiers is not None:
        print(
            f"plan: offloaded on {PLAN_GPU}: newest {tiers.resident_tokens} tokens "
            f"({tiers.resident_fraction:.1%}) on the GPU = {format_bytes(tiers.device_bytes)}, "
            f"{format_bytes(tiers.host_bytes)} on the host, block size {result.block_size}"
        )
    reason = (result.reasons_against or result.reasons_for or [""])[0]
    print(f"plan: verdict {result.verdict}" + (f": {reason}" if reason else ""))


def _first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def run_demo(args: argparse.Namespace, model_dir: Path) -> int:
    """Generate across tiers, print stats, compare with DynamicCache. Exit 1 on mismatch."""
    from transformers import DynamicCache

    from kvstrata.budgets import lower_tier_bytes
    from kvstrata.integrations.hf import TieredCache, enable
    from kvstrata.modelzoo import load_model

    quiet_transformers()
    model, tokenizer = load_model(model_dir)
    apply_threads(model, args.threads)
    max_new = parse_tokens(args.max_new_tokens, "max_new_tokens")
    prompt_tokens = len(tokenizer(args.prompt).input_ids)
    check_positions(model, prompt_tokens, max_new, "max_new_tokens")
    max_tokens = prompt_tokens + max_new
    # Device keeps a quarter of the blocks (newest + sinks); the rest is demoted to the host.
    cache = TieredCache(
        model.config,
        block_size=DEMO_BLOCK_SIZE,
        max_tokens=max_tokens,
        resident_fraction=0.25,
        host_budget=lower_tier_bytes(model, "none", max_tokens, DEMO_BLOCK_SIZE),
        staging_tokens=4 * DEMO_BLOCK_SIZE,
    )
    print(
        f"\ngenerate: {max_new} tokens, greedy (no repeated {DEMO_NO_REPEAT_NGRAM}-grams), "
        "25 % of the KV on the device, rest on the host"
    )
    print("-" * 72)
    enable(model)
    streamer = prompt_then_stream(tokenizer, args.prompt)
    tiered = generate_ids(
        model,
        tokenizer,
        args.prompt,
        cache,
        max_new,
        no_repeat_ngram_size=DEMO_NO_REPEAT_NGRAM,
        streamer=streamer,
    )
    print("-" * 72)
    render_stats(cache.stats())

    model.set_attn_implementation("sdpa")
    reference = generate_ids(
        model,
        tokenizer,
        args.prompt,
        DynamicCache(config=model.config),
        max_new,
        no_repeat_ngram_size=DEMO_NO_REPEAT_NGRAM,
    )
    a, b = tiered[0].tolist(), reference[0].tolist()
    if a == b:
        print(f"tokens identical to DynamicCache: yes ({len(a)} tokens)")
        return 0
    at = _first_difference(a, b)
    print(f"tokens identical to DynamicCache: NO (first difference at token {at})")
    return 1


def run(args: argparse.Namespace) -> int:
    """Run `kvstrata demo`."""
    from kvstrata.modelzoo import DEFAULT_MODEL_NAME, default_model_dir

    parse_threads(args.threads)
    parse_tokens(args.max_new_tokens, "max_new_tokens")
    model_dir = Path(args.model) if args.model else default_model_dir()
    has_weights = (model_dir / "model.safetensors").is_file()
    if args.model and not has_weights:
        raise ConfigError.field(
            "model", args.model, "a model directory with config.json and model.safetensors"
        )
    if not has_weights:
        print(
            f"kvstrata demo: the embedded model {DEFAULT_MODEL_NAME} is not installed at "
            f"{model_dir}; showing its memory plan only"
        )
        print_plan(DEFAULT_MODEL_NAME, DEFAULT_MODEL_NAME)
        return 0
    print_plan(str(model_dir), model_dir.name)
    code = run_demo(args, model_dir)
    sys.stdout.flush()
    return code


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `demo` subcommand."""
    p = sub.add_parser(
        "demo",
        help="plan + generate across device and host tiers + exactness check",
        description="Show kvstrata on the embedded model: a memory plan, a generation "
        "with the KV spread over tiers, and a check against DynamicCache.",
    )
    p.add_argument("--model", default=None, help="model directory (default: the embedded one)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help=f"prompt (default {DEFAULT_PROMPT!r})")
    p.add_argument("--max-new-tokens", default="200", help="tokens to generate (default 200)")
    p.add_argument(
        "--threads", default="auto", help="torch threads: N, or auto (1 for small models)"
    )
    p.set_defaults(func=run)
