"""What every section of one report run shares: sizes, threads, model, scratch space,
the progress callback and the sections measured so far."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstrata.report.scale import Scale

# --sections value that measures a section again: the planner needs the sections it compares
SECTION_NEEDS = {"planner": "strategy,context,planner"}


@dataclass
class Session:
    """One report run.

    Fields:
        scale: the sizes.
        threads: torch threads of the timed work.
        model: the model of the quality sections ("smollm2", "tiny" or a directory).
        model_note: why that model (e.g. the fallback from smollm2).
        workdir: scratch directory (disk tiers), removed after the run.
        tick: called with a label after each unit of work (the progress bar).
        command: the report command without --sections (captions add their section).
        data: section name -> its measured data, in run order.
    """

    scale: Scale
    threads: int
    model: str
    model_note: str
    workdir: Path
    tick: Callable[[str], None]
    command: str
    data: dict[str, Any] = field(default_factory=dict)

    def section_command(self, section: str) -> str:
        """The command that measures one section again (merged into the same --out); the
        planner compares the strategy and context sections' caches, so it runs with them."""
        return f"{self.command} --sections {SECTION_NEEDS.get(section, section)}"
