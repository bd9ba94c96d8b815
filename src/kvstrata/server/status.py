"""A live one-line status of a serving engine on stderr, refreshed every second:

    kvstrata-code-tiny: running 3 · waiting 1 · preempted 0 · 812 tok/s ·
    device 12/16 · host 3/64 blocks · prefix hits 1,024 tok

redrawn in place on a terminal (rich Live), else printed as a new line (`--status`). Its
own thread reads `Engine.stats()` and the generated-token counter: nothing waits for it.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

GENERATED = "kvstrata_generation_tokens_total"


def status_text(name: str, stats: dict[str, Any], tokens_per_s: float) -> str:
    """The status line (plain text) of one `Engine.stats()` snapshot."""
    parts = [
        f"{name}:",
        f"running {stats.get('running', 0)}",
        f"waiting {stats.get('waiting', 0)}",
        f"preempted {stats.get('preempted', 0)}",
        f"{tokens_per_s:,.0f} tok/s",
    ]
    store = stats.get("store") or {}
    if store.get("initialized"):
        tiers = [
            f"{tier} {occ['used_blocks']}/{occ['budget_blocks']}"
            for tier, occ in store["tiers"].items()
        ]
        parts.append(" · ".join(tiers) + " blocks")
        hits = store.get("prefix", {}).get("hit_tokens", 0)
        parts.append(f"prefix hits {hits:,} tok")
    return parts[0] + " " + " · ".join(parts[1:])


class StatusLine:
    """Shows `status_text` of the serving engine on stderr, refreshed every `interval`
    seconds, until stop()."""

    def __init__(self, engine: Any, name: str, interval: float = 1.0) -> None:
        self.engine = engine
        self.name = name
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstrata-status", daemon=True)
        self._live: Any = None

    def start(self) -> StatusLine:
        from rich.console import Console
        from rich.live import Live

        console = Console(stderr=True)
        if console.is_terminal:
            self._live = Live(
                console=console, auto_refresh=False, transient=True, redirect_stdout=False
            )
            self._live.start()
        self._thread.start()
        return self

    def _show(self, line: str) -> None:
        if self._live is None:
            print(line, file=sys.stderr, flush=True)
            return
        from rich.text import Text

        self._live.update(Text(line, no_wrap=True, overflow="ellipsis"), refresh=True)

    def _generated(self) -> float:
        return float(self.engine.metrics.value(GENERATED))

    def _run(self) -> None:
        last_tokens, last_time = self._generated(), time.monotonic()
        while True:
            tokens, now = self._generated(), time.monotonic()
            rate = (tokens - last_tokens) / max(now - last_time, 1e-9)
            last_tokens, last_time = tokens, now
            line = status_text(self.name, self.engine.stats(), rate)
            self._show(line)
            if self._stop.wait(self.interval):
                return

    def stop(self) -> None:
        """Stop refreshing and clear the line. Idempotent."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self._live is not None:
            self._live.stop()
            self._live = None
