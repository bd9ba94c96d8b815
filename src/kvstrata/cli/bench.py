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
import importlib
import pkgutil

import kvstrata.bench as bench_pkg


def _scenarios() -> dict[str, object]:
    found = {}
    for info in sorted(pkgutil.iter_modules(bench_pkg.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"kvstrata.bench.{info.name}")
        if hasattr(module, "NAME") and hasattr(module, "run"):
            found[module.NAME] = module
    return found


def _run_all(args: argparse.Namespace) -> int:
    code = 0
    for name, module in _scenarios().items():
        print(f"\n=== kvstrata bench {name} ===")
        sub_args = argparse.Namespace(**vars(args))
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        for key, value in vars(parser.parse_args([])).items():
            setattr(sub_args, key, getattr(sub_args, key, value))
        code = max(code, int(module.run(sub_args) or 0))
    return code


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("bench", help="benchmarks: ratios against a same-run baseline")
    scen = parser.add_subparsers(dest="scenario", metavar="SCENARIO")
    scen.required = True
    for name, module in _scenarios().items():
        p = scen.add_parser(name, help=module.HELP.replace("%", "%%"))  # argparse formats help
        module.add_arguments(p)
        p.set_defaults(func=module.run)
    p = scen.add_parser("all", help="run every scenario with its defaults")
    p.set_defaults(func=_run_all)
