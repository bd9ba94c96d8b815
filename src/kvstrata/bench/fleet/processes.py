"""The processes of `kvstrata bench fleet`: N `kvstrata serve` replicas publishing KV
events, one `redis-server` for the shared remote tier, and `vllm-router` in front; their
command lines, and the counters read from the replicas' `/metrics`."""

from __future__ import annotations

import json
import os
import shutil
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kvstrata.bench.peer.servers import Server, free_port
from kvstrata.core.errors import MissingExtraError

# Policies: vllm-router's --policy, and whether the replicas share a remote tier.
POLICIES = {
    "round_robin": ("round_robin", False),
    "cache_aware": ("cache_aware", False),
    "kv_aware": ("kv_aware", False),
    "round_robin+remote": ("round_robin", True),
    "kv_aware+remote": ("kv_aware", True),
}


def find_router() -> str:
    """vllm-router next to this interpreter or on PATH (MissingExtraError otherwise)."""
    found = shutil.which("vllm-router", path=str(Path(sys.executable).parent))
    found = found or shutil.which("vllm-router")
    if found is None:
        raise MissingExtraError(
            "kvstrata bench fleet needs vllm-router: pip install 'kvstrata[fleet]'"
        )
    return found


def redis_available() -> bool:
    """redis-server on PATH and the redis client importable (the +remote policies)."""
    import importlib.util

    from kvstrata.bench._redis import REDIS_SERVER

    return REDIS_SERVER is not None and importlib.util.find_spec("redis") is not None


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica runs with."""

    model_dir: Path
    served_name: str
    block_size: int
    device_budget: int
    host_budget: int
    threads: int
    max_num_seqs: int
    extra: tuple[str, ...] = ()


@dataclass
class Replica:
    server: Server
    events: int  # the KV event PUB port
    replay: int  # its replay ROUTER port


def replica(spec: ReplicaSpec, index: int, log_dir: Path, remote_url: str | None) -> Replica:
    """A replica's server (not started): fresh ports, KV events on, its budgets."""
    port, events, replay = free_port(), free_port(), free_port()
    config = {  # `*`: bound (vLLM's rule: a named host is connected to)
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{events}",
        "replay_endpoint": f"tcp://*:{replay}",
    }
    cmd = [sys.executable, "-m", "kvstrata.cli", "serve", "--model", str(spec.model_dir)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--no-status"]
    cmd += ["--served-model-name", spec.served_name, "--block-size", str(spec.block_size)]
    cmd += ["--threads", str(spec.threads), "--max-num-seqs", str(spec.max_num_seqs)]
    cmd += ["--device-budget", str(spec.device_budget), "--host-budget", str(spec.host_budget)]
    cmd += ["--kv-events-config", json.dumps(config)]
    if remote_url is not None:
        cmd += ["--remote-url", remote_url]
    cmd += list(spec.extra)
    log = log_dir / f"replica{index}.log"
    server = Server(f"replica{index}", "", cmd, port, log, env=_env())
    return Replica(server, events, replay)


def router(
    binary: str,
    policy: str,
    replicas: list[Replica],
    spec: ReplicaSpec,
    log_dir: Path,
    temperature: float = 0.0,
    extra: tuple[str, ...] = (),
) -> Server:
    """vllm-router in front of the replicas (not started); kv_aware listens to their
    events (and knows their replay sockets)."""
    port = free_port()
    cmd = [binary, "--host", "127.0.0.1", "--port", str(port), "--policy", policy]
    cmd += ["--worker-urls", *(r.server.url for r in replicas)]
    if policy == "kv_aware":
        for r in replicas:
            cmd += ["--kv-event-source", f"{r.server.url}=tcp://127.0.0.1:{r.events}"]
            cmd += ["--kv-event-replay-source", f"{r.server.url}=tcp://127.0.0.1:{r.replay}"]
        cmd += ["--kv-event-block-size", str(spec.block_size)]
        cmd += ["--kv-event-model", spec.served_name]
        cmd += ["--router-temperature", str(temperature)]
    cmd += list(extra)
    return Server(f"router-{policy}", "", cmd, port, log_dir / f"router-{policy}.log", env=_env())


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONHASHSEED="0")


def counters(url: str) -> dict[str, float] | None:
    """A replica's counters from its /metrics: `requests` (completions answered),
    `prompt` (prompt tokens of finished requests) and `hit:TIER` (prompt tokens its
    prefix cache found on TIER); None when /metrics does not answer."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
            text = resp.read().decode()
    except (urllib.error.URLError, OSError):
        return None
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvstrata_prompt_tokens_total":
                out["prompt"] = out.get("prompt", 0.0) + sample.value
            elif sample.name == "kvstrata_http_requests_total":
                if sample.labels.get("path") == "/v1/completions":
                    out["requests"] = out.get("requests", 0.0) + sample.value
            elif sample.name == "kvstrata_prefix_hit_tokens_total":
                key = f"hit:{sample.labels.get('tier', '?')}"
                out[key] = out.get(key, 0.0) + sample.value
    return out


def total(counts: list[dict[str, float]]) -> dict[str, float]:
    """Counters summed over replicas."""
    out: dict[str, float] = {}
    for one in counts:
        for key, value in one.items():
            out[key] = out.get(key, 0.0) + value
    return out
