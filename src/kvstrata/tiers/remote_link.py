"""The remote tier's link model: is loading these blocks faster than recomputing them,
and how long may a read of them take?

Kept up to date from what really happens, never from a datasheet:

- latency: the round trip of a small request (PING, small reads, and a read cut at
  its deadline: it cost at least that), an exponentially weighted average;
- bandwidth: bytes per second of real reads beyond that latency (the start-up probe,
  the background re-measures, then every read);
- compute: prompt tokens per second of this process's own prefill steps.

`predict_load(bytes)` = latency + bytes / bandwidth; `predict_recompute(tokens)` =
tokens / compute. `worth_loading` chooses a load when it is predicted faster, or when
there is not yet a figure to compare (a new store: loading is the usual winner, and
its measured cost teaches the model); it counts its decisions and keeps the figures of
the last one (what the metrics show). A refused link is never re-measured with a
request's own read: the tier re-measures it in the background (`needs_measure`).

`deadline(bytes, tokens, floor)`: how long a read may take before it is abandoned —
MARGIN x its predicted load, at least PATIENCE x the predicted recompute (a load that
slow still wins), never more than the whole recompute, never less than `floor`
(remote_timeout).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

ALPHA = 0.3  # weight of a new sample in the moving averages
MIN_COMPUTE_TOKENS = 32  # steps with fewer new tokens (decode) do not measure prefill
# A read may take MARGIN times its predicted load: the bandwidth figure can come from
# a quiet moment (the start-up probe), and a read on busy cores was seen several times
# slower (docs/MEASUREMENTS.md).
MARGIN = 8.0
PATIENCE = 0.25  # ...and at least this share of the recompute it saves (still a 4x win)
# A link the model has not measured for this long is re-measured in the background
# (a PING and a probe read) when a lookup consults it.
REMEASURE_S = 5.0


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
    last_measure: float = 0.0  # time.monotonic() of the last ping or read measured
    # the figures of the last decision (None: not known then)
    last_load_s: float | None = None
    last_recompute_s: float | None = None
    last_deadline_s: float | None = None

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def observe_ping(self, elapsed: float) -> None:
        with self._lock:
            self.last_measure = time.monotonic()
            self.latency_s = _ewma(self.latency_s, elapsed)

    def observe_read(self, elapsed: float, nbytes: int) -> None:
        """A read of `nbytes` took `elapsed` seconds (a read past its deadline counts
        as latency, nbytes=0: it cost at least that, and delivered nothing)."""
        with self._lock:
            self.last_measure = time.monotonic()
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

    def needs_measure(self) -> bool:
        """Not measured for REMEASURE_S (or never)."""
        return time.monotonic() - self.last_measure > REMEASURE_S

    def worth_loading(self, nbytes: int, tokens: int) -> bool:
        """Load `nbytes` of blocks instead of recomputing `tokens` tokens? (Counted, and
        the predictions compared kept as last_load_s / last_recompute_s.)"""
        load, recompute = self.predict_load(nbytes), self.predict_recompute(tokens)
        self.last_load_s, self.last_recompute_s = load, recompute
        use = load is None or recompute is None or load < recompute
        if use:
            self.decisions_load += 1
        else:
            self.decisions_recompute += 1
            self.last_deadline_s = None
        return use

    def deadline(self, nbytes: int, tokens: int, floor: float) -> float:
        """Seconds a read of `nbytes` (saving `tokens` tokens of prefill) may take: see
        the module docstring. Kept as last_deadline_s."""
        load, recompute = self.predict_load(nbytes), self.predict_recompute(tokens)
        wait = 0.0 if load is None else MARGIN * load
        if recompute is not None:
            wait = min(recompute, max(wait, PATIENCE * recompute))
        self.last_deadline_s = max(floor, wait)
        return self.last_deadline_s

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "latency_ms": None if self.latency_s is None else self.latency_s * 1e3,
            "bandwidth_mb_s": None if self.bytes_per_s is None else self.bytes_per_s / 1e6,
            "compute_tok_s": self.compute_tok_s,
            "decisions_load": self.decisions_load,
            "decisions_recompute": self.decisions_recompute,
            "last_load_s": self.last_load_s,
            "last_recompute_s": self.last_recompute_s,
            "last_deadline_s": self.last_deadline_s,
        }
