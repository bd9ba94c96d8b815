"""kvstrata's counters in vLLM's own Prometheus `/metrics`.

In one process: an OffloadStore's counters go through vLLM's own stats classes (the
scheduler's OffloadingConnectorStats, the front-end's OffloadPromMetrics) as
increments. Then from a real OpenAI server (`python -m vllm.entrypoints.openai.
api_server`, the tiny Llama, CPU):

    server A   P1 cold (9 blocks stored, written to disk), vLLM's prefix cache reset,
               P1 again: 9 host hits                                    -> (a)
    server B   the same disk_dir after one of P1's disk blocks was corrupted:
               disk hits up to that block, which is refused             -> (b)

Each scrape is taken once the engine is quiet, and every kvstrata metric is compared
with the scheduler's own `stats_file` and with what the client was told (cached tokens).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families
from tests.integrations.vllm.tiny import HEAD_DIM, NUM_KV_HEADS, NUM_LAYERS, VLLM_BLOCK, prompts
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadPromMetrics

import kvstrata
from kvstrata.integrations.vllm import kv_transfer_config
from kvstrata.integrations.vllm.backend_plan import VllmSide, make_plan
from kvstrata.integrations.vllm.options import VllmOptions
from kvstrata.integrations.vllm.stats import PREFIX, VllmStats, metric_definitions
from kvstrata.integrations.vllm.store import HIT, MISS, OffloadStore
from kvstrata.model.geometry import KVGeometry

(P1,) = prompts(1, 300, seed=7)  # 9 full vLLM blocks (288 tokens) + 12 computed
FULL = 9 * VLLM_BLOCK
BLOCK_BYTES = NUM_LAYERS * 2 * NUM_KV_HEADS * VLLM_BLOCK * HEAD_DIM * 4  # fp32, lossless
START_TIMEOUT_S = 300.0
QUIET_TIMEOUT_S = 60.0
# the stats file's counters -> (metric sample, labels) in /metrics
FILE_TO_METRIC = {
    "lookups": ("vllm:kvstrata_lookups_total", {}),
    "misses": ("vllm:kvstrata_misses_total", {}),
    "pending": ("vllm:kvstrata_pending_total", {}),
    "hits_host": ("vllm:kvstrata_hits_total", {"tier": "host"}),
    "hits_disk": ("vllm:kvstrata_hits_total", {"tier": "disk"}),
    "hits_remote": ("vllm:kvstrata_hits_total", {"tier": "remote"}),
    "corrupt_refused": ("vllm:kvstrata_corrupt_blocks_total", {}),
    "disk_read_timeouts": ("vllm:kvstrata_disk_read_timeouts_total", {}),
    "stored": ("vllm:kvstrata_stored_blocks_total", {}),
    "store_refused": ("vllm:kvstrata_store_refused_blocks_total", {}),
    "disk_written": ("vllm:kvstrata_disk_written_blocks_total", {}),
    "disk_write_errors": ("vllm:kvstrata_disk_write_errors_total", {}),
    "evicted_host": ("vllm:kvstrata_evicted_blocks_total", {"tier": "host"}),
    "evicted_disk": ("vllm:kvstrata_evicted_blocks_total", {"tier": "disk"}),
    "found_on_disk": ("vllm:kvstrata_found_on_disk_blocks", {}),
    "disk_degraded": ("vllm:kvstrata_disk_degraded", {}),
    "disk_read_batches": ("vllm:kvstrata_disk_read_batches_total", {}),
    "disk_read_blocks": ("vllm:kvstrata_disk_read_blocks_total", {}),
    "disk_retries": ("vllm:kvstrata_disk_retries_total", {}),
    "disk_no_room": ("vllm:kvstrata_disk_no_room_total", {}),
}


# -- one process: the store's counters through vLLM's stats classes ------------------------------
def _store(tmp_path: Path) -> tuple[OffloadStore, Any]:
    geometry = KVGeometry.from_hf_config(
        {"model_type": "llama", "num_hidden_layers": NUM_LAYERS, "num_attention_heads": 4,
         "num_key_value_heads": NUM_KV_HEADS, "hidden_size": 128, "head_dim": HEAD_DIM,
         "dtype": "float32"}
    )  # fmt: skip
    side = VllmSide(
        model_name="m", dtype="float32", num_layers=NUM_LAYERS, tokens_per_block=VLLM_BLOCK,
        blocks_per_chunk=1, worker_kv_bytes_per_block=BLOCK_BYTES,
        engine_id=f"m-{uuid.uuid4().hex}",
    )  # fmt: skip
    options = VllmOptions.from_extra_config(
        {"host_budget": "1MiB", "disk_dir": str(tmp_path), "disk_budget": "4MiB"}
    )
    plan = make_plan(options, side, geometry)
    host = plan.host_tier(create=True, identity={})  # the worker's side
    return OffloadStore(plan, options), host


def _prometheus(registry: CollectorRegistry) -> OffloadPromMetrics:
    """vLLM's front-end metrics of a kvstrata engine, registered in `registry`."""
    config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config=kv_transfer_config(host_budget="1MiB")[
                "kv_connector_extra_config"
            ]
        )
    )
    types = {cls: partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    return OffloadPromMetrics(config, types, ["engine"], {0: ["0"]})


def test_counters_reach_vllms_prometheus_metrics_as_increments(tmp_path: Path) -> None:
    store, host = _store(tmp_path)
    registry = CollectorRegistry()
    prom = _prometheus(registry)
    stats = VllmStats()
    try:
        first = stats.collect(store)  # every metric once, at zero: all show from the start
        local = {"remote_blocks", "remote_bytes"}  # no remote tier here
        assert set(first.data["data"]) == {
            name for name in metric_definitions() if name.removeprefix(PREFIX) not in local
        }
        keys = [b"a", b"b"]
        _, slots = store.prepare_store(keys, keys)
        host.write_blocks(slots, *[torch.ones(NUM_LAYERS, NUM_KV_HEADS, 64, HEAD_DIM)] * 2)
        store.complete_store(keys, success=True)
        assert store.drain()
        assert [store.lookup(b"a"), store.lookup(b"zz")] == [HIT, MISS]
        step = stats.collect(store)
        counters = step.data["data"]
        assert counters[PREFIX + "hits"] == {("host",): 1}  # only what changed, as increments
        assert counters[PREFIX + "lookups"] == {(): 2} and counters[PREFIX + "misses"] == {(): 1}
        assert counters[PREFIX + "stored_blocks"] == {(): 2}
        assert counters[PREFIX + "disk_written_blocks"] == {(): 2}
        assert counters[PREFIX + "blocks"] == {("host",): 2, ("disk",): 2}  # gauges: the value
        assert stats.collect(store).is_empty()  # nothing changed, nothing sent
        store.lookup(b"b")
        last = stats.collect(store)
        assert last.data["data"][PREFIX + "hits"] == {("host",): 1}
        for part in (first, step, last):  # each step's payload, as the front-end gets it
            prom.observe(part.data)
    finally:
        store.close()
        host.close()
    value = registry.get_sample_value
    assert value("vllm:kvstrata_hits_total", {"engine": "0", "tier": "host"}) == 2
    assert value("vllm:kvstrata_lookups_total", {"engine": "0"}) == store.counters["lookups"] == 3
    assert value("vllm:kvstrata_misses_total", {"engine": "0"}) == 1
    assert value("vllm:kvstrata_corrupt_blocks_total", {"engine": "0"}) == 0
    assert value("vllm:kvstrata_disk_read_timeouts_total", {"engine": "0"}) == 0
    assert value("vllm:kvstrata_block_bytes", {"engine": "0", "tier": "host"}) == BLOCK_BYTES
    written = value("vllm:kvstrata_disk_bytes_total", {"engine": "0", "direction": "written"})
    assert written == store.disk.tier.stats.bytes_written > 0


# -- a real server ---------------------------------------------------------------------------------
class Server:
    """One `vllm serve` (the api_server module) with kvstrata as its offloading backend."""

    def __init__(self, model: Path, log: Path, **fields: Any) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.model = str(model)
        self.stats_file = Path(fields["stats_file"])
        self.stats_file.unlink(missing_ok=True)
        src = str(Path(kvstrata.__file__).resolve().parents[1])
        env = {
            **os.environ,
            "PYTHONHASHSEED": "0",  # block hashes equal across the two servers
            "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache
            "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
        }
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model, "--dtype", "float32", "--enforce-eager", "--seed", "0",
            "--block-size", str(VLLM_BLOCK), "--kv-cache-memory-bytes", str(64 << 20),
            "--host", "127.0.0.1", "--port", str(self.port),
            "--enable-prompt-tokens-details",
            "--kv-transfer-config", json.dumps(kv_transfer_config(**fields)),
        ]  # fmt: skip
        self.log = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(args, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready(log)

    def _wait_ready(self, log: Path) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited: {log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(1.0)
        raise RuntimeError(f"vllm serve did not start in {START_TIMEOUT_S} s")

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def post(self, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(
            self.url(path), data=data, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())

    def complete(self, prompt: list[int], max_tokens: int = 4) -> tuple[list, int]:
        """(the completion's text, the prompt tokens vLLM reported as cached)."""
        out = self.post(
            "/v1/completions",
            {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
             "temperature": 0.0, "ignore_eos": True},
        )  # fmt: skip
        details = out["usage"].get("prompt_tokens_details") or {}
        return out["choices"][0]["text"], details.get("cached_tokens") or 0

    def metrics(self) -> dict[tuple[str, frozenset], float]:
        """/metrics samples by (name, labels without vLLM's model_name / engine)."""
        with urllib.request.urlopen(self.url("/metrics"), timeout=30) as r:
            text = r.read().decode()
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = {k: v for k, v in s.labels.items() if k not in ("model_name", "engine")}
                out[s.name, frozenset(labels.items())] = s.value
        return out

    def stats(self) -> dict[str, Any]:
        return json.loads(self.stats_file.read_text())

    def quiet(self) -> tuple[dict[str, Any], dict]:
        """(stats file, /metrics) once the disk writes are done and the two agree: a
        one-token request steps the engine (the scheduler rewrites the stats file and
        hands vLLM the counters' increments) until nothing changes any more."""
        deadline = time.monotonic() + QUIET_TIMEOUT_S
        while True:
            self.complete([1, 2, 3], max_tokens=1)  # no full block: no lookups
            time.sleep(0.5)
            stats, metrics = self.stats(), self.metrics()
            written = stats["disk_written"] + stats["disk_write_errors"] >= stats["stored"]
            if written and not _differences(stats, metrics):
                return stats, metrics
            if time.monotonic() > deadline:
                return stats, metrics  # the caller's asserts show what differs

    def stop(self) -> None:
        """Ctrl-C, as a user stops it: the engine shuts down, the store closes."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def _differences(stats: dict[str, Any], metrics: dict) -> dict[str, tuple]:
    """Stats-file counters that /metrics shows otherwise (or not at all)."""
    out = {}
    for field, (name, labels) in FILE_TO_METRIC.items():
        shown = metrics.get((name, frozenset(labels.items())))
        if shown != stats[field]:
            out[field] = (stats[field], shown)
    for tier in ("host", "disk"):
        for kind, name in (("blocks", "vllm:kvstrata_blocks"), ("slots", "vllm:kvstrata_slots")):
            shown = metrics.get((name, frozenset({("tier", tier)})))
            if shown != stats[kind][tier]:
                out[f"{kind}.{tier}"] = (stats[kind][tier], shown)
    return out


def _sample(metrics: dict, name: str, **labels: str) -> float | None:
    return metrics.get((name, frozenset(labels.items())))


@pytest.fixture(scope="module")
def served(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    root = tmp_path_factory.mktemp("metrics")
    fields = {"host_budget": "8MiB", "disk_dir": str(root / "disk"),
              "disk_budget": "32MiB", "stats_file": str(root / "stats.json")}  # fmt: skip
    (root / "disk").mkdir()
    run: dict[str, Any] = {}
    a = Server(tiny_llama, root / "a.log", **fields)
    try:
        run["cold"] = a.complete(P1)
        a.quiet()  # P1's 9 blocks stored and on disk
        assert a.post("/reset_prefix_cache")["success"]
        run["warm"] = a.complete(P1)
        run["a_stats"], run["a_metrics"] = a.quiet()
    finally:
        a.stop()
    (disk,) = [p for p in (root / "disk").iterdir() if p.is_dir()]  # the one namespace
    arena = disk / "blocks.bin"
    slot_bytes = arena.stat().st_size // run["a_stats"]["slots"]["disk"]
    with open(arena, "r+b") as f:  # one of P1's blocks (slot 5): flip 8 bytes
        f.seek(5 * slot_bytes + 1000)
        data = f.read(8)
        f.seek(5 * slot_bytes + 1000)
        f.write(bytes(b ^ 0xFF for b in data))
    b = Server(tiny_llama, root / "b.log", **fields)
    try:
        run["restart"] = b.complete(P1)
        run["b_stats"], run["b_metrics"] = b.quiet()
    finally:
        b.stop()
    yield run


@pytest.mark.slow
def test_a_host_hits_and_bytes_show_in_vllm_metrics(served: dict) -> None:
    stats, metrics = served["a_stats"], served["a_metrics"]
    assert _differences(stats, metrics) == {}  # /metrics says what the scheduler counted
    assert served["cold"][1] == 0 and served["warm"] == (served["cold"][0], FULL)
    assert _sample(metrics, "vllm:kvstrata_hits_total", tier="host") == FULL // VLLM_BLOCK
    assert _sample(metrics, "vllm:kvstrata_hits_total", tier="disk") == 0
    assert _sample(metrics, "vllm:kvstrata_stored_blocks_total") == 9
    assert _sample(metrics, "vllm:kvstrata_disk_written_blocks_total") == 9
    assert _sample(metrics, "vllm:kvstrata_corrupt_blocks_total") == 0
    assert _sample(metrics, "vllm:kvstrata_disk_read_timeouts_total") == 0
    assert _sample(metrics, "vllm:kvstrata_block_bytes", tier="host") == BLOCK_BYTES
    assert _sample(metrics, "vllm:kvstrata_disk_bytes_total", direction="written") >= (
        9 * BLOCK_BYTES
    )
    # vLLM's own transfer bytes, as kvstrata's worker reported them: 9 blocks each way
    assert _sample(metrics, "vllm:kv_offload_load_bytes_total") == 9 * BLOCK_BYTES
    assert _sample(metrics, "vllm:kv_offload_store_bytes_total") == 9 * BLOCK_BYTES
    (info,) = [labels for name, labels in metrics if name == "vllm:kvstrata_info"]
    assert dict(info)["namespace"] == stats["namespace"] and dict(info)["host_codec"] == "none"


@pytest.mark.slow
def test_b_disk_hits_and_a_corrupt_block_show_in_vllm_metrics(served: dict) -> None:
    stats, metrics = served["b_stats"], served["b_metrics"]
    assert _differences(stats, metrics) == {}
    text, cached = served["restart"]
    hits = _sample(metrics, "vllm:kvstrata_hits_total", tier="disk")
    assert text == served["cold"][0]  # identical tokens: the corrupt block was recomputed
    assert cached == hits * VLLM_BLOCK < FULL  # the client saw the hits up to the corrupt block
    assert _sample(metrics, "vllm:kvstrata_found_on_disk_blocks") == 9
    assert _sample(metrics, "vllm:kvstrata_disk_read_blocks_total") >= hits > 0  # batched reads
    assert _sample(metrics, "vllm:kvstrata_corrupt_blocks_total") == 1
    assert _sample(metrics, "vllm:kvstrata_disk_bytes_total", direction="read") > 0
    assert _sample(metrics, "vllm:kv_offload_load_bytes_total") == hits * BLOCK_BYTES
