"""`kvstrata bench report`: the evidence report — every scenario measured in one run,
written as DIR/report.md with PNG figures and the raw JSON.

    kvstrata bench report --quick --out docs/report     # <= 15 min on 2 cores
    kvstrata bench report --out report                  # the full run (bigger machines)
    kvstrata bench report --quick --out docs/report --sections context
        # measures one section again and merges it into docs/report (same scale)

A section that fails is recorded as {"error": ...} (report.md says "section failed"), the
others still run, and the command exits 1 at the end; report.json is written after every
section, so a late crash keeps the sections measured before it.

Sections (`kvstrata.report`), each from the existing benchmarks' measuring code:
  strategy    all on device / offload to host / + int8 / + int4 / + disk: decode tok/s,
              device and stored KV bytes, ΔPPL, greedy agreement (real model if installed)
  resident    device share 1-100 % -> decode tok/s, one line per codec
  context     1k-32k tokens -> device KV bytes and step time, DynamicCache vs tiered
  block_size  16-512-token blocks -> tier read latency and GB/s
  codecs      bits per element -> attention error, ΔPPL, encode / decode GB/s
  compression modes that store or read fewer KV bytes, on real K/V: delta coding
              (disk_delta) -> bytes per token vs byte-plane zstd, encode / decode ms
  prefix      time to first token cold / warm / after a restart
  serve       engine output tok/s at concurrency 1 / 4 / 8
  planner     kvstrata plan's bytes and step bound next to the measured ones
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kvstrata.core.errors import ConfigError

NAME = "report"
HELP = "evidence report: all scenarios in one run -> DIR/report.md, PNG figures, JSON"
IN_ALL = False  # `kvstrata bench all` runs the scenarios themselves
SECTIONS = (
    "strategy",
    "resident",
    "context",
    "block_size",
    "codecs",
    "compression",
    "prefix",
    "serve",
    "planner",
)
DEFAULT_OUT = "kvstrata-report"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick", action="store_true", help="the <= 15-minute run of a 2-core machine"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a seconds-long run that checks the pipeline (tests); its numbers mean nothing",
    )
    parser.add_argument("--out", default=DEFAULT_OUT, help="output directory (created)")
    parser.add_argument(
        "--model",
        default="auto",
        help="model of the strategy and compression tables: auto "
        "(smollm2 when installed, else the embedded one), smollm2, tiny or a model directory",
    )
    parser.add_argument(
        "--sections", default="all", help=f"comma-separated, of: {', '.join(SECTIONS)}"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of the timed work (1: least distorted on a shared 2-core machine)",
    )


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
    """The strategy and compression tables' model and why: "auto" is smollm2 when its
    package is installed (converted on first use), else the embedded model.

    Raises:
        ConfigError: a named model that is not there (a flag error, before measuring).
    """
    from kvstrata.workload.zoo import resolve_model_dir

    if name != "auto":
        resolve_model_dir(name)
        return name, ""

    try:
        resolve_model_dir("smollm2")
    except ConfigError as exc:
        return "tiny", f"smollm2 unavailable ({exc}); the embedded model instead"
    return "smollm2", ""


def _scale_flag(scale: str) -> str:
    return {"quick": "--quick", "smoke": "--smoke"}.get(scale, "")


def _command(args: argparse.Namespace, with_sections: bool = True) -> str:
    """The command line of this run (--sections only when it is not every section)."""
    words = ["kvstrata bench report"]
    words += ["--quick"] if args.quick else ["--smoke"] if args.smoke else []
    words.append(f"--out {args.out}")
    if args.model != "auto":
        words.append(f"--model {args.model}")
    if args.threads != 1:
        words.append(f"--threads {args.threads}")
    sections = _sections(args.sections)
    if with_sections and sections != list(SECTIONS):
        words.append(f"--sections {','.join(sections)}")
    return " ".join(words)


def previous_report(args: argparse.Namespace) -> dict[str, Any] | None:
    """The report in --out that a run of some sections merges into (None: a run of
    every section, or no report there yet).

    Raises:
        ConfigError: --out holds a report.json that is not a report, or one of another
            scale (merging would mislabel the numbers).
    """
    if _sections(args.sections) == list(SECTIONS):
        return None
    path = Path(args.out) / "report.json"
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        usable = data.get("scenario") == NAME and isinstance(data.get("sections"), dict)
    except (OSError, ValueError, AttributeError):
        usable = False
    if not usable:
        raise ConfigError.field(
            "out",
            args.out,
            "its report.json is not a kvstrata report to merge --sections "
            "into: give an empty or new --out",
        )
    scale = _scale(args).name
    if data.get("scale") != scale:
        flag = _scale_flag(data.get("scale", "")) or "neither --quick nor --smoke"
        raise ConfigError.field(
            "out",
            args.out,
            f"it holds a {data.get('scale')}-scale report and --sections "
            f"merges into it at the same scale only: use {flag}, or give another --out",
        )
    return data


def _one_line(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _runs(previous: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The earlier runs recorded in a report (a report without "runs": its one run)."""
    if previous is None:
        return []
    if previous.get("runs"):
        return list(previous["runs"])
    return [
        {key: previous.get(key) for key in ("command", "date", "seconds")}
        | {"sections": list(previous["sections"])}
    ]


def _ticks(scale: Any, sections: list[str]) -> int:
    from kvstrata.report import compression

    per = {
        "strategy": 3,
        "block_size": 2,
        "codecs": len(scale.codecs) + 1,
        "compression": compression.ticks(scale),
    }
    return sum(per.get(name, 1) for name in sections)


@contextmanager
def _progress(total: int) -> Iterator[Callable[[str], None]]:
    """A progress bar on stderr (a line per step when stderr is not a terminal)."""
    from tqdm import tqdm

    start = time.perf_counter()
    with tqdm(
        total=total,
        desc="kvstrata bench report",
        unit="step",
        file=sys.stderr,
        disable=None,
        leave=True,
    ) as bar:
        done = [0]

        def tick(label: str) -> None:
            done[0] += 1
            if bar.disable:
                elapsed = time.perf_counter() - start
                print(
                    f"kvstrata bench report: [{done[0]}/{total}] {label} ({elapsed:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
            else:
                bar.set_postfix_str(label)
                bar.update(1)

        yield tick


def _measurers() -> dict[str, Callable[[Any], dict[str, Any]]]:
    from kvstrata.report import compression, predicted, quality, sweeps, system

    return {
        "strategy": quality.strategy,
        "resident": sweeps.resident,
        "context": sweeps.context,
        "block_size": system.block_size,
        "codecs": quality.codecs,
        "compression": compression.section,
        "prefix": system.prefix,
        "serve": system.serve,
        "planner": predicted.section,
    }


def measure(
    args: argparse.Namespace,
    previous: dict[str, Any] | None = None,
    save: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Measure the chosen sections; returns the report's data (JSON-able).

    Args:
        args: the command's flags.
        previous: a report to merge into (`previous_report`): its other sections are kept.
        save: called with the report so far after every section (report.json).

    A section that raises is recorded as {"error": one line, "traceback": ...}; the
    others still run. The report's "failed" lists this run's failed sections.
    """
    from kvstrata.bench._timing import check_positive, machine_load
    from kvstrata.bench.machine import describe
    from kvstrata.report.session import Session
    from kvstrata.workload.zoo import quiet_transformers

    started = time.perf_counter()  # the minutes reported include loading the model
    scale = _scale(args)
    sections = _sections(args.sections)
    check_positive(args, "threads")  # also here: measure() is callable on its own
    quiet_transformers()
    # the strategy table's model, and the compression section's where the scale leaves
    # it to the report
    uses_model = "strategy" in sections or (
        "compression" in sections and scale.compression_model is None
    )
    model, note = choose_model(args.model) if uses_model else (args.model, "")
    machine = describe(args.threads)
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    # "sections": those this run measured (appended as each finishes); "errors": why
    # the others failed
    run_entry: dict[str, Any] = {
        "command": _command(args),
        "date": date,
        "seconds": 0.0,
        "sections": [],
        "failed": [],
        "errors": {},
    }
    runs = [*_runs(previous), run_entry]
    workdir = Path(tempfile.mkdtemp(prefix="kvstrata-report-"))
    measurers = _measurers()

    def report() -> dict[str, Any]:
        run_entry["seconds"] = time.perf_counter() - started
        data = session.data
        return {
            "scenario": NAME,
            "command": run_entry["command"],
            "scale": scale.name,
            "date": date,
            "seconds": run_entry["seconds"],
            "machine": machine,
            "runs": runs,
            "failed": list(run_entry["failed"]),
            "sections": {name: data[name] for name in SECTIONS if name in data},
        }

    try:
        with _progress(_ticks(scale, sections)) as tick:
            session = Session(
                scale, args.threads, model, note, workdir, tick, _command(args, with_sections=False)
            )
            # earlier sections stay (and the planner compares their caches too)
            session.data.update((previous or {}).get("sections", {}))
            for name in sections:
                try:
                    session.data[name] = measurers[name](session)
                except Exception as exc:  # the other sections still run
                    run_entry["failed"].append(name)
                    run_entry["errors"][name] = _one_line(exc)
                    earlier = session.data.get(name)
                    if not earlier or "error" in earlier:  # never lose an earlier measurement
                        session.data[name] = {
                            "error": _one_line(exc),
                            "traceback": traceback.format_exc(),
                            "command": session.section_command(name),
                        }
                else:
                    run_entry["sections"].append(name)
                    _mark_stale_planner(session.data, sections, name)
                if save is not None:
                    save(report())
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    machine["load_after"] = machine_load()[0]
    run_entry["load"] = [machine["load_before"], machine["load_after"]]
    return report()


def _mark_stale_planner(data: dict[str, Any], sections: list[str], measured: str) -> None:
    """A planner section of an earlier run compares caches that `measured` replaced."""
    planner = data.get("planner")
    if measured in ("strategy", "context") and planner and "planner" not in sections:
        planner["stale"] = (
            f"its {measured} cases are from an earlier run than the {measured} section above; "
            f"`{planner['command']}` compares the new ones"
        )


def run(args: argparse.Namespace) -> int:
    """Measure, then write DIR/report.json, the figures and DIR/report.md."""
    from kvstrata.bench._timing import check_positive
    from kvstrata.report.figures import pyplot
    from kvstrata.report.output import write, write_json

    _scale(args)
    _sections(args.sections)
    check_positive(args, "threads")
    pyplot()  # a missing matplotlib fails now, not after the measurements
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError.field("out", args.out, f"cannot create it ({exc.strerror})") from exc
    previous = previous_report(args)
    report = measure(args, previous, save=lambda data: write_json(data, out))
    files = write(report, out)
    merged = f" (merged into the report of {report['runs'][0]['date']})" if previous else ""
    print(
        f"kvstrata bench report: {report['seconds'] / 60:.1f} min; wrote "
        f"{', '.join(str(f) for f in files)}{merged}"
    )
    kept = " (the earlier run's data is kept)" if previous else ""
    for name in report["failed"]:
        print(
            f"kvstrata bench report: section {name} failed: "
            f"{report['runs'][-1]['errors'][name]}{kept}",
            file=sys.stderr,
        )
    return 1 if report["failed"] else 0
