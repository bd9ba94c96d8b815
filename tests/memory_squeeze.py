"""A real `kvstrata serve` under a real memory cgroup that a second process squeezes
(tests/server/test_memory_squeeze.py; run as a script for a plot):

    .venv/bin/python tests/memory_squeeze.py --plot host-under-pressure.png

The server (embedded model, a host and a disk tier, host_pressure="auto") answers a
fixed list of greedy completions. Its first requests fill the host tier; then the
cgroup's limit is set to what the server uses plus `SLACK`, and a second process joins
the cgroup and allocates `SQUEEZE` (more than the slack: without the host tier giving
memory back, the kernel's OOM killer ends one of them), holds it, and exits, while the
requests go on. /metrics is scraped throughout: the host tier's budget and use, the room
the server reads and its decisions, over time. The same list on a server outside any
cgroup is the unsqueezed run the outputs are compared with.

Needs root and a writable memory cgroup hierarchy (v1 `/sys/fs/cgroup/memory`, or v2
with the memory controller delegated); `MemoryCgroup.create` says why not otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from serve_harness import ServeProcess  # noqa: E402

MIB = 1 << 20
HOST_BUDGET = 192 * MIB
HEADROOM = 96 * MIB
SLACK = 160 * MIB  # the limit: the most the warm server used + this
SQUEEZE = 224 * MIB  # what the second process takes (more than SLACK)
CHUNK = 8 * MIB  # ...this much every EVERY seconds
EVERY = 0.2
FLAGS = (
    "--block-size", "16", "--device-budget", "1MiB", "--host-budget", f"{HOST_BUDGET >> 20}MiB",
    "--disk-budget", "1GiB", "--host-pressure", "auto", "--host-headroom",
    f"{HEADROOM >> 20}MiB", "--threads", "1",
)  # fmt: skip
SQUEEZER = r"""
import mmap, os, sys, time
procs, total, chunk, every, hold = sys.argv[1], *map(float, sys.argv[2:6])
with open(procs, "w") as f:
    f.write(str(os.getpid()))
held = []
while sum(len(m) for m in held) < total:
    m = mmap.mmap(-1, int(chunk), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for i in range(0, len(m), 4096):
        m[i] = 1  # committed, charged to the cgroup
    held.append(m)
    print(time.time(), sum(len(m) for m in held), flush=True)
    time.sleep(every)
time.sleep(hold)
print(time.time(), 0, flush=True)
"""


class MemoryCgroup:
    """A memory cgroup of our own (v1 or v2): a limit, its use, its OOM kills."""

    def __init__(self, path: Path, v2: bool) -> None:
        self.path, self.v2 = path, v2

    @classmethod
    def create(cls, name: str) -> MemoryCgroup | str:
        """The new cgroup, or why none can be made here (a reason to skip)."""
        v1 = Path("/sys/fs/cgroup/memory")
        v2 = Path("/sys/fs/cgroup")
        if os.geteuid() != 0:
            return "memory cgroups need root"
        if (v1 / "memory.limit_in_bytes").exists():
            path, is_v2 = v1 / name, False
        elif (v2 / "cgroup.controllers").exists():
            path, is_v2 = v2 / name, True
            try:
                (v2 / "cgroup.subtree_control").write_text("+memory")
            except OSError as err:
                return f"cgroup v2 does not delegate the memory controller here ({err})"
        else:
            return "no memory cgroup hierarchy is mounted"
        try:
            path.mkdir()
        except OSError as err:
            return f"cannot create a memory cgroup ({err})"
        cg = cls(path, is_v2)
        if not (path / ("memory.max" if is_v2 else "memory.limit_in_bytes")).exists():
            cg.remove()
            return "the new cgroup has no memory limit file"
        for knob, value in (("memory.swappiness", "0"), ("memory.swap.max", "0")):
            if (path / knob).exists():  # no swap: the limit is RAM
                with contextlib.suppress(OSError):
                    (path / knob).write_text(value)
        return cg

    @property
    def procs(self) -> Path:
        return self.path / "cgroup.procs"

    def join(self) -> None:
        """Move the calling process in (a child's preexec_fn, before it execs)."""
        self.procs.write_text(str(os.getpid()))

    def set_limit(self, nbytes: int) -> None:
        self.path.joinpath("memory.max" if self.v2 else "memory.limit_in_bytes").write_text(
            str(nbytes)
        )

    def peak(self) -> int:
        """The most it used so far (v2 without memory.peak: now)."""
        name = "memory.peak" if self.v2 else "memory.max_usage_in_bytes"
        if not self.path.joinpath(name).exists():
            return self.usage()
        return int(self.path.joinpath(name).read_text())

    def usage(self) -> int:
        name = "memory.current" if self.v2 else "memory.usage_in_bytes"
        return int(self.path.joinpath(name).read_text())

    def oom_kills(self) -> int:
        name = "memory.events" if self.v2 else "memory.oom_control"
        for line in self.path.joinpath(name).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def remove(self) -> None:
        for _ in range(50):  # the last process may still be leaving
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def prompts() -> tuple[list[str], list[str], list[str]]:
    """(warm, during, after): the warm ones fill the host tier; the others repeat some
    of them (prefix hits, wherever their blocks went) between new ones."""
    rng = random.Random(53)

    def text() -> str:
        return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz (){}=:\n") for _ in range(2000))

    warm = [text() for _ in range(24)]
    during = [p for i in range(12) for p in (text(), warm[2 * i])]
    after = [p for i in range(6) for p in (text(), warm[4 * i + 1])]
    return warm, during, after


def complete(url: str, prompt: str) -> str:
    body = json.dumps({"prompt": prompt, "max_tokens": 12, "temperature": 0}).encode()
    request = urllib.request.Request(
        f"{url}/completions", body, {"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        out = json.load(response)
    return out["choices"][0]["text"]


def scrape(url: str) -> dict[str, float]:
    """The /metrics values this run follows."""
    with urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        for key, name in (
            ('kvstrata_tier_budget_bytes{tier="host"}', "host_budget"),
            ('kvstrata_tier_used_bytes{tier="host"}', "host_used"),
            ('kvstrata_tier_used_bytes{tier="disk"}', "disk_used"),
            ("kvstrata_host_pressure_available_bytes", "available"),
            ('kvstrata_host_pressure_decisions_total{choice="shrink"}', "shrinks"),
            ('kvstrata_host_pressure_decisions_total{choice="grow"}', "grows"),
            ("kvstrata_host_pressure_released_bytes_total", "released"),
        ):
            if line.startswith(key + " "):
                out[name] = float(line.rsplit(" ", 1)[1])
    return out


@dataclass
class Run:
    outputs: list[str] = field(default_factory=list)
    samples: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    squeezer: list[tuple[float, int]] = field(default_factory=list)  # (t, bytes held)
    squeezer_rc: int | None = None
    server_alive: bool = False
    oom_kills: int = 0
    limit: int = 0
    idle: int = 0  # the cgroup's use before the squeeze, and its peak
    peak: int = 0
    limit_at: float | None = None  # seconds into the run the limit was set
    start: float = 0.0
    error: str | None = None  # the first failed request


def run(workdir: Path, cgroup: MemoryCgroup | None = None, pressure: str = "auto") -> Run:
    """The request list on one server; squeezed when a cgroup is given (`pressure`:
    the server's --host-pressure; "off" is the control that ends in an OOM kill)."""
    warm, during, after = prompts()
    out = Run(start=time.time())
    server = ServeProcess(
        *FLAGS,
        "--disk-dir",
        str(workdir),
        "--host-pressure",
        pressure,
        preexec_fn=cgroup.join if cgroup else None,
    )
    stop = threading.Event()

    def scraper() -> None:
        while not stop.wait(0.1):
            with contextlib.suppress(OSError):
                out.samples.append((time.time() - out.start, scrape(server.url)))

    thread = threading.Thread(target=scraper, daemon=True)
    thread.start()
    squeezer = None

    def ask(phase: str, prompts: list[str]) -> None:
        if out.error is not None:
            return
        try:
            out.outputs += [complete(server.url, p) for p in prompts]
        except OSError as err:  # recorded (the server died?), never raised past cleanup
            out.error = f"{phase}: {type(err).__name__}: {err}"

    try:
        ask("warm", warm)
        if cgroup is not None and out.error is None:
            out.idle, out.peak = cgroup.usage(), cgroup.peak()
            out.limit = out.peak + SLACK  # a step's transient memory fits as before
            cgroup.set_limit(out.limit)
            out.limit_at = time.time() - out.start
            args = [str(cgroup.procs), str(SQUEEZE), str(CHUNK), str(EVERY), "3"]
            squeezer = subprocess.Popen(
                [sys.executable, "-c", SQUEEZER, *args], stdout=subprocess.PIPE, text=True
            )
        ask("during", during)
        if squeezer is not None:
            for line in squeezer.stdout:
                t, held = line.split()
                out.squeezer.append((float(t) - out.start, int(held)))
            out.squeezer_rc = squeezer.wait(60)
            time.sleep(1.0)  # the engine reads the freed memory (idle: every 0.1 s)
        ask("after", after)
        time.sleep(0.3)
        out.server_alive = server.proc.poll() is None
        out.oom_kills = cgroup.oom_kills() if cgroup is not None else 0
    finally:
        stop.set()
        thread.join(5)
        if squeezer is not None and squeezer.poll() is None:
            squeezer.kill()
            squeezer.wait()
        if server.proc.poll() is None:
            server.stop(signal.SIGTERM)
        else:
            tail = "".join(server.stderr[-3:]).strip().replace("\n", " | ")
            out.error = f"{out.error}; server exited {server.proc.returncode}: {tail}"
    return out


def plot(squeezed: Run, path: str) -> None:
    """The host tier's budget and use, the room read and the squeezer's memory."""
    from kvstrata.platform.plotting import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    t = [s[0] for s in squeezed.samples]
    for key, label in (
        ("host_budget", "host budget"),
        ("host_used", "host used"),
        ("available", "room read (limit - working set; off the top before the limit)"),
    ):
        width = 3 if key == "host_budget" else 1.5  # under "host used" where they meet
        ax.plot(t, [s[1].get(key, 0) / MIB for s in squeezed.samples], label=label, lw=width)
    if squeezed.squeezer:
        ax.step(
            [s[0] for s in squeezed.squeezer],
            [s[1] / MIB for s in squeezed.squeezer],
            where="post",
            label="second process's memory",
        )
    ax.axhline(HEADROOM / MIB, ls=":", c="gray", label="host_headroom")
    if squeezed.limit_at is not None:
        ax.axvline(squeezed.limit_at, ls="--", c="k", lw=0.8, label="cgroup limit set")
    ax.set_ylim(0, 1.5 * max(HOST_BUDGET, SQUEEZE, 2 * HEADROOM) / MIB)
    ax.set_xlabel("seconds")
    ax.set_ylabel("MiB")
    ax.set_title("host tier under a squeezed memory cgroup (host_pressure=auto)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plot", default=None, help="write the squeezed run's figure (PNG)")
    p.add_argument("--json", default=None, help="write both runs' samples and outputs")
    p.add_argument(
        "--control", action="store_true", help="also squeeze a server with --host-pressure off"
    )
    args = p.parse_args()
    runs: dict[str, Run] = {}
    with tempfile.TemporaryDirectory() as tmp:
        runs["free"] = run(Path(tmp) / "free")
        for name, pressure in (("squeezed", "auto"), ("control", "off"))[: 1 + args.control]:
            cgroup = MemoryCgroup.create(f"kvstrata-squeeze-{os.getpid()}-{name}")
            if isinstance(cgroup, str):
                sys.exit(f"memory_squeeze: {cgroup}")
            try:
                runs[name] = run(Path(tmp) / name, cgroup, pressure)
            finally:
                cgroup.remove()
    for name, r in runs.items():
        budgets = [s.get("host_budget", 0) for _, s in r.samples] or [0]
        print(
            f"{name}: {len(r.outputs)} outputs, equal to the free run's: "
            f"{r.outputs == runs['free'].outputs}; failed request: {r.error}; OOM kills "
            f"{r.oom_kills}; squeezer rc {r.squeezer_rc}; host budget min "
            f"{min(budgets) / MIB:.0f} MiB, last {budgets[-1] / MIB:.0f} MiB"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({k: r.__dict__ for k, r in runs.items()}))
    if args.plot:
        plot(runs["squeezed"], args.plot)


if __name__ == "__main__":
    main()
