"""The tables `kvstrata bench peer` prints: per KV size, each workload's round on each
server (wall time, tokens/s, TTFT / TPOT, prefix hits, agreement with vLLM's text), the
ratios to vLLM, and for kvstrata as vLLM's backend its own counters (hits by tier)."""

from __future__ import annotations

from typing import Any

from kvstrata.bench.peer import workloads as wl


def _ms(x: float | None) -> str:
    return "-" if x is None or x != x else f"{1000 * x:.0f}"


def _cached(row: dict[str, Any]) -> str:
    if row["cached_tokens"] is None:
        return "n/a"
    return f"{100 * row['cached_tokens'] / max(1, row['prompt_tokens']):.0f} %"


def _same(row: dict[str, Any]) -> str:
    a = row["agreement"]
    return "-" if a is None else f"{100 * a['identical']:.0f} % / {100 * a['prefix']:.0f} %"


def _size_title(report: dict[str, Any], size: str) -> str:
    kv, ws = report["sizes"][size]["kv"], report["working_set_tokens"]
    return (
        f"{size}: KV {kv['tokens']} tokens = {kv['bytes'] / 2**20:.0f} MiB (working set "
        f"{ws} tokens), {report['model']}, medians of {report['repeats']} repeat(s)"
    )


def _console() -> Any:
    """A rich console, 140 columns wide when the output is not a terminal (a log)."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=140)


def _table(console: Any, title: str, columns: list[str], rows: list[list[str]]) -> None:
    from rich.table import Table

    table = Table(title=title)
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i < 2 else "right", no_wrap=i < 2)
    for row in rows:
        table.add_row(*row)
    console.print(table)


def _print_size(console: Any, report: dict[str, Any], size: str) -> None:
    summary = report["sizes"][size]["summary"]
    ref = summary["reference"]
    rows = []
    for variant, phases in summary["variants"].items():
        for phase, r in phases.items():
            rows.append(
                [
                    phase,
                    variant,
                    f"{r['wall_s']:.2f}",
                    f"{r['output_tokens_per_s']:.1f}",
                    f"{_ms(r['ttft_p50_s'])} / {_ms(r['ttft_p99_s'])}",
                    f"{_ms(r['tpot_p50_s'])} / {_ms(r['tpot_p99_s'])}",
                    _cached(r),
                    f"{r['complete']}/{r['requests']}",
                    _same(r),
                ]
            )
    rows.sort(key=lambda row: list(summary["variants"][row[1]]).index(row[0]))
    _table(
        console,
        _size_title(report, size),
        [
            "workload",
            "variant",
            "wall s",
            "out tok/s",
            "TTFT p50/p99 ms",
            "TPOT p50/p99 ms",
            "prefix hits",
            "done",
            f"text = {ref}: same / prefix",
        ],
        rows,
    )
    others = [v for v in summary["variants"] if v != ref]
    if not others:
        return
    ratio_rows = []
    phases = list(summary["variants"][ref])
    for phase in phases:
        for key, label, lower in wl.RATIO_ROWS:
            cells = [summary["variants"][v][phase]["ratios"][key] for v in others]
            better = "lower is better" if lower else "higher is better"
            ratio_rows.append([f"{phase} {label}", better, *(f"{c:.2f}" for c in cells)])
    _table(console, f"{size}: ratio (variant ÷ {ref})", ["metric", "", *others], ratio_rows)
    _print_backend(console, summary, size)


BACKEND_COLUMNS = (
    ("lookups", "lookups"),
    ("hits{tier=host}", "host hits"),
    ("hits{tier=disk}", "disk hits"),
    ("misses", "misses"),
    ("disk_read_batches", "disk reads"),
    ("disk_no_room", "no host room"),
    ("corrupt_blocks", "corrupt"),
)


def _print_backend(console: Any, summary: dict[str, Any], size: str) -> None:
    """kvstrata's counters of the backend variants (vLLM's /metrics), blocks summed
    over the repeats."""
    rows = [
        [phase, variant, *(f"{r['kvstrata'].get(key, 0):.0f}" for key, _ in BACKEND_COLUMNS)]
        for variant, phases in summary["variants"].items()
        for phase, r in phases.items()
        if "kvstrata" in r
    ]
    if rows:
        columns = ["workload", "variant", *(label for _, label in BACKEND_COLUMNS)]
        _table(
            console,
            f"{size}: kvstrata under vLLM (its /metrics, blocks, all repeats)",
            columns,
            rows,
        )


def print_report(report: dict[str, Any]) -> None:
    console = _console()
    console.print(f"command: {report['command']}", highlight=False)
    for size in report["sizes"]:
        _print_size(console, report, size)
    notes = [
        "prompts are token ids; greedy; end-of-sequence ignored (every request generates "
        "its max_tokens); 'done' = requests that returned exactly that many tokens",
        "prefix hits = usage.prompt_tokens_details.cached_tokens / prompt tokens",
        "batching: each server's default (tokens per step: vLLM-CPU 2048, kvstrata serve "
        '512); align them with --kvstrata-args="--max-batched-tokens 2048"',
    ]
    notes += report["notes"]
    for size, result in report["sizes"].items():
        starts = ", ".join(f"{v} {s:.0f} s" for v, s in result["startup_s"].items())
        notes.append(f"{size} start-up (not timed): {starts}")
    if report["vllm_skipped"]:
        notes.append(f"vLLM side skipped: {report['vllm_skipped']}")
    notes.append(f"server logs: {report['log_dir']}")
    if report["machine_warning"]:
        notes.append(f"[yellow]{report['machine_warning']}[/yellow]")
    for note in notes:
        console.print(note, highlight=False)
