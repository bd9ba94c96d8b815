"""`kvstrata bench prefix`: time to first token with a cached prompt prefix vs cold.

Model: the embedded byte-level model (fp32), `--threads` torch threads. The prompt
is `--prefix` tokens of real text (stdlib sources) followed by `--suffix` new ones;
each call runs `generate(max_new_tokens=1)` through a TieredCache over a KVStore.

Variants, interleaved with rotation (one warm-up round, `--repeats` rounds, medians):
  cold     a fresh store: the whole prompt is prefilled
  warm     one store shared by the calls (device + host tiers): the prefix blocks a
           first request left cached are found in memory, only the suffix is run
  restart  every call opens a *new* store on a disk directory an earlier process
           filled (index reopened, hit verified by checksums): a restarted server
  cold_disk  the restart configuration with an empty disk (its own baseline)
Each call's first token must equal DynamicCache's; hit tokens per tier are reported.
Targets: cold / warm >= 5x, cold_disk / restart >= 3x (DESIGN: ratios, not times).
Disk reads after a restart come from the page cache unless the OS dropped it.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvstrata.bench import _timing

NAME = "prefix"
HELP = "time to first token: cached prompt prefix (in process, after a restart) vs cold"

TARGET_WARM = 5.0
TARGET_RESTART = 3.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefix", default="4096", help="cached prefix tokens")
    parser.add_argument("--suffix", type=int, default=32, help="new tokens after the prefix")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved timed rounds")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--block-size", type=int, default=64, help="tokens per KV block")
    parser.add_argument("--dir", default=None, help="disk tier directory (default: a temp dir)")
    parser.add_argument("--quick", action="store_true", help="tiny smoke run (512 tokens)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


def _prompt(tokenizer: Any, num_tokens: int) -> torch.Tensor:
    """`num_tokens` tokens of real text: the embedded model's held-out stdlib files."""
    from kvstrata.workload.zoo import heldout_files

    text = ""
    for path in heldout_files("default"):
        text += path.read_text(errors="replace")
        ids = tokenizer(text, verbose=False)["input_ids"]
        if len(ids) >= num_tokens:
            return torch.tensor([ids[:num_tokens]])
    ids = tokenizer(text, verbose=False)["input_ids"] or [0]
    return torch.tensor([(ids * (num_tokens // len(ids) + 1))[:num_tokens]])


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import DynamicCache

    from kvstrata.config import CacheConfig
    from kvstrata.core.units import parse_tokens
    from kvstrata.integrations.hf import TieredCache, enable
    from kvstrata.store.kvstore import KVStore
    from kvstrata.workload.zoo import load_model

    torch.set_num_threads(args.threads)
    prefix = parse_tokens(args.prefix, "prefix")
    model, tokenizer = load_model("default")
    prompt = _prompt(tokenizer, prefix + args.suffix)
    # an earlier request: the same prefix, another suffix
    first = torch.cat([prompt[:, :prefix], (prompt[:, prefix:] + 1) % 256], dim=1)
    model.set_attn_implementation("sdpa")
    ref = model.generate(prompt, cache=DynamicCache(config=model.config), max_new_tokens=1)
    enable(model)
    bs = args.block_size
    memory = CacheConfig(block_size=bs, max_tokens=2 * (prefix + args.suffix + bs))
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="kvstrata-prefix-"))
    disk_budget = 4 * memory.max_tokens * _token_bytes(model)
    on_disk = memory.replace(
        resident_fraction=0.1,
        host_budget=memory.max_tokens * _token_bytes(model) // 4,
        disk_dir=str(root / "filled"),
        disk_budget=disk_budget,
    )
    empty_disk = on_disk.replace(disk_dir=str(root / "empty"))
    hits: dict[str, dict[str, int]] = {}
    tokens_ok: dict[str, bool] = {}

    def run(name: str, store: Any) -> float:
        before = dict(store.prefix.hit_tokens_by_tier)
        t0 = time.perf_counter()
        # the prefix lookup (and disk verification) counts
        cache = TieredCache.from_store(store, prompt)
        out = model.generate(prompt, cache=cache, max_new_tokens=1)
        seconds = time.perf_counter() - t0
        tokens_ok[name] = tokens_ok.get(name, True) and torch.equal(out, ref)
        after = store.prefix.hit_tokens_by_tier
        hits[name] = {t: n - before.get(t, 0) for t, n in after.items() if n > before.get(t, 0)}
        cache.close()
        return seconds

    shared = KVStore(model.config, memory.replace(host_budget=disk_budget))
    warmup = TieredCache.from_store(shared, first)
    model.generate(first, cache=warmup, max_new_tokens=1)
    warmup.close()
    with KVStore(model.config, on_disk) as filler:  # the process before the restart
        cache = TieredCache.from_store(filler, first)
        model.generate(first, cache=cache, max_new_tokens=1)

    def timed_store(name: str, config: Any, clear: Path | None = None) -> float:
        """A new store, run, close. With a disk tier, opening it (tiers, index) is
        counted: that is what a restarted server pays; a memory-only store is built
        untimed (a running server has its arenas)."""
        if clear is not None:
            shutil.rmtree(clear, ignore_errors=True)
        t0 = time.perf_counter()
        store = KVStore(model.config, config)
        store.build(torch.float32)
        opened = time.perf_counter() - t0 if config.disk_dir else 0.0
        try:
            return opened + run(name, store)
        finally:
            store.close()

    fns = {
        "cold": lambda: timed_store("cold", memory),
        "warm": lambda: run("warm", shared),
        "restart": lambda: timed_store("restart", on_disk),
        "cold_disk": lambda: timed_store("cold_disk", empty_disk, clear=root / "empty"),
    }
    times, warning = _timing.timed_with_load_check(fns, args.repeats, args.threads)
    shared.close()
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    med = {name: _timing.median(t) for name, t in times.items()}
    ratios = {
        "cold/warm": med["cold"] / med["warm"],
        "cold_disk/restart": med["cold_disk"] / med["restart"],
    }
    return {
        "scenario": NAME,
        "prefix_tokens": prefix,
        "suffix_tokens": args.suffix,
        "threads": args.threads,
        "variants": [
            {
                "variant": name,
                "ttft_ms": 1000 * med[name],
                "spread": _timing.spread(times[name]),
                "hit_tokens_by_tier": hits.get(name, {}),
                "tokens_identical": tokens_ok.get(name, False),
            }
            for name in fns
        ],
        "ratios": ratios,
        "targets": {"cold/warm": TARGET_WARM, "cold_disk/restart": TARGET_RESTART},
        "machine_warning": warning,
    }


def _token_bytes(model: Any) -> int:
    from kvstrata.model.geometry import KVGeometry

    geometry = KVGeometry.from_hf_config(model.config)
    return int(geometry.bytes_per_token("fp32"))


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; exit 1 if a variant's token differs from DynamicCache's."""
    if args.quick:
        args = argparse.Namespace(**vars(args))
        args.prefix, args.suffix, args.repeats = "512", 16, 2
    _timing.check_positive(args, "suffix", "repeats", "threads", "block_size")
    report = measure(args)
    if args.json:
        _timing.print_json(report)
    else:
        rows = [
            (
                v["variant"],
                f"{v['ttft_ms']:.1f}",
                f"{100 * v['spread']:.0f} %",
                ", ".join(f"{t}={n}" for t, n in v["hit_tokens_by_tier"].items()) or "-",
                "✓" if v["tokens_identical"] else "✗",
            )
            for v in report["variants"]
        ]
        r, t = report["ratios"], report["targets"]
        notes = [
            f"cold / warm = {r['cold/warm']:.2f}x (target >= {t['cold/warm']}x)",
            f"cold_disk / restart = {r['cold_disk/restart']:.2f}x "
            f"(target >= {t['cold_disk/restart']}x)",
        ]
        if report["machine_warning"]:
            notes.append(report["machine_warning"])
        _timing.print_table(
            f"time to first token, {report['prefix_tokens']}-token cached prefix + "
            f"{report['suffix_tokens']} new tokens (medians)",
            ("variant", "TTFT ms", "spread", "hit tokens per tier", "tokens"),
            rows,
            notes,
        )
    return 0 if all(v["tokens_identical"] for v in report["variants"]) else 1
