"""`kvstrata bench gpu`'s command: its flags, the run of every section into one report
(saved after each section and row) and `mark_timed_out` for scripts/gpu_check.sh. What
it measures: the package docstring (kvstrata.bench.gpu)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvstrata.bench.gpu.report import fused_dequant_problems, junit_summary, print_summary
from kvstrata.bench.gpu.sections import decode, environment, links, memory
from kvstrata.bench.gpu.setup import (
    DTYPES,
    Budget,
    build_model,
    checked_device,
    prefill,
    run_section,
    settings,
)

NAME = "gpu"
HELP = (
    "CUDA: pinned/pageable link GB/s, flat device KV peak, decode tok/s at 8k-64k "
    "(100/25/10 % resident, raw and int4 over the link) vs the PCIe bound"
)
IN_ALL = False  # needs a GPU (`bench all` runs on CPU machines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device", default="cuda", help="cuda (default), cuda:N, or cpu (a --quick smoke run)"
    )
    parser.add_argument("--quick", action="store_true", help="toy sizes (CPU smoke runs)")
    parser.add_argument("--contexts", default=None, help="decode contexts (8k,32k,64k)")
    parser.add_argument("--fractions", default="1,0.25,0.1", help="resident fractions")
    parser.add_argument("--codecs", default=None, help="host codecs over the link (none,int4)")
    parser.add_argument("--memory-contexts", default=None, help="peak-memory contexts")
    parser.add_argument("--steps", type=int, default=None, help="decode steps per repeat (24)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats (3)")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="model dtype")
    parser.add_argument("--link", default="pcie5", help="link preset to compare with (pcie5)")
    parser.add_argument("--copy-mib", type=int, default=None, help="MiB per copy (256)")
    parser.add_argument(
        "--budget-s", type=float, default=300.0, help="start no measurement after this many s"
    )
    parser.add_argument("--tests-junit", default=None, help="pytest JUnit XML to include")
    parser.add_argument("--out", default=None, help="write the JSON report to this file")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a summary")


# -- the report ---------------------------------------------------------------------------------
def measure(
    args: argparse.Namespace, save: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """Run every section; see the package docstring. `save(report)` is called after
    every section and measured row (the report so far)."""
    device = checked_device(args)
    s = settings(args)
    budget = Budget(args.budget_s)
    report: dict[str, Any] = {"scenario": NAME, "ok": True, "quick": args.quick}
    report["settings"] = {k: (str(v) if k == "dtype" else v) for k, v in s.items()}

    def checkpoint() -> None:
        report["skipped"] = list(budget.skipped)
        report["elapsed_s"] = budget.elapsed
        if save is not None:
            save(report)

    measured: dict[str, list] = {}  # a section's rows so far

    def rows_so_far(name: str) -> Callable[[list], None]:
        def on_row(rows: list) -> None:
            measured[name] = list(rows)
            report[name] = {"rows": measured[name], "partial": True}
            checkpoint()

        return on_row

    def section(name: str, fn: Callable[[], Any]) -> None:
        run_section(report, name, fn)
        if "error" in report[name] and measured.get(name):  # keep what it measured
            report[name]["rows"] = measured[name]
        checkpoint()

    if args.tests_junit:
        section("tests", lambda: junit_summary(args.tests_junit))
        tests = report["tests"]
        if "error" in tests or tests["failures"] or tests["errors"] or not tests["tests"]:
            report["ok"] = False
        elif tests["skipped"] == tests["tests"] and device.type == "cuda":
            report["ok"] = False  # nothing ran: e.g. the tests' process saw no GPU
            report["tests"]["note"] = "every test was skipped"
    section("environment", lambda: environment(device, s))
    section("links", lambda: links(device, s, args.link))
    pinned = (report["links"].get("pinned") or {}) if "error" not in report["links"] else {}
    pageable = report["links"].get("pageable") or {}
    h2d = (pinned.get("h2d") or pageable.get("h2d") or {}).get("gbs", 0.0)
    model = build_model(s, device)
    cached: dict[int, tuple] = {}

    def prefills(ctx: int) -> tuple:
        if ctx not in cached:
            cached.clear()  # one context's K/V at a time in host RAM
            cached[ctx] = prefill(model, ctx)
        return cached[ctx]

    section(
        "memory", lambda: memory(model, device, s, prefills, budget, None, rows_so_far("memory"))
    )
    mem = report["memory"]
    if "rows" in mem and not mem["flat"]:
        report["ok"] = False
    section(
        "decode", lambda: decode(model, device, s, prefills, h2d, budget, rows_so_far("decode"))
    )
    from kvstrata.attention import device as device_attention
    from kvstrata.codecs import triton_dequant

    if "error" not in report["environment"]:  # a kernel that failed during the run
        report["environment"]["fused_dequant_disabled"] = triton_dequant.disabled
        report["environment"]["fused_dequant_runs"] = triton_dequant.runs
        report["environment"]["attention_fallbacks"] = dict(device_attention.fallbacks)
    problems = fused_dequant_problems(device, report)
    if problems:
        report["ok"] = False
        report["fused_dequant_problems"] = problems
    checkpoint()
    return report


def write_report(path: str | Path, report: dict[str, Any]) -> None:
    """Write the JSON report atomically: a temporary file next to it, then a rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def mark_timed_out(out: str, junit: str | None = None, *parts: str) -> None:
    """What scripts/gpu_check.sh runs when a timeout killed the tests or the benchmark
    (`parts`: "tests", "bench"): the report as last saved (every finished section and
    measured row), or a new one, with the tests' summary, "timed_out": true and
    "ok": false."""
    try:
        report = json.loads(Path(out).read_text())
    except (OSError, ValueError):
        report = {"scenario": NAME}
    if junit and "tests" not in report:
        try:
            report["tests"] = junit_summary(junit)
        except Exception as err:  # killed before pytest wrote it
            report["tests"] = {"error": f"{type(err).__name__}: {err}"}
    report.update(ok=False, timed_out=True, timed_out_in=list(parts) or ["bench"])
    write_report(out, report)


def run(args: argparse.Namespace) -> int:
    """Measure, write/print the report. Exit 1 when a section failed, a test failed,
    the device KV peak was not flat or (on CUDA) the fused dequant did not cover the
    run."""
    save = (lambda report: write_report(args.out, report)) if args.out else None
    report = measure(args, save)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print_summary(report)
    for problem in report.get("fused_dequant_problems", []):
        print(f"kvstrata bench gpu: fused dequant: {problem}", file=sys.stderr)
    return 0 if report["ok"] else 1
