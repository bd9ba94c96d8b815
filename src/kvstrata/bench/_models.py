"""The model a server bench runs when none is named: smollm2 where its package is
installed, else the embedded tiny model (said in one line)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvstrata.core.errors import KvstrataError


def bench_model(name: str | None, say: Callable[[str], None]) -> tuple[str, Path]:
    """(name, directory) of `name`, or of the default: smollm2, else tiny."""
    from kvstrata.workload.zoo import EMBEDDED_NAMES, resolve_model_dir

    if name is not None:
        return name, resolve_model_dir(name)
    try:
        return "smollm2", resolve_model_dir("smollm2")
    except KvstrataError as exc:
        say(f"smollm2 is not available ({exc}); using the tiny embedded model")
        return EMBEDDED_NAMES[0], resolve_model_dir(EMBEDDED_NAMES[0])
