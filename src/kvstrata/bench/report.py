"""`kvstrata bench report`: the evidence report — every scenario measured in one run,
written as DIR/report.md with PNG figures and the raw JSON.

    kvstrata bench report --quick --out docs/report     # <= 15 min on 2 cores
    kvstrata bench report --out report                  # the full run (bigger machines)
    kvstrata bench report --quick --sections context    # one figure again

Sections (`kvstrata.report`), each from the existing benchmarks' measuring code:
  strategy    all on device / offload to host / + int8 / + int4 / + disk: decode tok/s,
              device and stored KV bytes, ΔPPL, greedy agreement (real model if installed)
  resident    device share 1-100 % -> decode tok/s, one line per codec
  context     1k-32k tokens -> device KV bytes and step time, DynamicCache vs tiered
  block_size  16-512-token blocks -> tier read latency and GB/s
  codecs      bits per element -> attention error, ΔPPL, encode / decode GB/s
  prefix      time to first token cold / warm / after a restart
  serve       engine output tok/s at concurrency 1 / 4 / 8
  planner     kvstrata plan's bytes and step bound next to the measured ones
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kvstrata.errors import ConfigError

NAME = "report"
HELP = "evidence report: all scenarios in one run -> DIR/report.md, PNG figures, JSON"
IN_ALL = False  # `kvstrata bench all` runs the scenarios themselves
SECTIONS = ("strategy", "resident", "context", "block_size", "codecs", "prefix", "serve",
            "planner")  # fmt: skip
DEFAULT_OUT = "kvstrata-report"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick", action="store_true", help="the <= 15-minute run of a 2-core machine"
    )
    parser.add_argument(
        "--smoke", action="store_true", help="a seconds-long run that checks the pipeline "
        "(tests); its numbers mean nothing"
    )  # fmt: skip
    parser.add_argument("--out", default=DEFAULT_OUT, help="output directory (created)")
    parser.add_argument(
        "--model", default="auto", help="model of the strategy table: auto (smollm2 when "
        "installed, else the embedded one), smollm2, tiny or a model directory"
    )  # fmt: skip
    parser.add_argument(
        "--sections", default="all", help=f"comma-separated, of: {', '.join(SECTIONS)}"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads of the timed work (1: least "
        "distorted on a shared 2-core machine)"
    )  # fmt: skip


def _sections(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    if names == ["all"]:
        return list(SECTIONS)
    unknown = [n for n in names if n not in SECTIONS]
    if not names or unknown:
        raise ConfigError.field(
            "sections", text, f"'all' or comma-separated names of: {', '.join(SECTIONS)}"
        )
    if "planner" in names and not {"strategy", "context"} & set(names):
        raise ConfigError.field(
            "sections", text, "planner compares with the strategy or context section: add one"
        )
    return [s for s in SECTIONS if s in names]  # report order


def _scale(args: argparse.Namespace) -> Any:
    from kvstrata.report.scale import SCALES

    if args.quick and args.smoke:
        raise ConfigError.field("smoke", True, "give --quick or --smoke, not both")
    return SCALES["smoke" if args.smoke else "quick" if args.quick else "full"]


def choose_model(name: str) -> tuple[str, str]:
    """The strategy table's model and why: "auto" is smollm2 when its package is
    installed (converted on first use), else the embedded model."""
    if name != "auto":
        return name, ""
    from kvstrata.modelzoo import resolve_model_dir

    try:
        resolve_model_dir("smollm2")
    except ConfigError as exc:
        return "tiny", f"smollm2 unavailable ({exc}); the embedded model instead"
    return "smollm2", ""


def _command(args: argparse.Namespace, out: str | None) -> str:
    words = ["kvstrata bench report"]
    words += ["--quick"] if args.quick else ["--smoke"] if args.smoke else []
    if out is not None:
        words.append(f"--out {out}")
    if args.model != "auto":
        words.append(f"--model {args.model}")
    if args.threads != 1:
        words.append(f"--threads {args.threads}")
    return " ".join(words)


def _ticks(scale: Any, sections: list[str]) -> int:
    per = {"strategy": 3, "block_size": 2, "codecs": len(scale.codecs) + 1}
    return sum(per.get(name, 1) for name in sections)


@contextmanager
def _progress(total: int) -> Iterator[Callable[[str], None]]:
    """A progress bar on stderr (a line per step when stderr is not a terminal)."""
    from tqdm import tqdm

    start = time.perf_counter()
    with tqdm(total=total, desc="kvstrata bench report", unit="step", file=sys.stderr,
              disable=None, leave=True) as bar:  # fmt: skip
        done = [0]

        def tick(label: str) -> None:
            done[0] += 1
            if bar.disable:
                elapsed = time.perf_counter() - start
                print(f"kvstrata bench report: [{done[0]}/{total}] {label} ({elapsed:.0f} s)",
                      file=sys.stderr, flush=True)  # fmt: skip
            else:
                bar.set_postfix_str(label)
                bar.update(1)

        yield tick


def _measurers() -> dict[str, Callable[[Any], dict[str, Any]]]:
    from kvstrata.report import predicted, quality, sweeps, system

    return {
        "strategy": quality.strategy,
        "resident": sweeps.resident,
        "context": sweeps.context,
        "block_size": system.block_size,
        "codecs": quality.codecs,
        "prefix": system.prefix,
        "serve": system.serve,
        "planner": predicted.section,
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Measure the chosen sections; returns the report's data (JSON-able)."""
    from kvstrata.bench._timing import check_positive, machine_load
    from kvstrata.cli.generate import quiet_transformers
    from kvstrata.report.machine import describe
    from kvstrata.report.session import Session

    scale = _scale(args)
    sections = _sections(args.sections)
    check_positive(args, "threads")  # also here: measure() is callable on its own
    quiet_transformers()
    model, note = choose_model(args.model) if "strategy" in sections else (args.model, "")
    started = time.perf_counter()
    machine = describe(args.threads)
    command = _command(args, None)
    workdir = Path(tempfile.mkdtemp(prefix="kvstrata-report-"))
    measurers = _measurers()
    try:
        with _progress(_ticks(scale, sections)) as tick:
            session = Session(scale, args.threads, model, note, workdir, tick, command)
            for name in sections:
                session.data[name] = measurers[name](session)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    machine["load_after"] = machine_load()[0]
    return {
        "scenario": NAME,
        "command": _command(args, args.out),
        "scale": scale.name,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "seconds": time.perf_counter() - started,
        "machine": machine,
        "sections": session.data,
    }


def run(args: argparse.Namespace) -> int:
    """Measure, then write DIR/report.json, the figures and DIR/report.md."""
    from kvstrata.bench._timing import check_positive
    from kvstrata.report.figures import pyplot
    from kvstrata.report.output import write

    _scale(args)
    _sections(args.sections)
    check_positive(args, "threads")
    pyplot()  # a missing matplotlib fails now, not after the measurements
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError.field("out", args.out, f"cannot create it ({exc.strerror})") from exc
    report = measure(args)
    files = write(report, out)
    print(f"kvstrata bench report: {report['seconds'] / 60:.1f} min; wrote "
          f"{', '.join(str(f) for f in files)}")  # fmt: skip
    return 0
