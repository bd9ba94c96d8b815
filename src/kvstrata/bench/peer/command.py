"""`kvstrata bench peer`'s command: its flags (checked, exit 2), the model and workloads
of every repeat, the KV sizes, and the run (servers started per size, repeats
alternating them). What it measures: the package docstring (kvstrata.bench.peer)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvstrata.bench import _timing
from kvstrata.bench._models import bench_model, heldout_ids
from kvstrata.bench.machine import describe
from kvstrata.bench.peer import report as rep
from kvstrata.bench.peer import servers as srv
from kvstrata.bench.peer import workloads as wl
from kvstrata.core.errors import ConfigError, KvstrataError, MissingExtraError

NAME = "peer"
HELP = "kvstrata serve vs vLLM-CPU's OpenAI server over HTTP (docqa, chat, throughput)"
IN_ALL = False  # two servers per size, minutes each: not part of `kvstrata bench all`
WARMUP_PROMPT = "def warm_up(server):\n    return server\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="model (default smollm2 if installed, else tiny)"
    )
    parser.add_argument("--sizes", default="fits,quarter", help="KV sizes (default: both)")
    parser.add_argument(
        "--variants",
        default=",".join(srv.DEFAULT_VARIANTS),
        help=f"servers to run (default: {', '.join(srv.DEFAULT_VARIANTS)}; all: "
        f"{', '.join(srv.VARIANTS)})",
    )
    parser.add_argument(
        "--only",
        default=",".join(wl.WORKLOADS),
        help=f"workloads to run (default all: {', '.join(wl.WORKLOADS)})",
    )
    parser.add_argument("--repeats", type=int, default=3, help="alternated rounds per server")
    parser.add_argument("--quick", action="store_true", help="1 repeat of small workloads")
    parser.add_argument("--docs", type=int, default=None, help="docqa documents (6)")
    parser.add_argument("--users", type=int, default=None, help="chat users (4)")
    parser.add_argument("--rounds", type=int, default=None, help="chat rounds per user (3)")
    parser.add_argument("--requests", type=int, default=None, help="throughput requests (32)")
    parser.add_argument("--no-vllm", action="store_true", help="run the kvstrata variants only")
    parser.add_argument("--vllm-python", default=None, help="vLLM's python (<repo>/.venv-vllm)")
    parser.add_argument(
        "--kvstrata-args",
        default=None,
        help='extra kvstrata serve flags: --kvstrata-args="--threads 2"',
    )
    parser.add_argument("--vllm-args", default=None, help='extra vLLM flags: --vllm-args="..."')
    parser.add_argument(
        "--health-timeout",
        type=int,
        default=int(srv.HEALTH_TIMEOUT_S),
        help=f"seconds a server may take to start (default {srv.HEALTH_TIMEOUT_S:.0f})",
    )
    parser.add_argument("--log-dir", default=None, help="keep the servers' logs here")
    parser.add_argument("--json", default=None, metavar="PATH", help="write every number here")


def _names(value: str, flag: str, known: tuple[str, ...]) -> list[str]:
    names = [n.strip() for n in str(value).split(",") if n.strip()]
    if not names or any(n not in known for n in names):
        raise ConfigError.field(flag, value, f"comma-separated names from {', '.join(known)}")
    return [n for n in known if n in names]  # the canonical order


def _options(args: argparse.Namespace) -> argparse.Namespace:
    """The flags checked (ConfigError, exit 2) and settled: lists, sizes, extra args."""
    _timing.check_positive(args, "repeats", "health_timeout")
    for name in ("docs", "users", "rounds", "requests"):
        if getattr(args, name) is not None:
            _timing.check_positive(args, name)
    o = argparse.Namespace(**vars(args))
    o.sizes = _names(args.sizes, "sizes", srv.SIZES)
    o.variants = _names(args.variants, "variants", srv.VARIANTS)
    o.only = _names(args.only, "only", wl.WORKLOADS)
    for flag in ("kvstrata_args", "vllm_args"):
        try:
            setattr(o, flag, shlex.split(getattr(args, flag) or ""))
        except ValueError as exc:
            raise ConfigError.field(flag, getattr(args, flag), f"shell words ({exc})") from None
    if not _runnable(o):
        raise ConfigError.field(
            "variants",
            args.variants,
            f"none of them runs at --sizes {args.sizes} ("
            + "; ".join(f"{s}: {', '.join(srv.AT_SIZE[s])}" for s in o.sizes)
            + ")",
        )
    base = wl.QUICK if args.quick else wl.Sizes()
    o.repeats = 1 if args.quick else args.repeats
    o.workload = wl.shrink(
        base, docs=args.docs, users=args.users, rounds=args.rounds, requests=args.requests
    )
    return o


_STARTED = [time.monotonic()]  # when the run began (reset by `run`)


def _progress(text: str) -> None:
    elapsed = time.monotonic() - _STARTED[0]
    print(f"[peer {elapsed:6.0f} s] {text}", file=sys.stderr, flush=True)


class Context:
    """The model, its tokenizer, the workloads of every repeat and the KV sizes."""

    def __init__(self, o: argparse.Namespace) -> None:
        from kvstrata.model.geometry import KVGeometry
        from kvstrata.workload.zoo import load_tokenizer

        self.o = o
        self.model_name, self.model_dir = bench_model(o.model, _progress)
        tok = load_tokenizer(self.model_dir)
        self.encode = lambda text: list(tok(text, add_special_tokens=False)["input_ids"])
        ids = heldout_ids(tok, wl.tokens_needed(o.workload, o.repeats))
        self.frame = wl.Frame.build(self.encode)
        self.plans = wl.plans(wl.TokenPool(ids), self.frame, o.workload, o.repeats)
        config = json.loads((self.model_dir / "config.json").read_text())
        limit = config.get("max_position_embeddings")
        self.max_len = wl.max_model_len(
            self.plans, o.only, limit if isinstance(limit, int) else None
        )
        self.bytes_per_token = int(KVGeometry.from_json(self.model_dir).bytes_per_token("fp32"))
        self.working_set = wl.working_set_tokens(self.plans[0], o.only, o.workload)
        self.sizes = self._kv_sizes()

    def _kv_sizes(self) -> dict[str, srv.KVSize]:
        block = srv.BLOCK_TOKENS
        up = lambda n: -(-int(n) // block) * block  # noqa: E731 - whole blocks
        # vLLM wants room for one whole --max-model-len request besides its null block
        quarter = max(up(self.working_set / 4), up(self.max_len) + block)
        self.quarter_raised = quarter > up(self.working_set / 4)
        fits = up(max(srv.FITS_TOKENS, 2 * self.working_set, self.max_len))
        return {
            name: srv.KVSize(name, tokens, tokens * self.bytes_per_token)
            for name, tokens in (("fits", fits), ("quarter", quarter))
        }


# -- the run ------------------------------------------------------------------------------


def _command(
    ctx: Context, variant: str, size: srv.KVSize, port: int, scratch: Path | None
) -> list[str]:
    o = ctx.o
    if variant in srv.VLLM_VARIANTS:
        cmd = srv.vllm_command(
            o.vllm_python, ctx.model_dir, port, variant, size, ctx.max_len, scratch
        )
        return cmd + o.vllm_args
    cmd = srv.kvstrata_command(ctx.model_dir, port, variant, size, ctx.bytes_per_token)
    return cmd + o.kvstrata_args


def _start(
    ctx: Context, size: str, variants: list[str], log_dir: Path, errors: list[str]
) -> list[srv.Server]:
    """Start the servers of one size one after another; a server that fails to start
    is left out (its error, with its log's tail, goes to `errors`)."""
    servers: list[srv.Server] = []
    try:
        for variant in variants:
            port = srv.free_port()
            scratch = None  # vllm_kvstrata_disk's disk tier: fresh, removed at its stop
            if variant == "vllm_kvstrata_disk":
                scratch = Path(tempfile.mkdtemp(prefix="kvstrata-peer-disk-"))
            server = srv.Server(
                variant,
                size,
                _command(ctx, variant, ctx.sizes[size], port, scratch),
                port,
                log_dir / f"{size}-{variant}.log",
                srv.server_env(variant),
                scratch=scratch,
            )
            _progress(f"{size}: starting {variant} (log {server.log_path})")
            try:
                server.start(ctx.o.health_timeout)
                srv.warm_up(server, ctx.encode(WARMUP_PROMPT))
            except KvstrataError as exc:
                server.stop()
                errors.append(str(exc))
                _progress(f"{size}: {variant} left out: {str(exc).splitlines()[0]}")
                continue
            _progress(f"{size}: {variant} ready after {server.startup_s:.0f} s")
            servers.append(server)
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


def _measure_size(
    ctx: Context, size: str, variants: list[str], log_dir: Path, errors: list[str]
) -> dict[str, Any] | None:
    """Every workload on every server of one KV size, repeats alternating the servers
    (None when no server started)."""
    phases = [p for w in ctx.o.only for p in wl.PHASES[w]]
    servers = _start(ctx, size, variants, log_dir, errors)
    if not servers:
        return None
    rounds: dict[str, dict[str, list[Any]]] = {s.variant: {p: [] for p in phases} for s in servers}
    try:
        for r, plan in enumerate(ctx.plans):
            for server in servers:
                backend = server.variant in srv.BACKEND_VARIANTS
                for phase in phases:
                    _progress(f"{size}: repeat {r + 1}/{len(ctx.plans)} {server.variant} {phase}")
                    before = server.kvstrata_counters() if backend else None
                    result = srv.run_phase(server, phase, plan, ctx.o.workload, ctx.encode, f"r{r}")
                    after = server.kvstrata_counters() if before is not None else None
                    if before is not None and after is not None:  # kvstrata in this round
                        result["kvstrata"] = {k: v - before.get(k, 0) for k, v in after.items()}
                    rounds[server.variant][phase].append(result)
    finally:
        for server in servers:
            server.stop()
    startup = {s.variant: s.startup_s for s in servers}
    commands = {s.variant: shlex.join(s.command) for s in servers}
    return {
        "kv": vars(ctx.sizes[size]),
        "startup_s": startup,
        "commands": commands,
        "rounds": rounds,
    }


def _load_warning() -> str | None:
    """A warning when something else already loads the machine (vLLM and kvstrata
    serve use every core)."""
    load, cores = _timing.machine_load()
    if load <= _timing.LOAD_MARGIN:
        return None
    return (
        f"machine not idle: load average {load:.2f} on {cores} cores before the servers "
        "started; both servers use every core, so timings are slowed and noisy: compare "
        "ratios only, and re-measure on an idle machine"
    )


def measure(o: argparse.Namespace) -> dict[str, Any]:
    ctx = Context(o)
    if any(v in srv.VLLM_VARIANTS for v in o.variants):
        srv.check_vllm_model(ctx.model_dir)
    plan_variants = {size: [v for v in o.variants if v in srv.AT_SIZE[size]] for size in o.sizes}
    warning = _load_warning()
    if warning:
        _progress(f"warning: {warning}")
    if o.log_dir:
        log_dir = Path(o.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
    else:
        log_dir = Path(tempfile.mkdtemp(prefix="kvstrata-peer-"))
    report: dict[str, Any] = {
        "scenario": NAME,
        "command": shlex.join(["kvstrata", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": describe(),
        "model": ctx.model_name,
        "model_dir": str(ctx.model_dir),
        "bytes_per_token": ctx.bytes_per_token,
        "working_set_tokens": ctx.working_set,
        "max_model_len": ctx.max_len,
        "workload": wl.sizes_dict(o.workload),
        "workloads": o.only,
        "repeats": o.repeats,
        "vllm_skipped": o.vllm_skipped,
        "machine_warning": warning,
        "log_dir": str(log_dir),
        "sizes": {},
        "notes": [],
        "errors": [],
    }
    for size, variants in plan_variants.items():
        if not variants:
            continue
        result = _measure_size(ctx, size, variants, log_dir, report["errors"])
        if result is None:
            continue
        result["summary"] = wl.compare(result["rounds"])
        _add_backend_counters(result)
        report["sizes"][size] = result
    if "quarter" in report["sizes"] and ctx.quarter_raised:
        report["notes"].append(
            f"quarter: {ctx.sizes['quarter'].tokens} tokens, more than a quarter of the working "
            f"set: vLLM needs room for one --max-model-len ({ctx.max_len}) request + a block"
        )
    floor = srv.lossy_floor_bytes(ctx.bytes_per_token)
    if "kvstrata_int8" in plan_variants.get("quarter", ()) and floor > ctx.sizes["quarter"].bytes:
        report["notes"].append(
            f"kvstrata_int8: device budget raised to {floor / 2**20:.0f} MiB, the least "
            "kvstrata takes over a lossy host tier with 8 sequences (sinks + 128-token "
            "exact residual window + open block each)"
        )
    return report


def _add_backend_counters(result: dict[str, Any]) -> None:
    """Each backend variant's phase gets kvstrata's counters summed over its repeats
    (those whose /metrics answered before and after)."""
    for variant, phases in result["rounds"].items():
        for phase, results in phases.items():
            counted = [res["kvstrata"] for res in results if "kvstrata" in res]
            if not counted:
                continue
            total: dict[str, float] = {}
            for counters in counted:
                for key, value in counters.items():
                    total[key] = total.get(key, 0.0) + value
            result["summary"]["variants"][variant][phase]["kvstrata"] = total


def _settle_vllm(o: argparse.Namespace) -> bool:
    """Drop the vLLM variants when vLLM is absent (one line says why); False when
    nothing is left to run."""
    python, why = srv.find_vllm(o.vllm_python, o.no_vllm)
    o.vllm_python, o.vllm_skipped = python, None
    if python is None:
        o.vllm_skipped = why
        wanted = any(v in srv.VLLM_VARIANTS for v in o.variants)
        o.variants = [v for v in o.variants if v not in srv.VLLM_VARIANTS]
        if wanted:
            rest = "running the kvstrata variants only" if _runnable(o) else "nothing else to run"
            print(f"vLLM side skipped: {why}; {rest}", flush=True)
    else:
        backend = [v for v in o.variants if v in srv.BACKEND_VARIANTS]
        if backend and not srv.has_kvstrata(python):
            print(f"{', '.join(backend)} skipped: {python} cannot import kvstrata (make venv-vllm)")
            o.variants = [v for v in o.variants if v not in backend]
    return bool(_runnable(o))


def _runnable(o: argparse.Namespace) -> list[str]:
    return [v for size in o.sizes for v in srv.AT_SIZE[size] if v in o.variants]


def run(args: argparse.Namespace) -> int:
    """Run the comparison; exit 1 when a request failed or came back short."""
    _STARTED[0] = time.monotonic()
    o = _options(args)
    try:
        import openai  # noqa: F401 - the client the bench drives both servers with
    except ModuleNotFoundError:
        raise MissingExtraError(
            "kvstrata bench peer needs the openai client: pip install openai"
        ) from None
    from kvstrata.server.deps import require_serve

    require_serve()
    if not _settle_vllm(o):
        return 0
    report = measure(o)
    rep.print_report(report)
    if o.json:
        Path(o.json).write_text(json.dumps(_timing.plain(report), indent=1))
        print(f"raw numbers: {o.json}")
    for error in report["errors"]:
        print(f"kvstrata bench peer: {error}", file=sys.stderr)
    bad = wl.failures(report)
    if bad:
        print(f"{bad} request(s) failed or returned fewer tokens than asked", file=sys.stderr)
    return 1 if bad or report["errors"] else 0
