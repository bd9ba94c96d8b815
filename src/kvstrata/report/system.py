"""The store and engine sections, each one of the existing benchmarks run at the
report's scale and kept whole:

  block_size  `kvstrata bench tiers`: tier GB/s vs raw copies, and the block-size sweep
              of single-block read latency and GB/s per tier (the seed's trade-off)
  prefix      `kvstrata bench prefix`: time to first token cold / warm / after a restart
  serve       `kvstrata bench serve`: engine output tok/s at concurrency 1 / 4 / 8 vs
              one-at-a-time generate (the competing-load part is left out)
"""

from __future__ import annotations

import argparse
from typing import Any

from kvstrata.report.session import Session

# Sizes `kvstrata bench serve` uses by default
SERVE_BLOCK_SIZE = 32


def _tier_args(session: Session) -> argparse.Namespace:
    scale = session.scale
    return argparse.Namespace(
        size_mib=scale.tier_size_mib,
        repeats=scale.repeats,
        samples=scale.tier_samples,
        cold=False,
        compress=False,
        o_direct=False,
        quick=scale.name == "smoke",  # the tiers bench's tiny layout
    )


def block_size(session: Session) -> dict[str, Any]:
    """Tier throughput vs raw copies and the block-size sweep, page cache warm."""
    from kvstrata.bench.tiers import bench_sweep, bench_throughput

    args = _tier_args(session)
    workdir = session.workdir / "tiers"
    workdir.mkdir(parents=True, exist_ok=True)
    throughput = bench_throughput(args, workdir)
    session.tick("block size: tier throughput")
    sweep = bench_sweep(args, workdir)
    session.tick("block size: sweep")
    first = sweep[0]
    tiers = [k for k in first if isinstance(first[k], dict)]
    return {
        "token_bytes": first["block_bytes"] // first["block_size"],
        "dtype": first["dtype"],
        "size_mib": args.size_mib,
        "samples": min(r[t]["samples"] for r in sweep for t in tiers),
        "repeats": args.repeats,
        "page_cache": "warm (reads of the disk tier come from the page cache)",
        "throughput": throughput,
        "sweep": sweep,
        "command": session.section_command("block_size"),
        "bench_command": f"kvstrata bench tiers --size-mib {args.size_mib}",
    }


def bandwidths(session: Session) -> dict[str, float]:
    """Measured bytes/s the planner is given for this machine: a raw `copy_` in memory
    (the device's), the host tier's read (its link) and the disk tier's read, from the
    block_size section (measured now when that section did not run)."""
    data = session.data.get("block_size")
    if data is None:
        workdir = session.workdir / "bandwidth"
        workdir.mkdir(parents=True, exist_ok=True)
        from kvstrata.bench.tiers import bench_throughput

        throughput = bench_throughput(_tier_args(session), workdir)
    else:
        throughput = data["throughput"]
    host, disk = throughput["host"]["gb_per_s"], throughput["disk"]["gb_per_s"]
    return {
        "device": host["raw read"] * 1e9,
        "link": host["tier read"] * 1e9,
        "disk": disk["tier read"] * 1e9,
    }


def prefix(session: Session) -> dict[str, Any]:
    """`kvstrata bench prefix` at the report's size (embedded model)."""
    from kvstrata.bench import prefix as bench_prefix

    scale = session.scale
    args = argparse.Namespace(
        prefix=str(scale.prefix_tokens),
        suffix=scale.prefix_suffix,
        repeats=scale.repeats,
        threads=session.threads,
        block_size=scale.block_size,
        dir=None,
    )
    report = bench_prefix.measure(args)
    session.tick("prefix: time to first token")
    report["command"] = session.section_command("prefix")
    report["bench_command"] = (
        f"kvstrata bench prefix --prefix {scale.prefix_tokens} --suffix {scale.prefix_suffix} "
        f"--repeats {scale.repeats} --threads {session.threads}"
    )
    return report


def serve(session: Session) -> dict[str, Any]:
    """`kvstrata bench serve --no-load` at the report's size (embedded model)."""
    from kvstrata.bench import serve as bench_serve

    scale = session.scale
    args = argparse.Namespace(
        requests=scale.serve_requests,
        prompt_tokens=scale.serve_prompt_tokens,
        max_tokens=scale.serve_max_tokens,
        repeats=scale.repeats,
        threads=session.threads,
        block_size=SERVE_BLOCK_SIZE,
        no_load=True,
    )
    report = bench_serve.measure(args)
    session.tick("serve: engine concurrency")
    report["command"] = session.section_command("serve")
    report["bench_command"] = (
        f"kvstrata bench serve --no-load --requests {scale.serve_requests} --prompt-tokens "
        f"{scale.serve_prompt_tokens} --max-tokens {scale.serve_max_tokens} --repeats "
        f"{scale.repeats} --threads {session.threads}"
    )
    return report
