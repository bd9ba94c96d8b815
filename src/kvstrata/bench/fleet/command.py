"""`kvstrata bench fleet`'s command: its flags (checked, exit 2), the model and the
workload, and the run (per policy: a fresh fleet, the warm-up, the measured phase)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shlex
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvstrata.bench import _timing
from kvstrata.bench._models import bench_model, heldout_ids
from kvstrata.bench.fleet import processes as proc
from kvstrata.bench.fleet import report as rep
from kvstrata.bench.fleet import workload as wl
from kvstrata.bench.machine import describe
from kvstrata.core.errors import ConfigError, KvstrataError, MissingExtraError

NAME = "fleet"
HELP = "N kvstrata serve replicas behind vllm-router: routing policies, shared remote tier"
IN_ALL = False  # several servers per policy, minutes each: not part of `kvstrata bench all`
QUICK = wl.Sizes(tenants=6, system_tokens=512, requests=18, rate=1.0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = wl.Sizes()
    parser.add_argument(
        "--model", default=None, help="model (default smollm2 if installed, else tiny)"
    )
    parser.add_argument("--replicas", type=int, default=3, help="kvstrata serve replicas (3)")
    parser.add_argument(
        "--policies",
        default=",".join(proc.POLICIES),
        help=f"policies to run, in order (default all: {', '.join(proc.POLICIES)})",
    )
    parser.add_argument("--tenants", type=int, default=None, help=f"tenants ({d.tenants})")
    parser.add_argument(
        "--system-tokens",
        type=int,
        default=None,
        help=f"tokens of each tenant's system prompt ({d.system_tokens})",
    )
    parser.add_argument(
        "--requests", type=int, default=None, help=f"measured requests ({d.requests})"
    )
    parser.add_argument(
        "--rate", type=float, default=None, help=f"mean arrivals per second ({d.rate})"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=None, help=f"tokens per answer ({d.max_tokens})"
    )
    parser.add_argument(
        "--hold",
        type=int,
        default=None,
        help="tenants' system prompts one replica's device + host budgets hold "
        "(default: tenants / replicas, rounded up)",
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (16)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per replica (1)")
    parser.add_argument(
        "--max-num-seqs", type=int, default=4, help="sequences a replica runs at once (4)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK.tenants} tenants of {QUICK.system_tokens} tokens, {QUICK.requests} "
        "requests (flags above still apply)",
    )
    parser.add_argument(
        "--kv-temperature",
        type=float,
        default=0.1,
        help="kv_aware's --router-temperature (0.1; at 0 a tie of costs goes to the "
        "first replica, so tenants that arrive one at a time all land there)",
    )
    parser.add_argument("--seed", type=int, default=0, help="text, order and arrival times (0)")
    parser.add_argument(
        "--router-args", default=None, help='extra vllm-router flags: --router-args="..."'
    )
    parser.add_argument(
        "--kvstrata-args", default=None, help='extra kvstrata serve flags: --kvstrata-args="..."'
    )
    parser.add_argument(
        "--health-timeout", type=int, default=300, help="seconds a server may take to start"
    )
    parser.add_argument("--log-dir", default=None, help="keep the servers' logs here")
    parser.add_argument("--json", default=None, metavar="PATH", help="write every number here")
    parser.add_argument("--plot", default=None, metavar="PNG", help="draw the figure here")


def _options(args: argparse.Namespace) -> argparse.Namespace:
    """The flags checked (ConfigError, exit 2) and settled."""
    _timing.check_positive(args, "replicas", "block_size", "threads", "max_num_seqs")
    _timing.check_positive(args, "health_timeout")
    if not 0 <= args.kv_temperature < math.inf:
        raise ConfigError.field("--kv-temperature", args.kv_temperature, "a number >= 0")
    base = QUICK if args.quick else wl.Sizes()
    fields = {}
    for name in ("tenants", "system_tokens", "requests", "rate", "max_tokens"):
        value = getattr(args, name)
        if value is None:
            continue
        if not value > 0 or not math.isfinite(value):
            flag = "--" + name.replace("_", "-")
            raise ConfigError.field(flag, value, "a positive number")
        fields[name] = value
    sizes = wl.Sizes(**{**vars(base), **fields})
    names = [n.strip() for n in str(args.policies).split(",") if n.strip()]
    if not names or any(n not in proc.POLICIES for n in names):
        known = ", ".join(proc.POLICIES)
        raise ConfigError.field("--policies", args.policies, f"comma-separated names from {known}")
    shared = [n for n in names if proc.POLICIES[n][1]]
    if shared and not proc.redis_available():
        raise ConfigError.field(
            "--policies",
            args.policies,
            f"{shared[0]} needs redis-server (apt-get install redis-server) and the redis "
            "client (pip install 'kvstrata[remote]'), or leave the +remote policies out",
        )
    if args.hold is not None and args.hold <= 0:
        raise ConfigError.field("--hold", args.hold, "a positive number of tenants")
    o = argparse.Namespace(**vars(args))
    o.sizes, o.policies = sizes, list(dict.fromkeys(names))
    o.hold = args.hold or -(-sizes.tenants // args.replicas)
    o.router_args = tuple(shlex.split(args.router_args or ""))
    o.kvstrata_args = tuple(shlex.split(args.kvstrata_args or ""))
    return o


_STARTED = [time.monotonic()]


def _progress(text: str) -> None:
    elapsed = time.monotonic() - _STARTED[0]
    print(f"[fleet {elapsed:6.0f} s] {text}", file=sys.stderr, flush=True)


class Context:
    """The model, its tokenizer, the workload and the replicas' budgets."""

    def __init__(self, o: argparse.Namespace) -> None:
        from kvstrata.model.geometry import KVGeometry
        from kvstrata.workload.zoo import load_tokenizer

        self.o = o
        self.model_name, self.model_dir = bench_model(o.model, _progress)
        tok = load_tokenizer(self.model_dir)
        s = o.sizes
        need = s.tenants * s.system_tokens + (s.tenants + s.requests) * s.question_tokens
        ids = heldout_ids(tok, need)
        self.workload = wl.build(ids, tok.decode, s, o.seed)
        self.prompt_tokens = len(tok(self.workload.warmup[0].prompt)["input_ids"])
        self.bytes_per_token = int(KVGeometry.from_json(self.model_dir).bytes_per_token("fp32"))
        # one replica holds `hold` tenants' prompts: half on its device tier, the rest
        # and one request's worth of room for the running ones on its host tier
        tenant = self.prompt_tokens * self.bytes_per_token
        device = -(-o.hold // 2)
        self.device_budget = device * tenant
        self.host_budget = (o.hold - device + 1) * tenant
        self.spec = proc.ReplicaSpec(
            self.model_dir,
            self.model_name,
            o.block_size,
            self.device_budget,
            self.host_budget,
            o.threads,
            o.max_num_seqs,
            o.kvstrata_args,
        )


async def _phase(
    url: str, model: str, reqs: list[wl.Req], label: str | None
) -> list[dict[str, Any]]:
    """Send each request at its time (open loop) through the router; every record
    (progress under `label`, none when None)."""
    import openai

    from kvstrata.bench.peer.servers import REQUEST_TIMEOUT_S, send

    done = [0]
    step = max(1, len(reqs) // 4)

    async with openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=REQUEST_TIMEOUT_S
    ) as client:
        t0 = time.perf_counter()

        async def one(req: wl.Req) -> dict[str, Any]:
            await asyncio.sleep(max(0.0, t0 + req.at - time.perf_counter()))
            record = await send(client, model, req)  # type: ignore[arg-type]
            record["tenant"], record["sent_s"] = req.tenant, req.at
            done[0] += 1
            if label is not None and (done[0] % step == 0 or done[0] == len(reqs)):
                _progress(f"{label}: {done[0]}/{len(reqs)} answered")
            return record

        return list(await asyncio.gather(*(one(r) for r in reqs)))


def _warmup(url: str, model: str, reqs: list[wl.Req], in_flight: int) -> list[dict[str, Any]]:
    """The warm-up: every tenant once, in order, `in_flight` at a time (a router that
    weighs load spreads the tenants over the replicas)."""

    async def go() -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for i in range(0, len(reqs), in_flight):
            out += await _phase(url, model, reqs[i : i + in_flight], None)
        _progress(f"warm-up: {len(out)} tenants asked once")
        return out

    return asyncio.run(go())


def _start_all(servers: list[Any], timeout: float) -> None:
    with ThreadPoolExecutor(len(servers)) as pool:
        for future in [pool.submit(s.start, timeout) for s in servers]:
            future.result()


def _run_policy(ctx: Context, name: str, router_bin: str, log_dir: Path) -> dict[str, Any]:
    """One policy on a fresh fleet (replicas, Redis when shared, the router)."""
    from kvstrata.bench._redis import RedisServer

    o = ctx.o
    load = _timing.machine_load()[0]
    policy, shared = proc.POLICIES[name]
    redis = RedisServer(Path(tempfile.mkdtemp(prefix="kvstrata-fleet-redis-"))) if shared else None
    replicas: list[proc.Replica] = []
    router = None
    try:
        if redis is not None:
            redis.start()
        remote = redis.url if redis is not None else None
        replicas = [proc.replica(ctx.spec, i, log_dir, remote) for i in range(o.replicas)]
        _progress(f"{name}: starting {o.replicas} replicas (logs in {log_dir})")
        _start_all([r.server for r in replicas], o.health_timeout)
        router = proc.router(
            router_bin, policy, replicas, ctx.spec, log_dir, o.kv_temperature, o.router_args
        )
        router.start(o.health_timeout)
        time.sleep(1.0)  # the router's event subscribers connect (a PUB keeps no history)
        urls = [r.server.url for r in replicas]
        t0 = time.perf_counter()
        warm = _warmup(router.url, ctx.model_name, ctx.workload.warmup, o.replicas)
        warm_summary = wl.summarize(warm, time.perf_counter() - t0)
        time.sleep(1.0)  # the warm-up's events reach the router
        before = [proc.counters(u) or {} for u in urls]
        t0 = time.perf_counter()
        records = asyncio.run(_phase(router.url, ctx.model_name, ctx.workload.measured, name))
        summary = wl.summarize(records, time.perf_counter() - t0)
        after = [proc.counters(u) or {} for u in urls]
        summary["sources"] = wl.sources(proc.total(before), proc.total(after))
        summary["per_replica"] = [
            a.get("requests", 0.0) - b.get("requests", 0.0)
            for b, a in zip(before, after, strict=True)
        ]
        return {
            "load_at_start": load,
            "router": shlex.join(router.command),
            "replica": shlex.join(replicas[0].server.command),
            "warmup": warm_summary,
            "measured": summary,
            "records": records,
            "warmup_records": warm,
        }
    finally:
        if router is not None:
            router.stop()
        for r in replicas:
            r.server.stop()
        if redis is not None:
            redis.stop()


def measure(o: argparse.Namespace) -> dict[str, Any]:
    ctx = Context(o)
    router_bin = proc.find_router()
    # the replicas load every core themselves: warn of load from elsewhere, as for one
    warning = _timing.load_warning(o.threads)
    if warning:
        _progress(f"warning: {warning}")
    log_dir = Path(o.log_dir) if o.log_dir else Path(tempfile.mkdtemp(prefix="kvstrata-fleet-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "scenario": NAME,
        "command": shlex.join(["kvstrata", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": describe(o.threads),
        "machine_warning": warning,
        "model": ctx.model_name,
        "replicas": o.replicas,
        "workload": {**vars(o.sizes), "prompt_tokens": ctx.prompt_tokens, "seed": o.seed},
        "budgets": {
            "hold_tenants": o.hold,
            "device_bytes": ctx.device_budget,
            "host_bytes": ctx.host_budget,
        },
        "block_size": o.block_size,
        "log_dir": str(log_dir),
        "policies": {},
        "errors": [],
    }
    for name in o.policies:
        try:
            report["policies"][name] = _run_policy(ctx, name, router_bin, log_dir)
        except KvstrataError as exc:
            report["errors"].append(f"{name}: {exc}")
            _progress(f"{name} left out: {str(exc).splitlines()[0]}")
            continue
        m = report["policies"][name]["measured"]
        _progress(
            f"{name}: TTFT p50 {m['ttft_p50_s']:.2f} s, p90 {m['ttft_p90_s']:.2f} s, "
            f"{m['errors']} error(s)"
        )
    runs = {n: p["records"] for n, p in report["policies"].items()}
    report["machine"]["load_after"] = _timing.machine_load()[0]
    report["texts"] = wl.texts_equal(runs)
    report["ratios"] = rep.ratios(report)
    return report


def run(args: argparse.Namespace) -> int:
    """Run every policy; exit 1 when a request failed or a policy's text differed."""
    _STARTED[0] = time.monotonic()
    o = _options(args)
    try:
        import openai  # noqa: F401 - the client the bench sends through the router with
    except ModuleNotFoundError:
        raise MissingExtraError(
            "kvstrata bench fleet needs the openai client: pip install openai"
        ) from None
    from kvstrata.server.deps import require_serve

    require_serve()
    proc.find_router()
    report = measure(o)
    rep.print_report(report)
    if o.json:
        Path(o.json).write_text(json.dumps(_timing.plain(report), indent=1))
        print(f"raw numbers: {o.json}")
    if o.plot:
        rep.plot(report, Path(o.plot))
        print(f"figure: {o.plot}")
    bad = rep.failures(report)
    for line in bad:
        print(f"kvstrata bench fleet: {line}", file=sys.stderr)
    return 1 if bad else 0
