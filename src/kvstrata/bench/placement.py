"""`kvstrata bench placement`: the store's bookkeeping per decode step vs the model's step.

For each context C, `--sequences` sequences of about C tokens each (lengths staggered
by 8 tokens, so block boundaries do not coincide) live in one KVStore with the
embedded model's geometry: 10 % of the blocks on the device, the rest on the host,
prefix caching on (every full block hashed). A timed decode step is what the store
does for one new token per sequence: `extend` (placement, eviction, table updates),
the per-layer write plan, and `step_done` (content hashes) — no K/V data is
written, so only the manager is measured. Reported: mean manager ms per step over
`--steps` steps (a block boundary every 8 steps on average), against the median
time of one real decode forward of the embedded model over the same batch and
context with transformers' DynamicCache (filled with random K/V, sdpa).

Target: manager / model step <= 5 % at the largest context, and manager time growing
sublinearly with the number of blocks.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from kvstrata.bench import _timing

NAME = "placement"
HELP = "store bookkeeping per decode step (8 sequences) as a fraction of the model's step"

TARGET_FRACTION = 0.05


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--contexts", default="1k,16k,128k", help="tokens per sequence")
    parser.add_argument("--sequences", type=int, default=8, help="sequences decoding at once")
    parser.add_argument("--steps", type=int, default=256, help="timed manager steps")
    parser.add_argument("--repeats", type=int, default=3, help="model forwards timed")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--block-size", type=int, default=64, help="tokens per KV block")
    parser.add_argument("--quick", action="store_true", help="tiny smoke run")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


def manager_step_seconds(model: Any, args: argparse.Namespace, context: int) -> dict[str, Any]:
    """Mean seconds of the store's work per decode step, and the store's size."""
    from kvstrata.attention.writes import write_plan
    from kvstrata.config import CacheConfig
    from kvstrata.model.geometry import KVGeometry
    from kvstrata.store.kvstore import KVStore

    n, bs = args.sequences, args.block_size
    per_token = int(KVGeometry.from_hf_config(model.config).bytes_per_token("fp32"))
    longest = context + 8 * n + args.steps + bs
    config = CacheConfig(
        block_size=bs,
        max_tokens=n * longest,
        resident_fraction=0.1,
        host_budget=n * (longest + bs) * per_token,
    )
    store = KVStore(model.config, config)
    store.build(torch.float32, num_sequences=n)
    gen = torch.Generator().manual_seed(0)
    seq_ids = []
    for i in range(n):
        seq_id, _ = store.add_sequence(lookup=False)
        length = context + 8 * i
        tokens = torch.randint(0, 256, (length,), generator=gen).tolist()
        store.extend([seq_id], length, [tokens])
        store.step_done([seq_id])
        seq_ids.append(seq_id)
    total = 0.0
    new = [[7]] * n
    for _ in range(args.steps):
        t0 = time.perf_counter()
        writes = store.extend(seq_ids, 1, new)
        for group_writes in writes:
            write_plan(store.runtime, group_writes, n)
        store.step_done(seq_ids)
        total += time.perf_counter() - t0
    occupancy = store.manager.occupancy()
    blocks = sum(t["used_blocks"] for t in occupancy.values())
    store.close()
    return {"seconds": total / args.steps, "blocks": blocks}


def model_step_seconds(model: Any, args: argparse.Namespace, context: int) -> float:
    """Median seconds of one decode forward over `sequences` x `context` tokens."""
    from transformers import DynamicCache

    cfg = model.config
    n = args.sequences
    heads = cfg.num_key_value_heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    gen = torch.Generator().manual_seed(1)
    times = []
    for _ in range(args.repeats):
        cache = DynamicCache(config=cfg)
        for layer in range(cfg.num_hidden_layers):
            k = torch.empty((n, heads, context, dim)).uniform_(-1, 1, generator=gen)
            cache.update(k, k.clone(), layer)
        tok = torch.zeros((n, 1), dtype=torch.long)
        with torch.inference_mode():
            t0 = time.perf_counter()
            model(tok, cache=cache, use_cache=True)
            times.append(time.perf_counter() - t0)
        del cache
    return _timing.median(times)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from kvstrata.workload.zoo import load_model

    torch.set_num_threads(args.threads)
    model, _ = load_model("default")
    model.set_attn_implementation("sdpa")
    warning = _timing.load_warning(args.threads)
    rows = []
    for context in args.contexts:
        mgr = manager_step_seconds(model, args, context)
        step = model_step_seconds(model, args, context)
        rows.append(
            {
                "context": context,
                "blocks": mgr["blocks"],
                "manager_ms": 1000 * mgr["seconds"],
                "model_step_ms": 1000 * step,
                "fraction": mgr["seconds"] / step,
            }
        )
    first, last = rows[0], rows[-1]
    growth = (last["manager_ms"] / first["manager_ms"]) / (last["blocks"] / first["blocks"])
    return {
        "scenario": NAME,
        "sequences": args.sequences,
        "steps": args.steps,
        "rows": rows,
        "fraction_at_largest": last["fraction"],
        "growth_vs_blocks": growth,  # < 1: sublinear in the number of blocks
        "target_fraction": TARGET_FRACTION,
        "machine_warning": warning or _timing.load_warning(args.threads),
    }


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and print a table (or JSON)."""
    args = argparse.Namespace(**vars(args))
    if args.quick:
        args.contexts, args.steps, args.repeats, args.sequences = "256,2048", 64, 1, 4
    args.contexts = _timing.parse_contexts(args.contexts)
    _timing.check_positive(args, "sequences", "steps", "repeats", "threads", "block_size")
    report = measure(args)
    if args.json:
        _timing.print_json(report)
        return 0
    rows = [
        (
            r["context"],
            r["blocks"],
            f"{r['manager_ms']:.3f}",
            f"{r['model_step_ms']:.1f}",
            f"{100 * r['fraction']:.2f} %",
        )
        for r in report["rows"]
    ]
    notes = [
        f"manager / model step at the largest context: {100 * report['fraction_at_largest']:.2f} %"
        f" (target <= {100 * TARGET_FRACTION:.0f} %)",
        f"manager time growth / block-count growth: {report['growth_vs_blocks']:.3f} "
        "(< 1 = sublinear)",
    ]
    if report["machine_warning"]:
        notes.append(report["machine_warning"])
    _timing.print_table(
        f"store bookkeeping per decode step, {report['sequences']} sequences",
        ("context", "blocks", "manager ms/step", "model ms/step", "fraction"),
        rows,
        notes,
    )
    return 0
