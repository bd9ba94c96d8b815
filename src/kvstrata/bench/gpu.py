"""`kvstrata bench gpu`: the CUDA path measured on one GPU, one JSON report.

Run by scripts/gpu_check.sh (which first runs the gpu-marked tests and passes their
JUnit XML in with --tests-junit). Sections, each isolated (an error is reported in
its section and fails the run, the others still run):

1. links: host<->device copy GB/s, pinned and pageable, both directions (medians of
   CUDA-synchronised copies of --copy-mib), next to the `--link` preset of
   kvstrata.platform.hardware the planner and the LinkModel assume.
2. memory: peak `torch.cuda.max_memory_allocated` during decode above what was
   allocated before the cache existed — the KV working set: device tier + staging +
   transients — at each --memory-contexts with a fixed device budget and staging
   size; it must be flat (and close to budget + staging), where DynamicCache grows
   with the context.
3. decode: tok/s at each --contexts with --fractions of the context resident on the
   device and the rest on the (pinned) host, raw and through each --codecs over the
   link, next to DynamicCache at the same context; per variant the bytes that
   crossed PCIe per step, the step time against its PCIe bound (those bytes /
   the measured pinned H2D GB/s), the stall / hidden fractions of the staging loads,
   the attention kernel and how many times the fused Triton dequant ran
   (`fused_dequant`: kernel launches, counted). Greedy tokens are
   compared with DynamicCache's: the share that agree and the length of the equal
   prefix (once they diverge the rest differs; bf16 and int4 need not be identical —
   exactness in fp32 is what the gpu-marked tests check).

On CUDA the run is not ok unless the fused dequant was usable throughout: Triton
installed, the kernel never disabled, its gpu-marked tests not skipped, and every
variant with an int8 / int4 / fp8 host codec decoded by it at least once.

Model: a Llama slice (8 layers, hidden 2048, 16 query / 8 KV heads of 128, vocab 259:
32 KiB of bf16 KV per token, 2 GiB at 64k), random init. --budget-s bounds the run:
measurements not started by then are listed as skipped. With --out the report is
rewritten (temporary file, then rename) after every section and every measured row,
so a run killed by a timeout keeps what it measured (scripts/gpu_check.sh then marks
it with `mark_timed_out`). `--quick --device cpu` runs the whole harness at toy sizes
on the CPU (the tests do, to keep it working).

This module is the scenario (options, the run, the report file); the harness is in
_gpu_setup, the sections in _gpu_sections, the report's GPU-free parts in _gpu_report.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvstrata.bench._gpu_report import fused_dequant_problems, junit_summary, print_summary
from kvstrata.bench._gpu_sections import decode, environment, links, memory
from kvstrata.bench._gpu_setup import (
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
    """Run every section; see the module docstring. `save(report)` is called after
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
