"""`kvstrata plan`: size the KV cache of a model on a GPU and say whether to offload.

kvstrata plan --model llama-2-7b --gpu rtx4090 --context 8k --concurrency 4
kvstrata plan --model ./my-model --gpu h100 --link pcie5 --codec int8 --json
kvstrata plan --model llama-2-7b --context 128k --concurrency 8 --cxl-memory auto
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from kvstrata.core.errors import ConfigError
from kvstrata.core.units import (
    MAX_BYTES,
    format_bytes,
    parse_float,
    parse_fraction,
    parse_int,
    parse_size,
    parse_tokens,
)
from kvstrata.model.geometry import DTYPES
from kvstrata.platform.hardware import DISKS, GPUS, LINKS, make_hardware
from kvstrata.platform.numa import cxl_memory, read_topology
from kvstrata.workload.memory_plan import PRIORITIES, MemoryPlan, Workload, plan
from kvstrata.workload.zoo import load_geometry

BANDWIDTH_HELP = "a bandwidth > 0 such as '25GB/s', '1TB/s' or 25e9 (bytes/s)"


def _bandwidth(value: str | None, field: str) -> float | None:
    """'25GB/s', '25GB', '25e9' -> bytes/s (decimal GB, as bandwidths are quoted)."""
    if value is None:
        return None
    text = value.strip()
    if text.lower().endswith("/s"):
        text = text[:-2]
    try:
        number = float(text)
    except ValueError:
        try:
            number = float(parse_size(text, field))
        except ConfigError:
            raise ConfigError.field(field, value, BANDWIDTH_HELP) from None
    if not 0 < number <= MAX_BYTES:  # also NaN and infinity
        raise ConfigError.field(field, value, BANDWIDTH_HELP)
    return number


def _params(value: str | None) -> int | None:
    """'7e9', '6738415616', '7B', '175b' -> a parameter count."""
    if value is None:
        return None
    text = value.strip().lower()
    scale = {"k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}.get(text[-1:], 1.0)
    try:
        number = parse_float(text[:-1] if scale != 1.0 else text, "params") * scale
    except ConfigError:
        number = math.nan
    if not 0 < number <= 1e18 or number != int(number):  # a whole, finite count
        raise ConfigError.field("params", value, "a positive parameter count such as 7e9 or '7B'")
    return int(number)


def _reserve(value: str) -> tuple[float, int | None]:
    """'10%' -> (0.10, None); '2GiB' -> (0.0, 2 GiB)."""
    text = value.strip()
    if text.endswith("%"):
        try:
            percent = parse_float(text[:-1], "reserve")
        except ConfigError:
            percent = math.nan
        if not 0 <= percent < 100:
            raise ConfigError.field(
                "reserve", value, "a percentage in [0%, 100%) such as '10%', or a size"
            )
        return percent / 100, None
    hint = "for a share of the GPU write a percentage such as '10%'"
    return 0.0, parse_size(text, "reserve", allow_zero=True, fraction_hint=hint)


def _count(value: str) -> int:
    """A positive request count ('4')."""
    return parse_int(value, "concurrency", what="a number of requests")


def _fraction(value: str | None) -> float | None:
    return None if value is None else parse_fraction(value, "resident_fraction")


def _cxl(args: argparse.Namespace) -> tuple[int | None, float | None]:
    """--cxl-memory / --cxl-bandwidth -> (bytes, bytes/s); 'auto' reads this machine's
    CPU-less NUMA nodes (their size, and their HMAT bandwidth unless given)."""
    if args.cxl_memory is None and args.cxl_bandwidth is not None:
        raise ConfigError.field("cxl_bandwidth", args.cxl_bandwidth, "set --cxl-memory to add CXL")
    given = _bandwidth(args.cxl_bandwidth, "cxl_bandwidth")
    if args.cxl_memory is None or args.cxl_memory.strip().lower() != "auto":
        size = parse_size(args.cxl_memory, "cxl_memory") if args.cxl_memory else None
        return size, given
    found = cxl_memory(read_topology())
    if found is None:
        raise ConfigError.field(
            "cxl_memory", args.cxl_memory, "no CPU-less NUMA node here: give a size, e.g. 256GiB"
        )
    return found[0], given or found[1]


def build_plan(args: argparse.Namespace) -> MemoryPlan:
    """Turn parsed flags into a `MemoryPlan` (all validation errors are ConfigError)."""
    geometry = load_geometry(args.model)
    no_disk = args.disk_link is None or args.disk_link.strip().lower() == "none"
    for name in ("disk_bandwidth", "disk_capacity"):
        if no_disk and getattr(args, name) is not None:
            raise ConfigError.field(name, getattr(args, name), "set --disk-link to add a disk")
    cxl_bytes, cxl_bandwidth = _cxl(args)
    hardware = make_hardware(
        args.gpu,
        args.link,
        args.disk_link,
        gpu_memory=parse_size(args.gpu_memory, "gpu_memory")
        if args.gpu_memory is not None
        else None,
        gpu_bandwidth=_bandwidth(args.gpu_bandwidth, "gpu_bandwidth"),
        link_bandwidth=_bandwidth(args.link_bandwidth, "link_bandwidth"),
        disk_bandwidth=_bandwidth(args.disk_bandwidth, "disk_bandwidth"),
        host_memory=(
            parse_size(args.host_memory, "host_memory", allow_zero=True)
            if args.host_memory is not None
            else None
        ),
        disk_capacity=parse_size(args.disk_capacity, "disk_capacity")
        if args.disk_capacity is not None
        else None,
        cxl_memory=cxl_bytes,
        cxl_bandwidth=cxl_bandwidth,
    )
    reserve_fraction, reserve_bytes = _reserve(args.reserve)
    gpu_bytes = hardware.gpu.memory_bytes
    if reserve_bytes is not None and reserve_bytes >= gpu_bytes:
        raise ConfigError.field(
            "reserve",
            args.reserve,
            f"must be less than the GPU's memory ({format_bytes(gpu_bytes)}, "
            f"{hardware.gpu.name}): e.g. '10%' or '2GiB'",
        )
    workload = Workload(
        context_tokens=parse_tokens(args.context, "context"),
        concurrency=_count(args.concurrency),
        priority=args.priority,
        weights_dtype=args.weights_dtype,
        kv_dtype=args.kv_dtype,
        codec=args.codec,
        block_size=parse_tokens(args.block_size, "block_size") if args.block_size else None,
        params=_params(args.params),
        reserve_fraction=reserve_fraction,
        reserve_bytes=reserve_bytes,
        resident_fraction=_fraction(args.resident_fraction),
    )
    return plan(geometry, hardware, workload)


def _ctx(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def _short(num: float) -> str:
    """Three significant digits: 128 MiB, 64.0 MiB, 1.03 GiB (keeps the table narrow)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num) < 1000 or unit == "TiB":
            return f"{num:.3g} {unit}" if num >= 100 or unit == "B" else f"{num:#.3g} {unit}"
        num /= 1024
    raise AssertionError("unreachable")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def render(result: MemoryPlan) -> None:
    """Print the plan as rich tables (for people)."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 120, soft_wrap=False)
    g, hw, wl = result.geometry, result.hardware, result.workload
    n = wl.concurrency
    console.print(
        f"[bold]{result.model}[/]: {g.describe()}; KV {result.kv_dtype} = "
        f"{result.bytes_per_token:,} B/token; stored with codec {result.codec!r} = "
        f"{result.stored_bytes_per_token:,} B/token"
    )

    table = Table(title=f"KV memory per request (and for {n} requests)")
    table.add_column("context", justify="right")
    codecs = list(result.table[0].per_request) if result.table else []
    for codec in codecs:
        table.add_column(codec, justify="right")
        if n > 1:
            table.add_column(f"{codec} x{n}", justify="right")
    for row in result.table:
        cells = []
        for c in codecs:
            cells.append(_short(row.per_request[c]))
            if n > 1:
                cells.append(_short(row.total[c]))
        style = "bold" if row.context_tokens == wl.context_tokens else None
        table.add_row(_ctx(row.context_tokens), *cells, style=style)
    console.print(table)

    budget = Table(title=f"GPU {hw.gpu.name}: {format_bytes(hw.gpu.memory_bytes)}")
    budget.add_column("item")
    budget.add_column("bytes", justify="right")
    budget.add_row("weights", format_bytes(result.weights_bytes))
    budget.add_row("reserve (activations, context)", format_bytes(result.reserve_bytes))
    room = result.kv_room_bytes
    free = format_bytes(room) if room > 0 else f"none ({format_bytes(-room)} short)"
    budget.add_row("free for KV", free)
    budget.add_row(
        f"KV needed ({n} x {wl.context_tokens} tokens)", format_bytes(result.stored_total_bytes)
    )
    fits = "[green]yes[/]" if result.fits_on_gpu else "[red]no[/]"
    budget.add_row("fits on the GPU", fits)
    console.print(budget)

    tiers, bounds = result.tiers, result.bounds
    if tiers is not None and bounds is not None:
        title = "Tier plan" + ("" if not result.fits_on_gpu else " (not needed: KV fits)")
        tier_table = Table(title=f"{title}, block size {result.block_size}")
        tier_table.add_column("tier")
        tier_table.add_column("budget", justify="right")
        tier_table.add_column("holds")
        tier_table.add_column("step bound", justify="right")
        tier_table.add_row(
            "device (hot)",
            format_bytes(tiers.device_bytes + tiers.staging_bytes),
            f"newest {tiers.resident_tokens} tokens/request ({tiers.resident_fraction:.1%}) "
            f"+ {format_bytes(tiers.staging_bytes)} staging",
            _ms(bounds.hbm_s),
        )
        tier_table.add_row(
            f"host ({hw.link.name} {hw.link.bandwidth / 1e9:g} GB/s)",
            format_bytes(tiers.host_bytes),
            f"cold blocks (of {format_bytes(tiers.host_capacity)} usable)",
            _ms(bounds.host_link_s),
        )
        if hw.cxl is not None:
            tier_table.add_row(
                f"cxl (CPU-less node, {hw.cxl.bandwidth / 1e9:g} GB/s)",
                format_bytes(tiers.cxl_bytes),
                f"colder blocks (of {format_bytes(tiers.cxl_capacity)} usable)",
                _ms(bounds.cxl_link_s),
            )
        if hw.disk is not None:
            tier_table.add_row(
                f"disk ({hw.disk.name} {hw.disk.bandwidth / 1e9:g} GB/s)",
                format_bytes(tiers.disk_bytes),
                "oldest blocks",
                _ms(bounds.disk_link_s),
            )
        console.print(tier_table)
        console.print(
            f"decode step >= {_ms(bounds.tiered_s)} tiered vs {_ms(bounds.all_on_gpu_s)} "
            f"all on the GPU ({bounds.slowdown:.1f}x); device KV saved: {result.memory_saved:.1%}"
        )
    colour = {"recommend": "green", "advise against": "red"}.get(result.verdict, "yellow")
    console.print(f"[bold {colour}]Offloading: {result.verdict.upper()}[/]")
    for reason in result.reasons_for:
        console.print(f"  + {reason}", highlight=False)
    for reason in result.reasons_against:
        console.print(f"  - {reason}", highlight=False)
    for note in result.notes:
        console.print(f"  note: {note}", highlight=False)
    if result.raise_hint:
        console.print(f"[bold red]Does not fit:[/] {result.raise_hint}", highlight=False)


def run(args: argparse.Namespace) -> int:
    """Run `kvstrata plan`; exit code 0 (errors raise ConfigError -> exit 2 in main)."""
    result = build_plan(args)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        render(result)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `plan` subcommand."""
    p = sub.add_parser(
        "plan",
        help="KV memory planner: budgets, bounds and an offload verdict",
        description="Size the KV cache of a model on a GPU and say whether to offload it.",
    )
    p.add_argument("--model", required=True, help="preset name, config.json or model directory")
    p.add_argument("--gpu", default="rtx4090", help=f"{', '.join(GPUS)} or custom")
    p.add_argument("--link", default="pcie4", help=f"GPU-host link: {', '.join(LINKS)}")
    p.add_argument("--disk-link", default=None, help=f"disk tier: {', '.join(DISKS)} (none)")
    p.add_argument("--disk-capacity", default=None, help="disk space for KV, e.g. 2TB")
    p.add_argument("--gpu-memory", default=None, help="override GPU memory, e.g. 24GiB")
    p.add_argument("--gpu-bandwidth", default=None, help="override HBM bandwidth, e.g. 1TB/s")
    p.add_argument("--link-bandwidth", default=None, help="override link bandwidth, e.g. 20GB/s")
    p.add_argument("--disk-bandwidth", default=None, help="override disk bandwidth")
    p.add_argument("--host-memory", default=None, help="host RAM (default: this machine's)")
    p.add_argument(
        "--cxl-memory",
        default=None,
        help="CXL memory (a CPU-less NUMA node) below host RAM, e.g. 256GiB; 'auto': this "
        "machine's (docs/numa.md)",
    )
    p.add_argument(
        "--cxl-bandwidth", default=None, help="its read bandwidth (default: HMAT's, or 35GB/s)"
    )
    p.add_argument("--context", default="8k", help="tokens per request, e.g. 8k (default 8k)")
    p.add_argument("--concurrency", default="1", help="concurrent requests (default 1)")
    # Validated by the planner (ConfigError: one line, exit 2), not by argparse choices.
    p.add_argument("--priority", default="throughput", help=" or ".join(PRIORITIES))
    dtypes = ", ".join(DTYPES)
    p.add_argument("--weights-dtype", default=None, help=f"{dtypes} (default: the model's)")
    p.add_argument("--kv-dtype", default=None, help=f"{dtypes} (default: the model's)")
    p.add_argument("--codec", default="none", help="KV codec: none, fp8, int8, int4, ...")
    p.add_argument("--block-size", default=None, help="tokens per block (default: 64-256)")
    p.add_argument("--params", default=None, help="parameter count, e.g. 7e9 (default: model's)")
    p.add_argument("--reserve", default="10%", help="GPU memory kept back: '10%%' or '2GiB'")
    p.add_argument("--resident-fraction", default=None, help="KV kept on the GPU, e.g. 0.1")
    p.add_argument("--json", action="store_true", help="machine-readable JSON output")
    p.set_defaults(func=run)
