"""What `kvstrata bench fleet` prints, writes and draws: one row per policy (TTFT
percentiles, throughput, where the prompt tokens were found, answers equal to the first
policy's), the ratios against round_robin, the figure."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

SOURCES = ("device", "host", "disk", "remote", "recomputed")


def ratios(report: dict[str, Any]) -> dict[str, float]:
    """TTFT p90 of round_robin over each other policy's (how many times lower), and of
    round_robin over round_robin+remote (what the shared tier buys without routing)."""
    pols = report["policies"]
    out: dict[str, float] = {}
    if "round_robin" not in pols:
        return out
    base = pols["round_robin"]["measured"]["ttft_p90_s"]
    for name, p in pols.items():
        if name != "round_robin":
            mine = p["measured"]["ttft_p90_s"]
            out[f"ttft_p90 round_robin / {name}"] = base / mine if mine > 0 else math.nan
    return out


def shares(sources: dict[str, float]) -> dict[str, float]:
    """Each source's share of the phase's prompt tokens (0-1)."""
    total = sum(sources.values())
    return {k: (sources.get(k, 0.0) / total if total else 0.0) for k in SOURCES}


def _s(x: float) -> str:
    return "-" if x != x else f"{x:.2f}"


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=150)
    w = report["workload"]
    title = (
        f"{report['replicas']} replicas of {report['model']} behind vllm-router: "
        f"{w['tenants']} tenants x {w['prompt_tokens']}-token prompts, {w['requests']} "
        f"requests at {w['rate']}/s (Poisson), each replica holding "
        f"{report['budgets']['hold_tenants']} tenants"
    )
    table = Table(title=title)
    columns = ["policy", "TTFT p50 s", "p90 s", "p99 s", "req/s", "out tok/s"]
    columns += [f"{s} %" for s in SOURCES] + ["per replica", "errors", "text = first"]
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right", no_wrap=i == 0)
    for name, p in report["policies"].items():
        m = p["measured"]
        share = shares(m["sources"])
        same = report["texts"].get(name)
        text = "-" if same is None else f"{same['equal']}/{same['equal'] + same['differ']}"
        table.add_row(
            name,
            _s(m["ttft_p50_s"]),
            _s(m["ttft_p90_s"]),
            _s(m["ttft_p99_s"]),
            _s(m["requests_per_s"]),
            _s(m["output_tokens_per_s"]),
            *(f"{100 * share[s]:.0f}" for s in SOURCES),
            "/".join(f"{n:.0f}" for n in m["per_replica"]),
            str(m["errors"]),
            text,
        )
    console.print(table)
    for key, value in report["ratios"].items():
        console.print(f"{key}: {value:.2f}x")
    if report.get("machine_warning"):
        console.print(f"warning: {report['machine_warning']}")
    for error in report["errors"]:
        console.print(f"error: {error}")


def failures(report: dict[str, Any]) -> list[str]:
    """One line per failed request count, per differing text, per policy left out."""
    out = list(report["errors"])
    for name, p in report["policies"].items():
        for phase in ("warmup", "measured"):
            if p[phase]["errors"]:
                out.append(f"{name}: {p[phase]['errors']} {phase} request(s) failed")
    for name, same in report["texts"].items():
        if same["differ"]:
            out.append(f"{name}: {same['differ']} answer(s) differ from {same['against']}'s")
    return out


def plot(report: dict[str, Any], path: Path) -> None:
    """TTFT p50 / p90 per policy, and where each policy's prompt tokens came from."""
    from kvstrata.platform.plotting import pyplot

    plt = pyplot()
    names = list(report["policies"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    xs = range(len(names))
    for offset, key, label in ((-0.2, "ttft_p50_s", "p50"), (0.2, "ttft_p90_s", "p90")):
        values = [report["policies"][n]["measured"][key] for n in names]
        left.bar([x + offset for x in xs], values, width=0.4, label=label)
    left.set_xticks(list(xs), names, rotation=20, ha="right")
    left.set_ylabel("time to first token (s)")
    left.legend()
    bottom = [0.0] * len(names)
    for source in SOURCES:
        values = [100 * shares(report["policies"][n]["measured"]["sources"])[source] for n in names]
        right.bar(list(xs), values, bottom=bottom, label=source)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    right.set_xticks(list(xs), names, rotation=20, ha="right")
    right.set_ylabel("prompt tokens (%)")
    right.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(f"{report['replicas']} kvstrata serve replicas behind vllm-router")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
