"""Markdown tables of report.md and their cells (markdown.py and the sections that
render their own)."""

from __future__ import annotations

from typing import Any


def table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def mib(num: float) -> str:
    return f"{num / 2**20:,.2f} MiB"
