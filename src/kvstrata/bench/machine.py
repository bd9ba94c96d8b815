"""The machine a report was measured on: cores, CPU, memory, accelerator, versions, load."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

_PACKAGES = ("kvstrata", "torch", "transformers", "numpy", "matplotlib")


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux, platform's guess elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def accelerator() -> str:
    """The CUDA device kvstrata would use ("none (CPU only)" without one)."""
    import torch

    if not torch.cuda.is_available():
        return "none (CPU only): the device tier is host RAM"
    props = torch.cuda.get_device_properties(0)
    return f"{props.name}, {props.total_memory / 2**30:.0f} GiB"


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def git_commit() -> str | None:
    """The checkout's commit (with "+dirty" when files differ), None outside a checkout."""
    root = Path(__file__).resolve().parents[3]  # src/kvstrata/bench/machine.py -> checkout
    if not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "--no-optional-locks", "status", "--porcelain", "-uno"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def describe(threads: int | None = None) -> dict[str, Any]:
    """What the numbers were measured on.

    Args:
        threads: torch threads the timed work used (None: the benchmark's servers
            chose their own).

    Returns:
        cores, CPU, RAM bytes, accelerator, OS, Python and package versions, commit,
        torch threads and the 1-minute load average now.
    """
    from kvstrata.bench._timing import machine_load
    from kvstrata.platform.hardware import machine_ram

    load, cores = machine_load()
    return {
        "cores": cores,
        "cpu": cpu_model(),
        "ram_bytes": machine_ram(),
        "accelerator": accelerator(),
        "os": f"{platform.system()} {platform.release()}",
        "python": sys.version.split()[0],
        "versions": {name: _version(name) for name in _PACKAGES},
        "commit": git_commit(),
        "threads": threads,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "load_before": load,
    }
