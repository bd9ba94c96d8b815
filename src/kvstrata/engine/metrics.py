"""Prometheus metrics of one engine (its own `CollectorRegistry`).

Latencies are histograms observed as requests progress; the store's counters (tier
occupancy, bytes moved per link, prefix lookups and hits per tier, evictions,
demotions, transfer stalls, the remote tier's hits, faults, bytes, round trips and
cost decisions, the host tier's decisions under memory pressure) are read from the
engine's latest snapshot when scraped, so a scrape never touches the store from another
thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _SnapshotCollector:
    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.snapshot = snapshot

    def describe(self) -> list[Metric]:
        return []  # collected lazily: no metric names known before the first scrape

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot()
        for name, doc in (
            ("running", "requests running (in the step batch)"),
            ("waiting", "requests waiting to start (queue length)"),
            ("preempted", "requests preempted (their blocks demoted), waiting to resume"),
        ):
            g = GaugeMetricFamily(f"kvstrata_requests_{name}", doc)
            g.add_metric([], snap.get(name, 0))
            yield g
        store_stats = snap.get("store") or {}
        if not store_stats.get("initialized"):
            return
        used = GaugeMetricFamily(
            "kvstrata_tier_used_bytes", "bytes of blocks held", labels=["tier"]
        )
        cached = GaugeMetricFamily(
            "kvstrata_tier_cached_blocks", "prefix-cache blocks (evictable)", labels=["tier"]
        )
        cap = GaugeMetricFamily("kvstrata_tier_budget_bytes", "tier budget", labels=["tier"])
        for tier, occ in store_stats["tiers"].items():
            used.add_metric([tier], occ["used_bytes"])
            cached.add_metric([tier], occ["cached_blocks"])
            cap.add_metric([tier], occ["budget_blocks"] * occ["block_bytes"])
        yield from (used, cached, cap)
        moved = CounterMetricFamily(
            "kvstrata_bytes_moved", "bytes moved between tiers", labels=["link"]
        )
        for link, n in store_stats["bytes_moved"].items():
            moved.add_metric([link], n)
        yield moved
        prefix = store_stats["prefix"]
        lookup = CounterMetricFamily(
            "kvstrata_prefix_lookup_tokens", "prompt tokens looked up in the prefix cache"
        )
        lookup.add_metric([], prefix["lookup_tokens"])
        hits = CounterMetricFamily(
            "kvstrata_prefix_hit_tokens", "prompt tokens found, per tier", labels=["tier"]
        )
        for tier, n in prefix["hit_tokens_by_tier"].items():
            hits.add_metric([tier], n)
        corrupt = CounterMetricFamily(
            "kvstrata_prefix_corrupt_blocks", "cached blocks that failed their check (recomputed)"
        )
        corrupt.add_metric([], prefix["corrupt_blocks"])
        yield from (lookup, hits, corrupt)
        evicted = CounterMetricFamily(
            "kvstrata_evicted_cached_blocks", "prefix-cache blocks evicted for room"
        )
        evicted.add_metric([], snap.get("evicted_cached_blocks", 0))
        yield evicted
        if store_stats.get("remote"):
            yield from _remote_metrics(store_stats["remote"])
        if store_stats.get("host_pressure"):
            yield from _pressure_metrics(store_stats["host_pressure"])
        prefetch = (store_stats.get("selection") or {}).get("prefetch")
        if prefetch:
            yield from _prefetch_metrics(prefetch)
        xfer = store_stats.get("transfers")
        if xfer:
            stall = CounterMetricFamily(
                "kvstrata_transfer_stall_seconds", "time attention waited for staged blocks"
            )
            stall.add_metric([], xfer["stall_s"])
            hidden = GaugeMetricFamily(
                "kvstrata_transfer_hidden_fraction", "share of transfer time hidden behind compute"
            )
            hidden.add_metric([], xfer["overlap_ratio"])
            yield from (stall, hidden)


_C, _G = CounterMetricFamily, GaugeMetricFamily
_PREFETCH = (  # (family, metric name, stats key, help)
    (_C, "needed", "needed", "(block, layer) units in staged tiers selecting decodes read"),
    (_C, "hits", "hits", "of those, held by the prediction when a step asked"),
    (_C, "misses", "misses", "of those, read while the step waited"),
    (_C, "fetched_ahead", "fetched_ahead", "units read ahead of the step that asks for them"),
    (_C, "wasted_bytes", "wasted_bytes", "bytes read ahead and dropped unused"),
    (_C, "read_bytes", "read_bytes", "bytes selection read from staged tiers"),
    (_C, "stall_seconds", "stall_s", "time selecting decodes waited for their reads"),
    (_G, "held_bytes", "held_bytes", "bytes of units the prediction holds"),
    (_G, "hit_rate", "hit_rate", "share of the units asked for that were held"),
)


def _prefetch_metrics(p: dict[str, Any]) -> Iterator[Metric]:
    """Query-aware selection's prediction of the next step's units (attention_prefetch)."""
    for family, name, key, doc in _PREFETCH:
        if p.get(key) is not None:
            m = family(f"kvstrata_selection_prefetch_{name}", doc)
            m.add_metric([], p[key])
            yield m


def _pressure_metrics(p: dict[str, Any]) -> Iterator[Metric]:
    """The host tier under memory pressure: its decisions and the room it reads (its
    budget and use over time are kvstrata_tier_budget_bytes / _used_bytes{tier="host"})."""
    decisions = CounterMetricFamily(
        "kvstrata_host_pressure_decisions",
        "host budget changes under memory pressure (shrink, grow; refused: no room below)",
        labels=["choice"],
    )
    for choice, n in p["decisions"].items():
        decisions.add_metric([choice], n)
    yield decisions
    for key, doc in (
        ("blocks_moved", "blocks the host tier moved down when it shrank"),
        ("released_bytes", "bytes of free host slots given back to the kernel"),
    ):
        c = CounterMetricFamily(f"kvstrata_host_pressure_{key}", doc)
        c.add_metric([], p[key])
        yield c
    for key, doc in (
        ("available_bytes", "memory left before the OOM killer (cgroup limit, MemAvailable)"),
        ("limit_bytes", "the memory limit read (the cgroup's, else the machine's)"),
        ("headroom_bytes", "host_headroom: below it the host tier shrinks"),
        ("configured_bytes", "host_budget: the most the host tier grows back to"),
    ):
        if p.get(key) is not None:
            g = GaugeMetricFamily(f"kvstrata_host_pressure_{key}", doc)
            g.add_metric([], p[key])
            yield g


_REMOTE_COUNTERS = (
    ("hits", "remote blocks loaded (a prefix hit from the shared server)"),
    ("misses", "remote blocks asked for and absent"),
    ("corrupt", "remote values that failed a check: refused, deleted, recomputed"),
    ("timeouts", "remote reads past their deadline (recomputed)"),
    ("errors", "remote reads that failed (server down, connection lost)"),
    ("skipped", "remote lookups skipped while the server is in backoff"),
    ("writes", "blocks written to the remote server"),
    ("writes_dropped", "remote writes dropped (queue full or server down)"),
    ("write_errors", "remote writes the server refused"),
    ("bytes_read", "bytes read from the remote server"),
    ("bytes_written", "bytes written to the remote server"),
)


_LINK_GAUGES = (
    ("latency_ms", "link_latency_seconds", 1e-3, "the link model's round-trip latency"),
    ("bandwidth_mb_s", "link_bytes_per_second", 1e6, "the link model's read bandwidth"),
    ("compute_tok_s", "compute_tokens_per_second", 1.0, "this store's measured prefill speed"),
    ("last_load_s", "predicted_load_seconds", 1.0, "the last lookup's predicted remote load"),
    ("last_recompute_s", "predicted_recompute_seconds", 1.0, "...and its predicted recompute"),
    ("last_deadline_s", "read_deadline_seconds", 1.0, "the deadline of the last remote read"),
)


def _remote_metrics(remote: dict[str, Any]) -> Iterator[Metric]:
    """The remote tier's counters, its round-trip histogram and its cost decisions."""
    for key, doc in _REMOTE_COUNTERS:
        c = CounterMetricFamily(f"kvstrata_remote_{key}", doc)
        c.add_metric([], remote[key])
        yield c
    decisions = CounterMetricFamily(
        "kvstrata_remote_decisions",
        "lookups where the link model chose to load remote blocks or to recompute them",
        labels=["choice"],
    )
    decisions.add_metric(["load"], remote["link"]["decisions_load"])
    decisions.add_metric(["recompute"], remote["link"]["decisions_recompute"])
    yield decisions
    counts, total, buckets = remote["latency_counts"], 0, []
    for bound, n in zip([*remote["latency_buckets_s"], float("inf")], counts, strict=True):
        total += n
        buckets.append((str(bound) if bound != float("inf") else "+Inf", total))
    latency = HistogramMetricFamily(
        "kvstrata_remote_read_seconds", "round trip of one batched remote read"
    )
    latency.add_metric([], buckets, sum_value=remote["latency_sum_s"])
    yield latency
    pending = GaugeMetricFamily(
        "kvstrata_remote_pending_bytes", "bytes queued for the remote server, not yet sent"
    )
    pending.add_metric([], remote["pending_bytes"])
    yield pending
    # what the cost rule compares (absent until measured)
    link = remote["link"]
    for key, name, scale, doc in _LINK_GAUGES:
        if link.get(key) is not None:
            g = GaugeMetricFamily(f"kvstrata_remote_{name}", doc)
            g.add_metric([], link[key] * scale)
            yield g


class EngineMetrics:
    """The engine's metrics; `registry` is what `/metrics` serves."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram(
            "kvstrata_time_to_first_token_seconds",
            "arrival to first token",
            buckets=_LATENCY,
            registry=r,
        )
        self.tpot = Histogram(
            "kvstrata_time_per_output_token_seconds",
            "time between a request's tokens",
            buckets=_LATENCY,
            registry=r,
        )
        self.e2e = Histogram(
            "kvstrata_request_seconds", "arrival to finish", buckets=_LATENCY, registry=r
        )
        self.step = Histogram(
            "kvstrata_step_seconds",
            "one engine step (forward + sampling)",
            buckets=_LATENCY,
            registry=r,
        )
        self.finished = Counter(
            "kvstrata_requests_finished", "finished requests", ["reason"], registry=r
        )
        self.prompt_tokens = Counter(
            "kvstrata_prompt_tokens", "prompt tokens of finished requests", registry=r
        )
        self.cached_tokens = Counter(
            "kvstrata_cached_prompt_tokens",
            "prompt tokens served from the prefix cache",
            registry=r,
        )
        self.generation_tokens = Counter(
            "kvstrata_generation_tokens", "tokens generated", registry=r
        )
        self.prefill_tokens = Counter(
            "kvstrata_prefill_tokens", "prompt tokens fed to the model (computed)", registry=r
        )
        self.decode_tokens = Counter(
            "kvstrata_decode_tokens", "generated tokens fed back to the model", registry=r
        )
        self.preemptions = Counter(
            "kvstrata_preemptions", "requests preempted (blocks demoted, not dropped)", registry=r
        )
        self.demoted_blocks = Counter(
            "kvstrata_demoted_blocks", "blocks demoted off the device by preemption", registry=r
        )
        self.recomputes = Counter(
            "kvstrata_recomputes",
            "requests whose KV was recomputed after a storage error",
            registry=r,
        )
        self.resumed = Counter(
            "kvstrata_resumed", "preempted requests resumed (no recompute)", registry=r
        )
        self.blend_tokens = Counter(
            "kvstrata_blend_tokens",
            "prompt tokens after the head of prompts with documents: reused (a document's "
            "K/V moved) or recomputed",
            ["kind"],
            registry=r,
        )
        self.blend_documents = Counter(
            "kvstrata_blend_documents",
            "documents of prompts: found in the store or computed (and kept)",
            ["outcome"],
            registry=r,
        )
        self.blend_failed = Counter(
            "kvstrata_blend_failed",
            "prompts with documents prefilled in full after the blend failed",
            registry=r,
        )
        r.register(_SnapshotCollector(snapshot))

    def value(self, name: str, **labels: str) -> float:
        """A metric's current value (for tests and reports); 0 when absent."""
        v = self.registry.get_sample_value(name, labels or None)
        return 0.0 if v is None else v
