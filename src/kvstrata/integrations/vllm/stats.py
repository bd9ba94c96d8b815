"""kvstrata's counters as vLLM's own stats: Prometheus `/metrics` of `vllm serve`.

vLLM's OffloadingConnector asks the manager for `get_stats()` after every engine step
(scheduler process) and ships what it returns with the step's SchedulerStats to the
front-end, whose Prometheus logger adds it to the metrics the spec declared
(`KvstrataOffloadingSpec.build_metric_definitions`, called in the front-end process):

    scheduler: OffloadStore.counters --VllmStats.collect--> OffloadingConnectorStats
      (deltas since the last step)     --SchedulerStats--> front-end: vllm:kvstrata_*

Counters travel as increments (vLLM sums them), gauges as their latest value; every
metric is sent once at the first step, so all of them show from the start. Names carry
vLLM's `vllm:` prefix (vLLM's metrics reader, `LLM.get_metrics()`, keeps only those)
and vLLM adds its `model_name` and `engine` labels.

What vLLM cannot carry — hence `stats_file` stays: nothing at all while vLLM collects
no stats (`LLM(...)` does not unless `disable_log_stats=False`; `vllm serve` does),
and what changes after the engine's last step (the disk writes finished at shutdown).
Bytes moved between vLLM's KV pages and kvstrata's host tier are vLLM's own
`vllm:kv_offload_load_bytes` / `vllm:kv_offload_store_bytes` (the worker reports them).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
)

from kvstrata.integrations.vllm.disk_reads import COUNTERS as READ_COUNTERS

PREFIX = "vllm:kvstrata_"
REMOTE_EVENTS = (
    "hits",
    "misses",
    "corrupt",
    "timeouts",
    "errors",
    "skipped",
    "reads",
    "writes",
    "writes_dropped",
    "write_errors",
    "reconnects",
    "no_room",
)  # RemoteStats' block counters (tiers/remote.py)

# metric -> (kind, labels, help); a counter's value is OffloadStore.counters' sum below
_METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "lookups": ("counter", (), "Block lookups vLLM's scheduler asked kvstrata."),
    "hits": ("counter", ("tier",), "Lookups answered with a block, by the tier it came from."),
    "misses": ("counter", (), "Lookups of blocks kvstrata does not hold (recomputed)."),
    "pending": ("counter", (), "Lookups of blocks still being stored."),
    "corrupt_blocks": (
        "counter",
        (),
        "Disk blocks refused on a checksum or read failure (recomputed).",
    ),
    "disk_read_timeouts": (
        "counter",
        (),
        "Disk reads past the scheduler's deadline (a miss; the block lands later).",
    ),
    "stored_blocks": ("counter", (), "Blocks stored in the host tier."),
    "store_refused_blocks": ("counter", (), "Blocks not stored: no host slot could be had."),
    "disk_written_blocks": ("counter", (), "Blocks written through to the disk tier."),
    "disk_write_errors": ("counter", (), "Blocks whose disk write failed."),
    "evicted_blocks": ("counter", ("tier",), "Block copies evicted, by tier."),
    "disk_bytes": ("counter", ("direction",), "Bytes read from / written to the disk tier."),
    "remote_retries": ("counter", (), "Lookups answered RETRY while the remote tier is asked."),
    "disk_read_batches": ("counter", (), "Batched reads of disk-only blocks (one per step)."),
    "disk_read_blocks": ("counter", (), "Blocks read back from disk in those batches."),
    "disk_retries": ("counter", (), "Lookups answered RETRY while a batched disk read runs."),
    "disk_no_room": ("counter", (), "Disk hits left out: no host slot to read them into."),
    "remote_blocks": ("counter", ("event",), "The remote tier's block counters, by event."),
    "remote_bytes": ("counter", ("direction",), "Bytes read from / written to the remote tier."),
    "blocks": ("gauge", ("tier",), "Blocks held, by tier."),
    "slots": ("gauge", ("tier",), "Block slots, by tier (the capacity)."),
    "block_bytes": (
        "gauge",
        ("tier",),
        "Bytes of one block: raw (vLLM's pages), as stored per tier.",
    ),
    "found_on_disk_blocks": ("gauge", (), "Blocks found on the disk tier at start-up."),
    "disk_degraded": ("gauge", (), "1 once the disk tier failed (host tier only from then)."),
    "info": (
        "gauge",
        ("namespace", "host_codec", "disk_codec", "block_tokens"),
        "Always 1: the namespace (model identity digest), codecs and block tokens.",
    ),
}


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """The metrics a kvstrata engine reports (vLLM registers them in the front-end)."""
    out: dict[str, OffloadingMetricMetadata] = {}
    for name, (kind, labels, doc) in _METRICS.items():
        cls = OffloadingCounterMetadata if kind == "counter" else OffloadingGaugeMetadata
        out[PREFIX + name] = cls(documentation=doc, labelnames=labels)
    return out


def counter_values(
    c: dict[str, Any], disk_io: Any = None
) -> dict[tuple[str, tuple[str, ...]], float]:
    """Cumulative counters of one OffloadStore.stats() snapshot `c` (and the disk
    tier's I/O stats `disk_io`), by (metric, label values)."""
    out: dict[tuple[str, tuple[str, ...]], float] = {
        ("lookups", ()): c["lookups"],
        ("misses", ()): c["misses"],
        ("pending", ()): c["pending"],
        ("corrupt_blocks", ()): c["corrupt_refused"],
        ("disk_read_timeouts", ()): c["disk_read_timeouts"],
        ("stored_blocks", ()): c["stored"],
        ("store_refused_blocks", ()): c["store_refused"],
        ("disk_written_blocks", ()): c["disk_written"],
        ("disk_write_errors", ()): c["disk_write_errors"],
        ("remote_retries", ()): c["remote_retries"],
    }
    for name in READ_COUNTERS:  # the batched disk reads (disk_reads.py)
        out[name, ()] = c[name]
    for tier in ("host", "disk", "remote"):
        out["hits", (tier,)] = c[f"hits_{tier}"]
    for tier in ("host", "disk"):
        out["evicted_blocks", (tier,)] = c[f"evicted_{tier}"]
    if disk_io is not None:
        out["disk_bytes", ("read",)] = disk_io.bytes_read
        out["disk_bytes", ("written",)] = disk_io.bytes_written
    remote = c.get("remote")
    if remote is not None:
        for event in REMOTE_EVENTS:
            out["remote_blocks", (event,)] = remote.get(event, 0)
        out["remote_blocks", ("no_room",)] += c["remote_no_room"]  # no host slot for a hit
        out["remote_bytes", ("read",)] = remote.get("bytes_read", 0)
        out["remote_bytes", ("written",)] = remote.get("bytes_written", 0)
    return out


def gauge_values(stats: dict[str, Any]) -> dict[tuple[str, tuple[str, ...]], float]:
    """Gauges of one OffloadStore.stats() snapshot, by (metric, label values)."""
    out: dict[tuple[str, tuple[str, ...]], float] = {
        ("found_on_disk_blocks", ()): stats["found_on_disk"],
        ("disk_degraded", ()): stats["disk_degraded"],
    }
    for tier in ("host", "disk"):
        out["blocks", (tier,)] = stats["blocks"][tier]
        out["slots", (tier,)] = stats["slots"][tier]
    for tier, nbytes in stats["bytes_per_block"].items():
        if nbytes is not None:
            out["block_bytes", (tier,)] = nbytes
    codecs = stats["codecs"]
    info = (stats["namespace"], codecs["host"], codecs["disk"] or "", str(stats["block_tokens"]))
    out["info", info] = 1
    return out


class VllmStats:
    """Turns an OffloadStore's cumulative counters into vLLM's per-step stats."""

    def __init__(self) -> None:
        self._sent: dict[tuple[str, tuple[str, ...]], float] = {}
        self._gauges: dict[tuple[str, tuple[str, ...]], float] = {}

    def collect(self, store: Any) -> OffloadingConnectorStats:
        """What changed since the last call (everything, the first time)."""
        out = OffloadingConnectorStats()
        first = not self._sent
        stats = store.stats()
        disk_io = getattr(getattr(store.disk, "tier", None), "stats", None)
        for key, value in counter_values(stats, disk_io).items():
            delta = value - self._sent.get(key, 0)
            if delta > 0 or first:
                out.increase_counter(PREFIX + key[0], max(delta, 0), key[1])
            self._sent[key] = value
        for key, value in gauge_values(stats).items():
            if first or self._gauges.get(key) != value:
                out.set_gauge(PREFIX + key[0], value, key[1])
                self._gauges[key] = value
        return out
