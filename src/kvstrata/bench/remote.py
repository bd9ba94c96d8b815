"""`kvstrata bench remote`: two `kvstrata serve` processes sharing one real Redis.

One `redis-server` on a free loopback port (no persistence), server A and server B
(`kvstrata serve --remote-url` at it; B also has a disk tier), both driven over HTTP by
the official `openai` client (streamed greedy completions, end-of-sequence ignored).
Each repeat takes a fresh document (real text, --doc-tokens tokens + a short question):

  A          A answers it first (a cold prefill; its blocks go to Redis, write-behind)
  B cold     B answers it under a fresh cache_salt: another namespace, nothing local
             or remote to reuse (the remote lookup misses) — a cold B
  B remote   B answers it as A did: its blocks come from Redis (one batched read)
  B disk     B restarted (its disk tier persists its prefix cache at shutdown) answers
             it again: a hit on its own disk tier
  slow       B_slow (no disk) reaches Redis through a proxy that holds every answer back
             --delay-ms: after one prefill teaches it this machine's prefill speed, the
             link model predicts loading slower than recomputing, so it recomputes
             (slow remote: A's document; slow cold: a fresh salt)

B cold and B remote alternate their order across repeats; every request waits until
the servers' write-behind queues are empty (kvstrata_remote_pending_bytes), so no
measurement shares the cores with another's writes. Reported: TTFT medians (with
the 1-minute load average at each request), speed-ups against B cold, greedy text
identical to B cold's, prompt tokens served from a cache (usage), the remote round
trip per block (kvstrata_remote_read_seconds over kvstrata_remote_hits from B's
/metrics), and for the slow link the cost rule's decisions and the figures it
compared (kvstrata_remote_link_*, kvstrata_remote_compute_tokens_per_second).

Time (smollm2, 4096-token documents, 2 cores): about 4 minutes per repeat;
--quick (the tiny embedded model, 512 tokens, 1 repeat) well under a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvstrata.bench import _peer_servers as srv
from kvstrata.bench import _peer_workloads as wl
from kvstrata.bench import _redis, _timing
from kvstrata.core.errors import ConfigError, KvstrataError, MissingExtraError

NAME = "remote"
HELP = "two kvstrata serve sharing one Redis: B's TTFT on A's documents vs cold, disk, slow link"
IN_ALL = False  # three servers and a Redis, minutes: not part of `kvstrata bench all`
QUESTION = "\n\nQuestion: what does the code above do? Answer:"
WARMUP_PROMPT = "def warm_up(server):\n    return server\n"
BLOCK_TOKENS = 64
SETTLE_TIMEOUT_S = 300.0
# Done-when targets of issue #28 (reported, never asserted by the tests)
TARGET_SPEEDUP, TARGET_SLOW_WITHIN = 3.0, 0.10
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
        help="the slow link's delay per answer chunk, ms (200; --quick 1000: a tiny model's "
        "blocks are few, so only a longer delay makes loading them slower than recomputing)",
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
    o.delay_ms = o.delay_ms or (1000 if o.quick else 200)
    _timing.check_positive(o, "repeats", "doc_tokens", "max_tokens", "delay_ms", "health_timeout")
    try:
        o.kvstrata_args = shlex.split(o.kvstrata_args or "")
    except ValueError as exc:
        raise ConfigError.field(
            "kvstrata_args", args.kvstrata_args, f"shell words ({exc})"
        ) from None
    return o


def _model(name: str | None, quick: bool) -> tuple[str, Path]:
    from kvstrata.model.zoo import EMBEDDED_NAMES, resolve_model_dir

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
    cmd = [
        sys.executable, "-m", "kvstrata.cli", "serve", "--model", str(model_dir),
        "--host", "127.0.0.1", "--port", str(port), "--no-status",
        "--block-size", str(BLOCK_TOKENS),
    ]  # fmt: skip
    for flag, value in flags.items():
        cmd += [f"--{flag.replace('_', '-')}", value]
    if o.remote_codec:
        cmd += ["--remote-codec", o.remote_codec]
    return cmd + o.kvstrata_args


def _start(name: str, command: list[str], log_dir: Path, o: argparse.Namespace, warm: list[int]):
    server = srv.Server(
        name, "remote", command, int(command[command.index("--port") + 1]),
        log_dir / f"{name}.log", srv.server_env("kvstrata"),
    )  # fmt: skip
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


def ask(server: srv.Server, key: str, prompt: list[int], max_tokens: int, salt: str | None):
    """One streamed request: the client's record, the load before it, and the change
    of the server's remote counters across it (writes settled first and after)."""
    settle(server)
    before, load = remote_counts(scrape(server)), os.getloadavg()[0]

    async def go() -> dict[str, Any]:
        async with srv._client(server) as client:
            return await srv.send(client, server.model, wl.Req(key, prompt, max_tokens), salt)

    record = asyncio.run(go())
    after = remote_counts(scrape(server))
    record["remote"] = {k: after[k] - before[k] for k in after}
    record["load_1m"] = load
    settle(server)
    _progress(
        f"{server.variant} {key}: TTFT {record['ttft_s']:.3f} s, cached "
        f"{record['cached_tokens']}, remote hits {record['remote']['hits']:.0f}, load {load:.2f}"
    )
    return record


# -- the run --------------------------------------------------------------------------------


class Docs:
    """The model, its tokenizer and the documents (fresh text per repeat + a question)."""

    def __init__(self, o: argparse.Namespace) -> None:
        from kvstrata.model.zoo import heldout_files, load_tokenizer

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
    proxy = _redis.SlowProxy(redis.port, o.delay_ms / 1000)
    server = None
    try:
        port = srv.free_port()
        # a long deadline: what keeps B_slow from loading is the cost rule, not a timeout
        cmd = _command(o, docs.model_dir, port, remote_url=proxy.url, remote_timeout="30")
        server = _start("B_slow", cmd, log_dir, o, docs.warm)
        out["commands"]["B_slow"] = shlex.join(cmd)
        out["slow_warm"] = ask(server, "warm", docs.warm_doc, o.max_tokens, "warm")
        for r, doc in enumerate(docs.docs):
            pair = [("slow_cold", f"slowcold-{r}"), ("slow_remote", None)]
            for kind, salt in pair if r % 2 else pair[::-1]:
                out["records"][kind].append(ask(server, f"doc{r}", doc, o.max_tokens, salt))
        m = scrape(server)
        out["slow_link"] = {
            "latency_s": m.get("kvstrata_remote_link_latency_seconds"),
            "bytes_per_s": m.get("kvstrata_remote_link_bytes_per_second"),
            "compute_tok_s": m.get("kvstrata_remote_compute_tokens_per_second"),
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
        "scenario": NAME, "command": shlex.join(sys.argv), "model": docs.model_name,
        "doc_tokens": o.doc_tokens, "prompt_tokens": len(docs.docs[0]), "repeats": o.repeats,
        "max_tokens": o.max_tokens, "delay_ms": o.delay_ms, "block_tokens": BLOCK_TOKENS,
        "log_dir": str(log_dir), "commands": {}, "records": {k: [] for k in kinds},
        "load_start": os.getloadavg()[0], "cores": os.cpu_count(),
    }  # fmt: skip
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


# -- the report -----------------------------------------------------------------------------


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v == v]
    return statistics.median(values) if values else None


def summarize(out: dict[str, Any]) -> dict[str, Any]:
    """Medians, ratios against B cold, agreement with B cold's text, the round trip per
    block, the slow link's decisions, and the done-when verdicts."""
    recs = out["records"]
    cold_text = [r["text"] for r in recs["cold"]]
    rows: dict[str, dict[str, Any]] = {}
    for kind, records in recs.items():
        if not records:
            continue
        ttft = _median([r["ttft_s"] for r in records])
        same = [r["text"] == c for r, c in zip(records, cold_text, strict=False)]
        rows[kind] = {
            "ttft_s": ttft,
            "ttft_all_s": [r["ttft_s"] for r in records],
            "load_1m": [r["load_1m"] for r in records],
            "cached_tokens": _median([r["cached_tokens"] or 0 for r in records]),
            "remote_hits": sum(r["remote"]["hits"] for r in records),
            "decisions_load": sum(r["remote"]["load"] for r in records),
            "decisions_recompute": sum(r["remote"]["recompute"] for r in records),
            "timeouts": sum(r["remote"]["timeouts"] for r in records),
            "same_as_cold": f"{sum(same)}/{len(same)}",
            "identical": all(same) and len(same) == len(records),
            "complete": all(
                r["error"] is None and r["completion_tokens"] == r["max_tokens"] for r in records
            ),
        }
    cold = rows.get("cold", {}).get("ttft_s")
    for row in rows.values():
        row["vs_cold"] = cold / row["ttft_s"] if cold and row["ttft_s"] else None
    hits = sum(r["remote"]["hits"] for r in recs["remote"])
    read_s = sum(r["remote"]["read_s"] for r in recs["remote"])
    nbytes = sum(r["remote"]["bytes_read"] for r in recs["remote"])
    per_block = {
        "blocks": hits,
        "reads": sum(r["remote"]["reads"] for r in recs["remote"]),
        "read_s": read_s,
        "ms_per_block": 1e3 * read_s / hits if hits else None,
        "bytes_per_block": nbytes / hits if hits else None,
        "mb_per_s": nbytes / read_s / 1e6 if read_s else None,
    }
    verdicts: dict[str, Any] = {}
    if "remote" in rows and cold:
        r = rows["remote"]
        verdicts["remote_speedup"] = r["vs_cold"]
        verdicts["remote_target_met"] = bool(
            r["vs_cold"] and r["vs_cold"] >= TARGET_SPEEDUP and r["identical"]
        )
    if "slow_remote" in rows and cold:
        slow = rows["slow_remote"]["ttft_s"]
        own = rows.get("slow_cold", {}).get("ttft_s")
        verdicts["slow_vs_cold"] = slow / cold - 1
        verdicts["slow_vs_own_cold"] = slow / own - 1 if own else None
        verdicts["slow_target_met"] = abs(slow / cold - 1) <= TARGET_SLOW_WITHIN
    predicted = {}
    link = out.get("slow_link") or {}
    if link.get("latency_s") is not None and per_block["bytes_per_block"]:
        blocks = out["doc_tokens"] // out["block_tokens"]
        load = link["latency_s"] + (
            blocks * per_block["bytes_per_block"] / link["bytes_per_s"]
            if link.get("bytes_per_s")
            else 0.0
        )
        predicted = {"load_s": load, "blocks": blocks}
        if link.get("compute_tok_s"):
            predicted["recompute_s"] = blocks * out["block_tokens"] / link["compute_tok_s"]
    return {"rows": rows, "round_trip": per_block, "predicted": predicted, "verdicts": verdicts}


LABELS = {
    "A": "A (writes the document)",
    "cold": "B cold (fresh salt)",
    "remote": "B remote hit (A's blocks)",
    "disk": "B own disk tier (restarted)",
    "slow_cold": "B_slow cold (fresh salt)",
    "slow_remote": "B_slow, A's doc (slow link)",
}


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None or x != x else format(x, fmt)


def report_lines(out: dict[str, Any]) -> list[str]:
    s = out["summary"]
    lines = [
        f"kvstrata bench remote: {out['model']}, {out['prompt_tokens']}-token prompts "
        f"({out['doc_tokens']}-token documents), {out['repeats']} repeat(s), "
        f"{out['max_tokens']} greedy tokens, {out['block_tokens']}-token blocks, "
        f"{out['cores']} cores",
        f"{'configuration':30} {'TTFT s':>8} {'x cold':>7} {'cached':>7} {'remote':>7} "
        f"{'load/recomp':>11} {'same as cold':>12} {'load 1m':>12}",
    ]
    for kind, row in s["rows"].items():
        loads = ",".join(f"{x:.1f}" for x in row["load_1m"])
        lines.append(
            f"{LABELS[kind]:30} {_f(row['ttft_s']):>8} {_f(row['vs_cold'], '.2f'):>7} "
            f"{_f(row['cached_tokens'], '.0f'):>7} {row['remote_hits']:>7.0f} "
            f"{row['decisions_load']:>5.0f}/{row['decisions_recompute']:<5.0f} "
            f"{row['same_as_cold']:>12} {loads:>12}"
        )
    rt = s["round_trip"]
    lines.append(
        f"remote round trip (B's hits): {rt['blocks']:.0f} blocks in {rt['reads']:.0f} batched "
        f"read(s), {_f(rt['ms_per_block'])} ms/block, {_f(rt['bytes_per_block'], ',.0f')} "
        f"bytes/block, {_f(rt['mb_per_s'], '.0f')} MB/s"
    )
    link = out.get("slow_link") or {}
    if link:
        p, bw = s["predicted"], (link.get("bytes_per_s") or 0) / 1e6
        lines.append(
            f"slow link ({out['delay_ms']} ms per answer chunk): link model latency "
            f"{_f(link.get('latency_s'))} s, bandwidth {_f(bw, '.1f')}"
            f" MB/s, prefill {_f(link.get('compute_tok_s'), '.0f')} tok/s -> predicted load "
            f"{_f(p.get('load_s'), '.2f')} s vs recompute {_f(p.get('recompute_s'), '.2f')} s for "
            f"{p.get('blocks', '-')} blocks; decisions load {link['load']:.0f} / recompute "
            f"{link['recompute']:.0f}, timeouts {link['timeouts']:.0f}, reads {link['reads']:.0f}"
        )
    v = s["verdicts"]
    if "remote_speedup" in v:
        lines.append(
            f"target B remote >= {TARGET_SPEEDUP:.0f}x faster than cold B, identical tokens: "
            f"{_f(v['remote_speedup'], '.2f')}x -> {'met' if v['remote_target_met'] else 'NOT met'}"
        )
    if "slow_vs_cold" in v:
        lines.append(
            f"target slow link within {100 * TARGET_SLOW_WITHIN:.0f} % of cold B: "
            f"{100 * v['slow_vs_cold']:+.1f} % (vs B_slow's own cold "
            f"{_f(None if v['slow_vs_own_cold'] is None else 100 * v['slow_vs_own_cold'], '+.1f')}"
            f" %) -> {'met' if v['slow_target_met'] else 'NOT met'}"
        )
    lines.append(
        f"load average (1 min) at start {out['load_start']:.2f}, at end {out['load_end']:.2f}; "
        f"Redis held {out.get('redis_used_bytes', 0) / 2**20:.0f} MiB; logs {out['log_dir']}"
    )
    return lines


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
