"""Shared helpers of the benchmarks: interleaved repeated timing (medians), a
machine-idle check, flag checks, and the rich-table / JSON report.

The machines these run on are shared and noisy (DESIGN.md, "Noise"): compared
variants run round-robin, each repeat visiting every variant once, so a burst of
load hits all of them alike, and the report quotes medians and ratios against a
baseline from the same run, never absolute targets.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

# 1-minute load above (cores - threads) + this margin means another process competes
# for the cores the benchmark uses: the numbers are then slowed many times over.
LOAD_MARGIN = 0.5
DEFAULT_CONTEXTS = "2048,8192"


def time_attention(runtime: Any) -> tuple[list[float], Callable[[], None]]:
    """Wrap a store runtime's `attend`: (cell whose [0] sums the seconds spent inside it,
    a call that puts the unwrapped one back)."""
    cell = [0.0]
    inner = runtime.attend

    def timed(*args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(*args)
        finally:
            cell[0] += time.perf_counter() - t0

    runtime.attend = timed

    def undo() -> None:
        runtime.attend = inner

    return cell, undo


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]) of latencies; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def machine_load() -> tuple[float, int]:
    """(1-minute load average, CPU count); load is 0.0 where the OS does not report it."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # not on every OS
        load = 0.0
    return load, os.cpu_count() or 1


def load_warning(threads: int) -> str | None:
    """A one-line warning when the machine is busy, else None.

    Args:
        threads: torch threads the benchmark itself uses.

    Returns:
        The warning text, or None when the load leaves the benchmark's cores free.
    """
    load, cores = machine_load()
    if load <= max(0, cores - threads) + LOAD_MARGIN:
        return None
    text = (
        f"machine busy: load average {load:.2f} on {cores} cores while this benchmark "
        f"uses {threads} threads; timings are slowed and noisy, compare ratios only "
        "and re-measure on an idle machine"
    )
    if threads > 1:
        # With 2 threads on 2 busy cores every parallel kernel was seen to wait a
        # scheduler slice for its second thread (docs/MEASUREMENTS.md), so variants that
        # launch more kernels per step (more attention partials) look far slower than
        # they are.
        text += (
            f"; with {threads} threads each parallel kernel may wait a scheduler slice, "
            "which penalises variants with more kernel calls per step (--threads 1 is "
            "less distorted)"
        )
    return text


def interleaved(
    fns: dict[str, Callable[[], float]], repeats: int, warmup: int = 1, rotate: bool = False
) -> dict[str, list[float]]:
    """Run every variant `repeats` times, round-robin; each call returns its own
    measured seconds (so untimed setup such as building a cache stays outside).

    Args:
        fns: variant name -> callable returning the seconds it measured.
        repeats: timed rounds (each round calls every variant once).
        warmup: untimed rounds first (caches, allocator, lazy kernels).
        rotate: start each round one variant later (no variant always runs first).

    Returns:
        variant name -> the `repeats` measured seconds, in call order.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        k = r % len(names) if rotate and names else 0
        for name in names[k:] + names[:k]:
            times[name].append(fns[name]())
    return times


def median_seconds(
    fns: dict[str, Callable[[], object]],
    repeats: int,
    warmup: int = 0,
    before: dict[str, Callable[[], object]] | None = None,
) -> dict[str, float]:
    """Median wall seconds of each plain callable, interleaved with rotation.

    Args:
        fns: variant name -> the work to time.
        repeats: timed rounds.
        warmup: untimed rounds first.
        before: name -> untimed set-up run just before that variant (e.g. evict a cache).
    """

    def timed(name: str) -> Callable[[], float]:
        fn, setup = fns[name], (before or {}).get(name)

        def once() -> float:
            if setup is not None:
                setup()
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0

        return once

    times = interleaved({n: timed(n) for n in fns}, repeats, warmup, rotate=True)
    return {n: median(t) for n, t in times.items()}


def timed_with_load_check(
    fns: dict[str, Callable[[], float]], repeats: int, threads: int
) -> tuple[dict[str, list[float]], str | None]:
    """`interleaved` (one warm-up round) plus the machine-load warning, taken before
    and, if the machine looked idle then, again after the runs."""
    warning = load_warning(threads)
    times = interleaved(fns, repeats, warmup=1)
    return times, warning or load_warning(threads)


def median(values: Sequence[float]) -> float:
    """Median of a non-empty sequence."""
    return float(statistics.median(values))


def spread(values: Sequence[float]) -> float:
    """(max - min) / median: how noisy a variant's repeats were."""
    mid = median(values)
    return float((max(values) - min(values)) / mid) if mid else 0.0


def print_table(
    title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], notes: Sequence[str] = ()
) -> None:
    """Print a rich table (first column left-aligned, the rest right-aligned), then notes."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right", no_wrap=i == 0)
    for row in rows:
        table.add_row(*(str(cell) for cell in row))
    console = Console()
    console.print(table)
    for note in notes:
        console.print(note, highlight=False)


def plain(value: Any) -> Any:
    """JSON-safe, recursively: NaN and infinities as None."""
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return None
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def print_json(report: dict[str, Any]) -> None:
    """Print the report as indented JSON (machine-readable `--json` output)."""
    print(json.dumps(report, indent=2, sort_keys=False))


def add_decode_arguments(parser: Any, init_range: float, init_help: str) -> None:
    """The flags the decode-loop scenarios share (decode, quantized)."""
    parser.add_argument("--contexts", default=DEFAULT_CONTEXTS, help="comma-separated lengths")
    parser.add_argument("--steps", type=int, default=128, help="timed decode steps per call")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved timed rounds")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--layers", type=int, default=4, help="layers of the synthetic model")
    parser.add_argument("--block-size", type=int, default=64, help="tokens per KV block")
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the random weights and prompts"
    )
    parser.add_argument("--init-range", type=float, default=init_range, help=init_help)
    parser.add_argument("--quick", action="store_true", help="tiny smoke run (1 layer)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


def resolve_decode_args(
    args: Any,
    quick_contexts: str,
    count: int | None = None,
    extra_positive: tuple[str, ...] = (),
    **quick: Any,
) -> Any:
    """A copy of the decode-benchmark flags with --quick applied (tiny contexts unless
    --contexts was given, 6 steps x 2 repeats, 1 layer, plus `quick` overrides),
    contexts parsed and counts checked (ConfigError, exit 2)."""
    import argparse

    args = argparse.Namespace(**vars(args))
    if args.quick:
        if args.contexts == DEFAULT_CONTEXTS:  # an explicit --contexts wins
            args.contexts = quick_contexts
        args.steps, args.repeats, args.layers = 6, 2, 1
        for name, value in quick.items():
            setattr(args, name, value)
    args.contexts = parse_contexts(args.contexts, count=count)
    check_positive(args, "steps", "repeats", "threads", "layers", "block_size", *extra_positive)
    return args


def check_positive(args: Any, *names: str) -> None:
    """ConfigError (exit 2, one line) unless every named flag is a whole number >= 1."""
    from kvstrata.core.errors import ConfigError

    for name in names:
        value = getattr(args, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            flag = "--" + name.replace("_", "-")
            raise ConfigError.field(name, value, f"{flag} takes a whole number >= 1")


def parse_contexts(text: str | Sequence[int], count: int | None = None) -> tuple[int, ...]:
    """ "2048,8k" -> (2048, 8192); ConfigError (exit 2) on bad input or wrong count."""
    from kvstrata.core.errors import ConfigError
    from kvstrata.core.units import parse_tokens

    if not isinstance(text, str):
        return tuple(text)
    contexts = tuple(parse_tokens(c, "contexts") for c in text.split(",") if c.strip())
    if not contexts or (count is not None and len(contexts) != count):
        want = f"{count} token counts" if count else "token counts"
        raise ConfigError.field("contexts", text, f"{want}, e.g. 2048,8192")
    return contexts
