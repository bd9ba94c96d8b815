"""`kvstrata bench SCENARIO`: scenarios are modules in `kvstrata.bench` that define

    NAME: str                     # the scenario name on the command line
    HELP: str                     # one line
    def add_arguments(parser) -> None
    def run(args) -> int

Every scenario reports ratios against a baseline measured in the same run, with
the compared variants interleaved and repeated (medians), never absolute targets.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import math
import pkgutil
from collections.abc import Callable

import kvstrata.bench as bench_pkg
from kvstrata.core.errors import ConfigError
from kvstrata.core.units import MAX_TOKENS, format_bytes
from kvstrata.report import command as report_command

# Limits of flags the scenarios share, checked before any scenario runs (ConfigError:
# one line, exit 2): torch's thread pool, torch.manual_seed, transformers' range.
FLAG_LIMITS: dict[str, tuple[float, float]] = {
    "threads": (1, 1024),
    "seed": (0, 2**64 - 1),
    "init_range": (0.0, 1.0),
}


def check_flags(args: argparse.Namespace) -> None:
    """ConfigError for a numeric flag that is not finite, outside FLAG_LIMITS, a count
    above 2**31 - 1, or a --size-mib larger than this machine's RAM."""
    from kvstrata.platform.hardware import machine_ram

    for name, value in vars(args).items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        flag = "--" + name.replace("_", "-")
        low, high = FLAG_LIMITS.get(name, (-math.inf, MAX_TOKENS))
        if not math.isfinite(value) or not low <= value <= high:
            bounds = f"from {_num(low)} to {_num(high)}" if low > -math.inf else f"<= {high:,}"
            raise ConfigError.field(name, value, f"{flag} takes a finite number {bounds}")
    size_mib = getattr(args, "size_mib", None)
    ram = machine_ram()
    if isinstance(size_mib, int) and ram and size_mib * 2**20 > ram // 2:
        raise ConfigError.field(
            "size_mib", size_mib, f"at most half of this machine's RAM ({format_bytes(ram)})"
        )


def _num(x: float) -> str:
    return f"{x:,}" if isinstance(x, int) else f"{x:g}"


def _checked(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    @functools.wraps(run)
    def checked(args: argparse.Namespace) -> int:
        check_flags(args)
        return run(args)

    return checked


def _scenarios() -> dict[str, object]:
    """The scenario modules of kvstrata.bench, and the evidence report (which runs them)."""
    found = {}
    names = [f"kvstrata.bench.{info.name}" for info in pkgutil.iter_modules(bench_pkg.__path__)]
    for name in [*names, report_command.__name__]:
        if name.rpartition(".")[2].startswith("_"):
            continue
        module = importlib.import_module(name)
        if hasattr(module, "NAME") and hasattr(module, "run"):
            found[module.NAME] = module
    return dict(sorted(found.items()))


def _run_all(args: argparse.Namespace) -> int:
    code = 0
    for name, module in _scenarios().items():
        if not getattr(module, "IN_ALL", True):  # e.g. the report, which runs the others
            continue
        print(f"\n=== kvstrata bench {name} ===")
        sub_args = argparse.Namespace(**vars(args))
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        for key, value in vars(parser.parse_args([])).items():
            setattr(sub_args, key, getattr(sub_args, key, value))
        code = max(code, int(_checked(module.run)(sub_args) or 0))
    return code


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("bench", help="benchmarks: ratios against a same-run baseline")
    scen = parser.add_subparsers(dest="scenario", metavar="SCENARIO")
    scen.required = True
    for name, module in _scenarios().items():
        p = scen.add_parser(name, help=module.HELP.replace("%", "%%"))  # argparse formats help
        module.add_arguments(p)
        p.set_defaults(func=_checked(module.run))
    p = scen.add_parser("all", help="run every scenario with its defaults")
    p.set_defaults(func=_run_all)
