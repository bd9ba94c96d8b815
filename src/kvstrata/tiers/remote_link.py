"""The remote tier's link model: is loading these blocks faster than recomputing them?

Kept up to date from what really happens, never from a datasheet:

- latency: the round trip of a small request (PING at start and when stale, and small
  reads), an exponentially weighted average;
- bandwidth: bytes per second of real reads beyond that latency (a read includes
  checking and installing the blocks, so the figure is what a hit costs end to end);
- compute: prompt tokens per second of this store's own prefill steps.

`predict_load(bytes)` = latency + bytes / bandwidth; `predict_recompute(tokens)` =
tokens / compute. A load is chosen when it is predicted faster, or when there is not
yet a figure to compare (a new store: loading is the usual winner, and its measured
cost teaches the model). `worth_loading` counts its decisions.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

ALPHA = 0.3  # weight of a new sample in the moving averages
MIN_COMPUTE_TOKENS = 32  # steps with fewer new tokens (decode) do not measure prefill
# Re-measure a link the model keeps choosing against this often (one real read), so
# a server that got fast again is used again.
EXPLORE_S = 30.0


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else (1 - ALPHA) * old + ALPHA * new


@dataclass
class LinkModel:
    """Latency, bandwidth and compute speed, and the load-or-recompute rule."""

    latency_s: float | None = None
    bytes_per_s: float | None = None
    compute_tok_s: float | None = None
    decisions_load: int = 0
    decisions_recompute: int = 0
    last_read: float = 0.0  # time.monotonic() of the last measured read

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def observe_ping(self, elapsed: float) -> None:
        with self._lock:
            self.latency_s = _ewma(self.latency_s, elapsed)

    def observe_read(self, elapsed: float, nbytes: int) -> None:
        """A read of `nbytes` took `elapsed` seconds (a read past its deadline counts
        as latency, nbytes=0: it cost at least that, and delivered nothing)."""
        with self._lock:
            self.last_read = time.monotonic()
            if self.latency_s is None or nbytes < 64 << 10:
                self.latency_s = _ewma(self.latency_s, elapsed)
                return
            # a read is never credited with more than 4x its own speed
            beyond = max(elapsed - self.latency_s, 0.25 * elapsed, 1e-9)
            self.bytes_per_s = _ewma(self.bytes_per_s, nbytes / beyond)

    def observe_compute(self, tokens: int, elapsed: float) -> None:
        if tokens >= MIN_COMPUTE_TOKENS and elapsed > 0:
            with self._lock:
                self.compute_tok_s = _ewma(self.compute_tok_s, tokens / elapsed)

    def predict_load(self, nbytes: int) -> float | None:
        if self.latency_s is None:
            return None
        if self.bytes_per_s is None:
            return self.latency_s
        return self.latency_s + nbytes / self.bytes_per_s

    def predict_recompute(self, tokens: int) -> float | None:
        return None if self.compute_tok_s is None else tokens / self.compute_tok_s

    def worth_loading(self, nbytes: int, tokens: int) -> bool:
        """Load `nbytes` of blocks instead of recomputing `tokens` tokens? (Counted.)"""
        load, recompute = self.predict_load(nbytes), self.predict_recompute(tokens)
        stale = time.monotonic() - self.last_read > EXPLORE_S and self.last_read > 0
        use = load is None or recompute is None or load < recompute or stale
        if use:
            self.decisions_load += 1
        else:
            self.decisions_recompute += 1
        return use

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "latency_ms": None if self.latency_s is None else self.latency_s * 1e3,
            "bandwidth_mb_s": None if self.bytes_per_s is None else self.bytes_per_s / 1e6,
            "compute_tok_s": self.compute_tok_s,
            "decisions_load": self.decisions_load,
            "decisions_recompute": self.decisions_recompute,
        }
