"""`kvstrata bench tiers`: tier throughput vs raw copies, block-size sweep, latency
jitter, and how much of a layer-ahead prefetch hides behind compute.

1. Host tier write/read GB/s next to a raw `copy_` of the same bytes; disk tier
   write/read (and read_layer over all layers) next to a raw pwrite/preadv of one
   file of the same size in the same directory. Variants interleaved, repeated,
   medians; ratios = tier / raw (target >= 0.8x).
   Page cache: by default the files stay in the page cache (both sides alike), so
   "disk" measures the tier's software path. `--cold` times writes through
   fdatasync and evicts the files' pages (posix_fadvise DONTNEED, no root needed)
   before every read, so reads come from the device.
2. Block-size sweep (16..512 tokens): single-block read latency and throughput per
   tier, to show where per-call overhead stops mattering (the knee).
3. Single-block read latency distribution per tier: p50 / p99 / std.
4. Prefetch overlap: per layer, the next layer's blocks load (host tier
   read_layer through a TransferEngine with a PCIe-4 LinkModel, 25 GB/s) while a
   matmul sized to ~1.5x the measured transfer computes; reports the fraction of
   transfer time hidden (1 - stall / transfer, target >= 90 %) and the speedup
   over the same steps run serially. The matmul runs on one thread so the copy
   has the other core (on a GPU the copy is a DMA and needs no core).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kvstrata.attention.transfer import LinkModel, Prefetcher, TransferEngine
from kvstrata.bench._timing import check_positive, median_seconds
from kvstrata.core.layout import BlockLayout
from kvstrata.model.geometry import dtype_name
from kvstrata.tiers.disk import DiskTier
from kvstrata.tiers.memory import HostTier

NAME = "tiers"
HELP = "tier GB/s vs raw copy/file I/O, block-size sweep, latency jitter, prefetch overlap"
SWEEP_BLOCK_SIZES = (16, 32, 64, 128, 256, 512)
_GB = 1e9


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dir", default=None, help="directory for disk files (default: a temp dir)"
    )
    parser.add_argument("--size-mib", type=int, default=128, help="bytes moved per throughput op")
    parser.add_argument("--repeats", type=int, default=9, help="interleaved repeats (medians)")
    parser.add_argument("--samples", type=int, default=200, help="single-block reads per tier")
    parser.add_argument("--cold", action="store_true", help="fdatasync writes, evict before reads")
    parser.add_argument("--compress", action="store_true", help="also time a compressed disk tier")
    parser.add_argument(
        "--o-direct", action="store_true", help="also time an O_DIRECT disk tier (use with --cold)"
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes (tests, smoke runs)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


# -- timing helpers -----------------------------------------------------------------------
def _layout(block_size: int, quick: bool) -> BlockLayout:
    # A 7B-class slice in fp16: 8 layers x 4 KV heads x 128 dims = 16 KiB per token.
    if quick:
        return BlockLayout(2, 2, 64, block_size, torch.float16)
    return BlockLayout(8, 4, 128, block_size, torch.float16)


def _kv(layout: BlockLayout, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    k = torch.randn(layout.raw_shape("k", n), generator=g).to(layout.dtype)
    return k, torch.randn(layout.raw_shape("v", n), generator=g).to(layout.dtype)


# -- 1. throughput vs raw -----------------------------------------------------------------
def bench_throughput(args: argparse.Namespace, workdir: Path) -> dict[str, object]:
    layout = _layout(64, args.quick)
    n = max(2, args.size_mib * 2**20 // layout.raw_block_bytes)
    total = n * layout.raw_block_bytes
    k, v = _kv(layout, n)
    k_out, v_out = torch.empty_like(k), torch.empty_like(v)
    slots = list(range(n))
    results: dict[str, object] = {"bytes": total, "blocks": n, "block_size": 64}

    results["host"] = _host_vs_copy(layout, n, k, v, k_out, v_out, args.repeats)

    # disk tier vs one raw file of the same size in the same directory
    tiers = {"disk": DiskTier(layout, n, workdir / "tier")}
    if args.compress:
        tiers["disk+zstd"] = DiskTier(layout, n, workdir / "tier_zstd", compress=True)
    if args.o_direct:
        tiers["disk O_DIRECT"] = DiskTier(layout, n, workdir / "tier_direct", o_direct=True)
    raw_path = workdir / "raw.bin"
    fd = os.open(raw_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.posix_fallocate(fd, 0, total)
        k_np, v_np = k.view(torch.uint8).numpy(), v.view(torch.uint8).numpy()
        ko_np, vo_np = k_out.view(torch.uint8).numpy(), v_out.view(torch.uint8).numpy()
        kl = torch.empty(layout.num_kv_heads, n * layout.block_size, layout.head_dim, dtype=k.dtype)
        vl = torch.empty_like(kl)

        def raw_write() -> None:
            os.pwrite(fd, k_np, 0)
            os.pwrite(fd, v_np, k_np.nbytes)
            if args.cold:
                os.fdatasync(fd)

        def raw_read() -> None:
            os.preadv(fd, [ko_np], 0)
            os.preadv(fd, [vo_np], k_np.nbytes)

        def evict_raw() -> None:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

        for name, tier in tiers.items():

            def tier_write(tier: DiskTier = tier) -> None:
                tier.write_blocks(slots, k, v)
                if args.cold:
                    os.fdatasync(tier._fd)

            def read_layers(tier: DiskTier = tier) -> None:
                for layer in range(layout.num_layers):
                    tier.read_layer(layer, slots, kl, vl)

            variants = {
                "raw write": raw_write,
                "tier write": tier_write,
                "raw read": raw_read,
                "tier read": lambda tier=tier: tier.read_blocks(slots, k_out, v_out),
                "tier read_layer x L": read_layers,
            }
            before = {}
            if args.cold:
                before = {
                    "raw read": evict_raw,
                    "tier read": tier.drop_cache,
                    "tier read_layer x L": tier.drop_cache,
                }
            results[name] = _rates(median_seconds(variants, args.repeats, before=before), total)
            if tier.stats.bytes_written:
                results[name]["stored_fraction"] = tier.stats.bytes_written / (
                    tier.stats.blocks_written * layout.raw_block_bytes
                )
    finally:
        os.close(fd)
        for tier in tiers.values():
            tier.close()
    return results


def _host_vs_copy(
    layout: BlockLayout,
    n: int,
    k: torch.Tensor,
    v: torch.Tensor,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    repeats: int,
) -> dict[str, object]:
    """Host tier write/read vs copy_ of the same bytes into/out of a preallocated arena."""
    host = HostTier(layout, n)
    slots = list(range(n))
    shuffled = np.random.default_rng(0).permutation(n).tolist()
    raw_k, raw_v = torch.zeros_like(k), torch.zeros_like(v)  # zeros: pages touched
    sec = median_seconds(
        {
            "raw write": lambda: (raw_k.copy_(k), raw_v.copy_(v)),
            "tier write": lambda: host.write_blocks(slots, k, v),
            "raw read": lambda: (k_out.copy_(raw_k), v_out.copy_(raw_v)),
            "tier read": lambda: host.read_blocks(slots, k_out, v_out),
            "tier read shuffled": lambda: host.read_blocks(shuffled, k_out, v_out),
        },
        repeats,
    )
    return _rates(sec, n * layout.raw_block_bytes)


def _rates(sec: dict[str, float], total: int) -> dict[str, object]:
    gbps = {name: total / s / _GB for name, s in sec.items()}
    out: dict[str, object] = {"gb_per_s": gbps}
    out["write_ratio"] = gbps["tier write"] / gbps["raw write"]
    out["read_ratio"] = gbps["tier read"] / gbps["raw read"]
    for name in gbps:
        if name.startswith("tier read") and name != "tier read":
            out[name.removeprefix("tier ").replace(" ", "_") + "_ratio"] = (
                gbps[name] / gbps["raw read"]
            )
    return out


# -- 2./3. block-size sweep and latency distribution --------------------------------------
def _single_block_latencies(
    tiers: dict[str, object], n: int, samples: int, layout: BlockLayout, cold: bool
) -> dict[str, list[float]]:
    """Seconds of `samples` random single-block reads per tier, tiers interleaved."""
    k1 = torch.empty(layout.raw_shape("k", 1), dtype=layout.dtype)
    v1 = torch.empty(layout.raw_shape("v", 1), dtype=layout.dtype)
    picks = np.random.default_rng(1).integers(0, n, samples).tolist()
    lat: dict[str, list[float]] = {name: [] for name in tiers}
    for slot in picks:
        for name, tier in tiers.items():
            if cold and isinstance(tier, DiskTier):
                tier.drop_cache()
            t0 = time.perf_counter()
            tier.read_blocks([slot], k1, v1)
            lat[name].append(time.perf_counter() - t0)
    return lat


def _tiers_for(layout: BlockLayout, n: int, workdir: Path) -> dict[str, object]:
    tiers: dict[str, object] = {"host": HostTier(layout, n)}
    if torch.cuda.is_available():
        from kvstrata.tiers.memory import DeviceTier

        tiers["device"] = DeviceTier(layout, n)
    tiers["disk"] = DiskTier(layout, n, workdir)
    k, v = _kv(layout, n)
    for tier in tiers.values():
        tier.write_blocks(list(range(n)), k, v)
    return tiers


def bench_sweep(args: argparse.Namespace, workdir: Path) -> list[dict[str, object]]:
    rows = []
    budget = max(4, args.size_mib // 4) * 2**20
    samples = max(8, args.samples // 4)
    for bs in SWEEP_BLOCK_SIZES:
        layout = _layout(bs, args.quick)
        n = max(2, budget // layout.raw_block_bytes)
        tiers = _tiers_for(layout, n, workdir / f"sweep{bs}")
        try:
            lat = _single_block_latencies(tiers, n, samples, layout, args.cold)
        finally:
            tiers["disk"].close()
        row: dict[str, object] = {
            "block_size": bs,
            "block_bytes": layout.raw_block_bytes,
            "dtype": dtype_name(layout.dtype),
        }
        for name, ts in lat.items():
            med = statistics.median(ts)
            row[name] = {
                "latency_us": med * 1e6,
                "gb_per_s": layout.raw_block_bytes / med / _GB,
                "samples": len(ts),
            }
        rows.append(row)
    return rows


def bench_jitter(args: argparse.Namespace, workdir: Path) -> dict[str, object]:
    layout = _layout(64, args.quick)
    n = max(2, max(4, args.size_mib // 4) * 2**20 // layout.raw_block_bytes)
    tiers = _tiers_for(layout, n, workdir / "jitter")
    lat = _single_block_latencies(tiers, n, args.samples, layout, args.cold)
    tiers["disk"].close()
    out: dict[str, object] = {"block_bytes": layout.raw_block_bytes, "samples": args.samples}
    for name, ts in lat.items():
        us = np.asarray(ts) * 1e6
        out[name] = {
            "p50_us": float(np.percentile(us, 50)),
            "p99_us": float(np.percentile(us, 99)),
            "std_us": float(us.std()),
            "mean_us": float(us.mean()),
        }
    return out


# -- 4. prefetch overlap ------------------------------------------------------------------
def _matmul_seconds(m: int, reps: int = 5) -> float:
    a = torch.randn(m, m)
    a @ a  # warm up
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ a
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def bench_prefetch(args: argparse.Namespace) -> dict[str, object]:
    layout = _layout(64, args.quick)
    per_layer_blocks = max(2, (args.size_mib // 8) * 2**20 // layout.raw_block_bytes)
    n = per_layer_blocks
    host = HostTier(layout, n)
    k, v = _kv(layout, n)
    slots = list(range(n))
    host.write_blocks(slots, k, v)
    layer_bytes = host.block_bytes * n // layout.num_layers
    steps = layout.num_layers * (2 if args.quick else 4)  # decode steps x layers
    shape = (layout.num_kv_heads, n * layout.block_size, layout.head_dim)
    buffers = [tuple(torch.empty(shape, dtype=layout.dtype) for _ in range(2)) for _ in range(2)]
    link = LinkModel.preset("pcie4")

    def load(i: int, buf: tuple[torch.Tensor, torch.Tensor]) -> None:
        host.read_layer(i % layout.num_layers, slots, *buf)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with TransferEngine(max_workers=1, links={"host->device": link}) as engine:
            # measured transfer time per layer, then a matmul sized to ~1.5x of it
            for i in range(4):
                engine.wait(
                    engine.submit(
                        lambda i=i: load(i, buffers[0]), link="host->device", nbytes=layer_bytes
                    )
                )
            st = engine.stats
            transfer = st.transfer_s / st.num_transfers
            m = 128
            t128 = _matmul_seconds(m)
            m = max(32, int(m * (1.5 * transfer / t128) ** (1 / 3)))
            a = torch.randn(m, m)

            def serial() -> None:
                for i in range(steps):
                    engine.wait(
                        engine.submit(
                            lambda i=i: load(i, buffers[0]), link="host->device", nbytes=layer_bytes
                        )
                    )
                    a @ a

            def pipelined() -> None:
                for _i, _buf in Prefetcher(
                    engine, load, buffers, steps, link="host->device", nbytes=layer_bytes
                ):
                    a @ a

            engine.reset_stats()
            sec = median_seconds({"serial": serial, "pipelined": pipelined}, args.repeats)
            engine.reset_stats()
            pipelined()
            st = engine.stats
            compute = _matmul_seconds(m)
    finally:
        torch.set_num_threads(threads)
    return {
        "layer_bytes": layer_bytes,
        "link": "pcie4 (25 GB/s, 10 us)",
        "link_model_s": link.seconds(layer_bytes),
        "transfer_s": st.transfer_s / st.num_transfers,
        "compute_s": compute,
        "compute_over_transfer": compute / (st.transfer_s / st.num_transfers),
        "hidden_fraction": st.overlap_ratio,
        "stall_s_per_step": st.stall_s / steps,
        "speedup_vs_serial": sec["serial"] / sec["pipelined"],
    }


# -- report -------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    """Run all four parts and print tables (or JSON with --json)."""
    from kvstrata.core.errors import ConfigError

    check_positive(args, "size_mib", "repeats", "samples")
    if args.quick:
        args.size_mib, args.repeats, args.samples = min(args.size_mib, 4), 4, min(args.samples, 20)
    tmp = None
    if args.dir is None:
        tmp = tempfile.mkdtemp(prefix="kvstrata-bench-tiers-")
    workdir = Path(args.dir or tmp)
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError.field("dir", args.dir, f"cannot create it ({exc.strerror})") from exc
    try:
        report = {
            "note": "ratios are tier/raw in the same run (interleaved, medians); "
            + ("cold: fdatasync + page-cache eviction" if args.cold else "page cache warm"),
            "throughput": bench_throughput(args, workdir),
            "sweep": bench_sweep(args, workdir),
            "jitter": bench_jitter(args, workdir),
            "prefetch": bench_prefetch(args),
        }
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            for name in (
                "tier",
                "tier_zstd",
                "tier_direct",
                "jitter",
                *(f"sweep{b}" for b in SWEEP_BLOCK_SIZES),
            ):
                shutil.rmtree(workdir / name, ignore_errors=True)
            (workdir / "raw.bin").unlink(missing_ok=True)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_tables(report)
    return 0


def _print_tables(report: dict[str, object]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    tp = report["throughput"]
    t = Table(title=f"tier vs raw, {tp['bytes'] / 2**20:.0f} MiB, {report['note']}")
    for col in ("tier", "op", "tier GB/s", "raw GB/s", "ratio", "target"):
        t.add_column(col, justify="left" if col in ("tier", "op") else "right")
    for tier in [k for k in tp if isinstance(tp[k], dict)]:
        g = tp[tier]["gb_per_s"]
        for op in [name.removeprefix("tier ") for name in g if name.startswith("tier ")]:
            raw = g["raw write"] if op == "write" else g["raw read"]
            ratio = g[f"tier {op}"] / raw
            # the 0.8x target is for sequential moves; random slot order is shown as is
            verdict = "-" if "shuffled" in op else ("ok" if ratio >= 0.8 else "< 0.8x")
            t.add_row(tier, op, f"{g[f'tier {op}']:.2f}", f"{raw:.2f}", f"{ratio:.2f}x", verdict)
    console.print(t)
    sw = report["sweep"]
    names = [k for k in sw[0] if isinstance(sw[0][k], dict)]
    t = Table(title="single-block read vs block size (median latency, GB/s)")
    t.add_column("block tokens")
    t.add_column("block KiB", justify="right")
    for name in names:
        t.add_column(f"{name} us", justify="right")
        t.add_column(f"{name} GB/s", justify="right")
    for row in sw:
        cells = [str(row["block_size"]), f"{row['block_bytes'] / 1024:.0f}"]
        for name in names:
            cells += [f"{row[name]['latency_us']:.0f}", f"{row[name]['gb_per_s']:.2f}"]
        t.add_row(*cells)
    console.print(t)
    jt = report["jitter"]
    t = Table(title=f"single-block read latency, {jt['block_bytes'] / 1024:.0f} KiB blocks")
    for col in ("tier", "p50 us", "p99 us", "std us", "p99/p50"):
        t.add_column(col, justify="left" if col == "tier" else "right")
    for name in [k for k in jt if isinstance(jt[k], dict)]:
        d = jt[name]
        t.add_row(
            name,
            f"{d['p50_us']:.0f}",
            f"{d['p99_us']:.0f}",
            f"{d['std_us']:.0f}",
            f"{d['p99_us'] / d['p50_us']:.2f}",
        )
    console.print(t)
    pf = report["prefetch"]
    console.print(
        f"prefetch ({pf['link']}, {pf['layer_bytes'] / 2**20:.1f} MiB/layer): transfer "
        f"{pf['transfer_s'] * 1e3:.2f} ms, compute {pf['compute_s'] * 1e3:.2f} ms "
        f"({pf['compute_over_transfer']:.2f}x), hidden {pf['hidden_fraction']:.1%} "
        f"(target >= 90 %), speedup vs serial {pf['speedup_vs_serial']:.2f}x"
    )
