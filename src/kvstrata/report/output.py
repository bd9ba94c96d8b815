"""Write a measured report: DIR/report.json (the data), the PNG figures drawn from it
and DIR/report.md. Nothing here measures: rendering the same data twice gives the same
files, and different data gives different ones."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvstrata.report import figures, markdown


def write(report: dict[str, Any], out: Path) -> list[Path]:
    """Write the JSON, the figures and the Markdown of `report` into `out` (created).

    Args:
        report: the run's data (`kvstrata.report.command.measure`).
        out: the output directory.

    Returns:
        The files written: report.json, the figures, report.md.
    """
    written = [write_json(report, out)]
    # a failed section ({"error": ...}) has no figure: report.md says it failed
    sections = {name: d for name, d in report["sections"].items() if "error" not in d}
    captions: dict[str, tuple[str, str]] = {}
    for name, (file, draw) in figures.FIGURES.items():
        if name in sections:
            captions[name] = (file, draw(sections[name], out / file))
            written.append(out / file)
    if "prefix" in sections or "serve" in sections:
        file = figures.SERVING_FIGURE
        caption = figures.draw_serving(sections.get("prefix"), sections.get("serve"), out / file)
        captions["serving"] = (file, caption)
        written.append(out / file)
    md = out / "report.md"
    md.write_text(markdown.render(report, captions))
    written.append(md)
    return written


def write_json(report: dict[str, Any], out: Path) -> Path:
    """Write DIR/report.json (whole: a new file replaces the old one), created `out`."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "report.json"
    tmp = out / "report.json.tmp"
    tmp.write_text(json.dumps(report, indent=2, default=_json_default) + "\n")
    tmp.replace(path)
    return path


def _json_default(value: Any) -> Any:
    """Tuples, paths and numpy / torch scalars in the data."""
    if isinstance(value, Path):
        return str(value)
    item = getattr(value, "item", None)
    if callable(item):
        return item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
