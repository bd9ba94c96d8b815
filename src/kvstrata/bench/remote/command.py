"""`kvstrata bench remote`'s command: its flags, the Redis server and the kvstrata
servers, their requests and the run. What it measures: the package docstring
(kvstrata.bench.remote)."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shlex
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvstrata.bench import _redis, _timing
from kvstrata.bench.peer import servers as srv
from kvstrata.bench.peer import workloads as wl
from kvstrata.bench.remote.report import report_lines, summarize
from kvstrata.core.errors import ConfigError, KvstrataError, MissingExtraError

NAME = "remote"
HELP = "two kvstrata serve sharing one Redis: B's TTFT on A's documents vs cold, disk, slow link"
IN_ALL = False  # three servers and a Redis, minutes: not part of `kvstrata bench all`
QUESTION = "\n\nQuestion: what does the code above do? Answer:"
WARMUP_PROMPT = "def warm_up(server):\n    return server\n"
BLOCK_TOKENS = 64
SETTLE_TIMEOUT_S = 300.0
# B_slow's writes go through the slow link (each answer chunk held back): its settling
# is bounded, a queue still sending then is reported
SLOW_SETTLE_S = 5.0
REMOTE_KEYS = ("hits", "misses", "timeouts", "errors", "skipped", "bytes_read", "writes")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="model (default smollm2 if installed, else tiny)"
    )
    parser.add_argument(
        "--doc-tokens", type=int, default=None, help="tokens per document (4096; --quick 512)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="documents (one per repeat)")
    parser.add_argument(
        "--max-tokens", type=int, default=16, help="greedy tokens per answer (16; --quick 4)"
    )
    parser.add_argument(
        "--delay-ms",
        type=int,
        default=None,
        help="the slow link's delay per answer chunk, ms (100; --quick 300: a tiny model's "
        "blocks are few and small, so its link's latency is what makes loading slower)",
    )
    parser.add_argument(
        "--link-mb-s",
        type=float,
        default=None,
        help="the slow link's bandwidth, MB/s (2: a 4k-token smollm2 prefix then takes "
        "minutes to load, longer than its prefill; 0: no limit)",
    )
    parser.add_argument("--remote-codec", default=None, help="remote codec (default: disk's)")
    parser.add_argument("--quick", action="store_true", help="tiny model, 512 tokens, 1 repeat")
    parser.add_argument(
        "--kvstrata-args", default=None, help='extra kvstrata serve flags: "--threads 2"'
    )
    parser.add_argument(
        "--health-timeout", type=int, default=300, help="seconds a server may take to start"
    )
    parser.add_argument("--log-dir", default=None, help="keep the servers' logs here")
    parser.add_argument("--json", default=None, metavar="PATH", help="write every number here")


def _options(args: argparse.Namespace) -> argparse.Namespace:
    o = argparse.Namespace(**vars(args))
    if o.quick:
        o.repeats = 1
        o.doc_tokens = o.doc_tokens or 512
        o.max_tokens = 4 if o.max_tokens == 16 else o.max_tokens
    o.doc_tokens = o.doc_tokens or 4096
    o.delay_ms = o.delay_ms or (300 if o.quick else 100)
    o.link_mb_s = 2.0 if o.link_mb_s is None else o.link_mb_s
    _timing.check_positive(o, "repeats", "doc_tokens", "max_tokens", "delay_ms", "health_timeout")
    try:
        o.kvstrata_args = shlex.split(o.kvstrata_args or "")
    except ValueError as exc:
        raise ConfigError.field(
            "kvstrata_args", args.kvstrata_args, f"shell words ({exc})"
        ) from None
    return o


def _model(name: str | None, quick: bool) -> tuple[str, Path]:
    from kvstrata.workload.zoo import EMBEDDED_NAMES, resolve_model_dir

    if name is not None:
        return name, resolve_model_dir(name)
    if not quick:
        try:
            return "smollm2", resolve_model_dir("smollm2")
        except KvstrataError as exc:
            _progress(f"smollm2 is not available ({exc}); using the tiny embedded model")
    return EMBEDDED_NAMES[0], resolve_model_dir(EMBEDDED_NAMES[0])


_STARTED = [time.monotonic()]


def _progress(text: str) -> None:
    elapsed = time.monotonic() - _STARTED[0]
    print(f"[remote {elapsed:6.0f} s] {text}", file=sys.stderr, flush=True)


# -- servers and their metrics --------------------------------------------------------------


def _command(o: argparse.Namespace, model_dir: Path, port: int, **flags: str) -> list[str]:
    cmd = [sys.executable, "-m", "kvstrata.cli", "serve", "--model", str(model_dir)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--no-status"]
    cmd += ["--block-size", str(BLOCK_TOKENS)]
    for flag, value in flags.items():
        cmd += [f"--{flag.replace('_', '-')}", value]
    if o.remote_codec:
        cmd += ["--remote-codec", o.remote_codec]
    return cmd + o.kvstrata_args


def _start(name: str, command: list[str], log_dir: Path, o: argparse.Namespace, warm: list[int]):
    server = srv.Server(
        name,
        "remote",
        command,
        int(command[command.index("--port") + 1]),
        log_dir / f"{name}.log",
        srv.server_env("kvstrata"),
    )
    _progress(f"starting {name} (log {server.log_path})")
    server.start(o.health_timeout)
    srv.warm_up(server, warm)
    _progress(f"{name} ready after {server.startup_s:.0f} s")
    return server


def scrape(server: srv.Server) -> dict[str, float]:
    """The server's /metrics as {name or name{labels}: value}."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                continue
    return out


def remote_counts(m: dict[str, float]) -> dict[str, float]:
    """The remote tier's counters of one scrape (0 where absent)."""
    out = {k: m.get(f"kvstrata_remote_{k}_total", 0.0) for k in REMOTE_KEYS}
    out["load"] = m.get('kvstrata_remote_decisions_total{choice="load"}', 0.0)
    out["recompute"] = m.get('kvstrata_remote_decisions_total{choice="recompute"}', 0.0)
    out["read_s"] = m.get("kvstrata_remote_read_seconds_sum", 0.0)
    out["reads"] = m.get("kvstrata_remote_read_seconds_count", 0.0)
    return out


def settle(server: srv.Server, timeout: float = SETTLE_TIMEOUT_S) -> None:
    """Wait until the server's write-behind queue is empty and its writes stopped."""
    end, last = time.monotonic() + timeout, None
    while time.monotonic() < end:
        m = scrape(server)
        now = (m.get("kvstrata_remote_pending_bytes", 0.0), remote_counts(m)["writes"])
        if now[0] == 0 and now == last:
            return
        last = now
        time.sleep(0.25)
    _progress(
        f"{server.variant}: writes not settled after {timeout:.0f} s (pending bytes, writes: "
        f"{last})"
    )


def ask(
    server: srv.Server,
    key: str,
    prompt: list[int],
    max_tokens: int,
    salt: str | None,
    wait: float = SETTLE_TIMEOUT_S,
):
    """One streamed request: the client's record, the load before it, and the change
    of the server's remote counters across it (writes settled first and after, for at
    most `wait` seconds each)."""
    settle(server, wait)
    before, load = remote_counts(scrape(server)), os.getloadavg()[0]

    async def go() -> dict[str, Any]:
        async with srv._client(server) as client:
            return await srv.send(client, server.model, wl.Req(key, prompt, max_tokens), salt)

    record = asyncio.run(go())
    after = remote_counts(scrape(server))
    record["remote"] = {k: after[k] - before[k] for k in after}
    record["load_1m"] = load
    settle(server, wait)
    _progress(
        f"{server.variant} {key}: TTFT {record['ttft_s']:.3f} s, cached "
        f"{record['cached_tokens']}, remote hits {record['remote']['hits']:.0f}, load {load:.2f}"
    )
    return record


# -- the run --------------------------------------------------------------------------------


class Docs:
    """The model, its tokenizer and the documents (fresh text per repeat + a question)."""

    def __init__(self, o: argparse.Namespace) -> None:
        from kvstrata.workload.zoo import heldout_files, load_tokenizer

        self.model_name, self.model_dir = _model(o.model, o.quick)
        tok = load_tokenizer(self.model_dir)
        self.encode = lambda text: list(tok(text, add_special_tokens=False)["input_ids"])
        ids: list[int] = []
        need = (o.repeats + 1) * o.doc_tokens
        for path in heldout_files("default"):
            ids += tok(path.read_text(errors="replace"), add_special_tokens=False, verbose=False)[
                "input_ids"
            ]
            if len(ids) >= need:
                break
        pool, question = wl.TokenPool(ids), self.encode(QUESTION)
        self.docs = [pool.take(o.doc_tokens) + question for _ in range(o.repeats)]
        self.warm_doc = pool.take(o.doc_tokens) + question  # teaches B_slow its prefill speed
        self.warm = self.encode(WARMUP_PROMPT)


def _slow_phase(o, docs: Docs, redis: _redis.RedisServer, log_dir: Path, out: dict) -> None:
    proxy = _redis.SlowProxy(redis.port, o.delay_ms / 1000, o.link_mb_s * 1e6 or None)
    server = None
    try:
        port = srv.free_port()
        # default settings: what keeps B_slow from loading is the cost rule
        cmd = _command(o, docs.model_dir, port, remote_url=proxy.url)
        server = _start("B_slow", cmd, log_dir, o, docs.warm)
        out["commands"]["B_slow"] = shlex.join(cmd)
        out["slow_warm"] = ask(server, "warm", docs.warm_doc, o.max_tokens, "warm", SLOW_SETTLE_S)
        for r, doc in enumerate(docs.docs):
            pair = [("slow_cold", f"slowcold-{r}"), ("slow_remote", None)]
            for kind, salt in pair if r % 2 else pair[::-1]:
                record = ask(server, f"doc{r}", doc, o.max_tokens, salt, SLOW_SETTLE_S)
                out["records"][kind].append(record)
        m = scrape(server)
        out["slow_link"] = {
            "latency_s": m.get("kvstrata_remote_link_latency_seconds"),
            "bytes_per_s": m.get("kvstrata_remote_link_bytes_per_second"),
            "compute_tok_s": m.get("kvstrata_remote_compute_tokens_per_second"),
            # the last lookup's figures (what the rule compared, the read's deadline)
            "last_load_s": m.get("kvstrata_remote_predicted_load_seconds"),
            "last_recompute_s": m.get("kvstrata_remote_predicted_recompute_seconds"),
            "last_deadline_s": m.get("kvstrata_remote_read_deadline_seconds"),
            **remote_counts(m),
        }
    finally:
        if server is not None:
            server.stop()
        proxy.close()


def measure(o: argparse.Namespace) -> dict[str, Any]:
    docs = Docs(o)
    if o.log_dir:
        log_dir = Path(o.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
    else:
        log_dir = Path(tempfile.mkdtemp(prefix="kvstrata-bench-remote-"))
    kinds = ("A", "cold", "remote", "disk", "slow_cold", "slow_remote")
    out: dict[str, Any] = {
        "scenario": NAME,
        "command": shlex.join(sys.argv),
        "model": docs.model_name,
        "doc_tokens": o.doc_tokens,
        "prompt_tokens": len(docs.docs[0]),
        "repeats": o.repeats,
        "max_tokens": o.max_tokens,
        "delay_ms": o.delay_ms,
        "link_mb_s": o.link_mb_s,
        "block_tokens": BLOCK_TOKENS,
        "log_dir": str(log_dir),
        "commands": {},
        "records": {k: [] for k in kinds},
        "load_start": os.getloadavg()[0],
        "cores": os.cpu_count(),
    }
    (log_dir / "redis").mkdir(exist_ok=True)
    redis = _redis.RedisServer(log_dir / "redis").start()
    servers: list[srv.Server] = []
    try:
        cmd_a = _command(o, docs.model_dir, srv.free_port(), remote_url=redis.url)
        disk = str(log_dir / "b-disk")
        cmd_b = _command(o, docs.model_dir, srv.free_port(), remote_url=redis.url, disk_dir=disk)
        out["commands"].update(A=shlex.join(cmd_a), B=shlex.join(cmd_b))
        a = _start("A", cmd_a, log_dir, o, docs.warm)
        servers.append(a)
        b = _start("B", cmd_b, log_dir, o, docs.warm)
        servers.append(b)
        recs = out["records"]
        for r, doc in enumerate(docs.docs):
            recs["A"].append(ask(a, f"doc{r}", doc, o.max_tokens, None))
            pair = [("cold", f"cold-{r}"), ("remote", None)]
            for kind, salt in pair if r % 2 else pair[::-1]:
                recs[kind].append(ask(b, f"doc{r}", doc, o.max_tokens, salt))
        a.stop()
        _progress("restarting B (its disk tier keeps its prefix cache)")
        b.stop()
        b = _start("B", cmd_b, log_dir, o, docs.warm)
        servers.append(b)
        for r, doc in enumerate(docs.docs):
            recs["disk"].append(ask(b, f"doc{r}", doc, o.max_tokens, None))
        b.stop()
        out["redis_used_bytes"] = redis.used_memory()
        _slow_phase(o, docs, redis, log_dir, out)
    finally:
        for server in servers:
            server.stop()
        redis.stop()
    out["load_end"] = os.getloadavg()[0]
    out["summary"] = summarize(out)
    return out


def skip_reason() -> str | None:
    """Why the bench cannot run here (no redis-server, no redis client), or None."""
    if _redis.REDIS_SERVER is None:
        return "redis-server is not installed (apt-get install -y redis-server)"
    if importlib.util.find_spec("redis") is None:
        return "the redis client is missing (pip install 'kvstrata[remote]')"
    return None


def run(args: argparse.Namespace) -> int:
    """Run the bench; exit 1 when a request failed or came back short."""
    _STARTED[0] = time.monotonic()
    o = _options(args)
    why = skip_reason()
    if why:
        print(f"kvstrata bench remote skipped: {why}", flush=True)
        return 0
    if importlib.util.find_spec("openai") is None:
        raise MissingExtraError("kvstrata bench remote needs the openai client: pip install openai")
    from kvstrata.server.deps import require_serve

    require_serve()
    out = measure(o)
    for line in report_lines(out):
        print(line, flush=True)
    if o.json:
        Path(o.json).write_text(json.dumps(out, indent=1))
        print(f"raw numbers: {o.json}")
    bad = [k for k, row in out["summary"]["rows"].items() if not row["complete"]]
    if bad:
        print(f"requests failed or came back short: {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0
