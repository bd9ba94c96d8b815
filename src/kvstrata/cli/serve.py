"""`kvstrata serve`: an OpenAI-compatible HTTP server (the `serve` extra).

kvstrata serve --model default --port 8000
kvstrata serve --device-budget 64MiB --host-budget 1GiB --disk-dir /var/tmp/kv --disk-budget 8GiB
kvstrata serve --gpu-memory-utilization 0.5 --swap-space 4 --kv-cache-dtype int8   # vLLM's words

The placement flags are CacheConfig fields (as `kvstrata generate`); vLLM's flags are
accepted as aliases so a vLLM command line maps 1:1. uvicorn runs in the main thread;
Ctrl-C (SIGINT) or SIGTERM stops it, then the engine (open requests are aborted after
a grace period, the store is closed, so a disk tier keeps its prefix cache).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvstrata.cli._cache_flags import add_placement_flags, cache_fields
from kvstrata.cli.generate import parse_threads
from kvstrata.config import BLOCK_SIZE_MAX
from kvstrata.core.blending import BLEND_RECOMPUTE
from kvstrata.core.errors import ConfigError
from kvstrata.core.units import format_bytes, parse_float, parse_int, parse_size, parse_tokens
from kvstrata.workload.zoo import quiet_transformers

KV_CACHE_DTYPES = {"auto": "none", "fp8": "fp8", "fp8_e4m3": "fp8", "int8": "int8"}
DEFAULT_MAX_TOKENS = 32768  # CacheConfig's: what the cache holds across all requests
GRACEFUL_SHUTDOWN_S = 5  # open requests get this long after Ctrl-C, then are aborted
API_KEY_ENV = "KVSTRATA_API_KEY"  # --api-key's default (vLLM reads VLLM_API_KEY)
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
EMBEDDED_NAMES = ("default", "tiny")  # the embedded model's names in kvstrata.workload.zoo


def _conflict(field: str, value: Any, other: str) -> ConfigError:
    return ConfigError.field(field, value, f"give either --{field.replace('_', '-')} or {other}")


def check_flags(args: argparse.Namespace) -> None:
    """Every flag that can be checked before the model loads (one-line ConfigError)."""
    from kvstrata.codecs.registry import get_codec
    from kvstrata.engine.params import EngineConfig

    parse_int(args.port, "port", minimum=0, maximum=65535, what="a TCP port (0 = any free)")
    parse_threads(args.threads)
    EngineConfig(**engine_fields(args))
    if args.uvicorn_log_level not in LOG_LEVELS:
        raise ConfigError.field("uvicorn_log_level", args.uvicorn_log_level, ", ".join(LOG_LEVELS))
    if args.gpu_memory_utilization is not None:
        for field in ("device_budget", "resident_fraction"):
            if getattr(args, field) is not None:
                raise _conflict(
                    "gpu_memory_utilization",
                    args.gpu_memory_utilization,
                    f"--{field.replace('_', '-')}",
                )
        _utilization(args)
    if args.swap_space is not None:
        if args.host_budget is not None:
            raise _conflict("swap_space", args.swap_space, "--host-budget (the same tier)")
        _swap_bytes(args.swap_space)
    if args.kv_cache_dtype is not None:
        for field in ("host_codec", "disk_codec"):
            if getattr(args, field) is not None:
                raise _conflict(
                    "kv_cache_dtype", args.kv_cache_dtype, f"--{field.replace('_', '-')}"
                )
        _kv_codec(args.kv_cache_dtype)
    for field in ("host_codec", "disk_codec"):
        if getattr(args, field) is not None:
            get_codec(getattr(args, field), field)
    parse_tokens(args.block_size, "block_size", maximum=BLOCK_SIZE_MAX)
    cache_fields(args)
    if args.max_tokens is not None:
        parse_tokens(args.max_tokens, "max_tokens")
    for name in ("device_budget", "host_budget", "disk_budget"):
        if getattr(args, name) is not None:
            parse_size(getattr(args, name), name, allow_zero=name == "host_budget")
    serve_limits(args)
    kv_events_config(args)


def kv_events_config(args: argparse.Namespace) -> Any:
    """--kv-events-config as a KVEventsConfig (None: not given); the fleet extra is
    checked when it enables events (MissingExtraError before the model loads)."""
    if args.kv_events_config is None:
        return None
    from kvstrata.server.kv_events import KVEventsConfig
    from kvstrata.server.kv_events.publisher import load_fleet

    config = KVEventsConfig.from_json(args.kv_events_config)
    if config.enabled:
        load_fleet()
    return config


def serve_limits(args: argparse.Namespace) -> Any:
    """The server's request limits (kvstrata.server.limits.ServeLimits) from the flags."""
    from kvstrata.server.limits import ServeLimits

    tokens = args.max_request_tokens
    return ServeLimits(
        max_body_bytes=parse_size(args.max_request_body, "max_request_body"),
        max_request_tokens=None if tokens is None else parse_tokens(tokens, "max_request_tokens"),
        trust_special_tokens=args.trust_special_tokens,
        strict_fields=args.strict_fields,
    )


def engine_fields(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig fields from the flags."""
    return {
        "max_num_seqs": parse_int(args.max_num_seqs, "max_num_seqs", minimum=1, maximum=4096),
        "max_batched_tokens": parse_tokens(args.max_batched_tokens, "max_batched_tokens"),
        "preemption": args.preemption,
        "blend_recompute": parse_float(args.blend_recompute, "blend_recompute", minimum=0.0),
    }


def _utilization(args: argparse.Namespace) -> float:
    value = parse_float(args.gpu_memory_utilization, "gpu_memory_utilization", minimum=0.0)
    if not 0 < value <= 1:
        raise ConfigError.field(
            "gpu_memory_utilization", args.gpu_memory_utilization, "a fraction in (0, 1], e.g. 0.9"
        )
    return value


def _swap_bytes(value: str) -> int:
    """vLLM's --swap-space is GiB of host memory ("4"); a size with a unit is fine too."""
    try:
        gib = float(value)
    except ValueError:
        return parse_size(value, "swap_space", allow_zero=True)
    if not gib >= 0 or gib == float("inf"):
        raise ConfigError.field("swap_space", value, "GiB of host memory, a number >= 0 (e.g. 4)")
    return int(gib * 2**30)


def _kv_codec(value: str) -> str:
    if value not in KV_CACHE_DTYPES:
        raise ConfigError.field(
            "kv_cache_dtype",
            value,
            f"one of {', '.join(KV_CACHE_DTYPES)} (kvstrata's fp8 is e4m3; int4 codecs: "
            "--host-codec / --disk-codec)",
        )
    return KV_CACHE_DTYPES[value]


def weight_bytes(model: Any) -> int:
    """Bytes of the model's parameters and buffers."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def device_budget_from_utilization(args: argparse.Namespace, model: Any) -> int:
    """vLLM's rule: KV budget = utilization x device memory - the model's weights (on a
    CPU-only machine the "device" is this machine's RAM)."""
    from kvstrata.platform.hardware import device_memory

    fraction = _utilization(args)
    what, memory = device_memory("auto")
    if not memory:
        raise ConfigError.field(
            "gpu_memory_utilization",
            args.gpu_memory_utilization,
            f"the size of {what} is unknown here: give --device-budget instead",
        )
    weights = weight_bytes(model)
    budget = int(fraction * memory) - weights
    if budget <= 0:
        raise ConfigError.field(
            "gpu_memory_utilization",
            args.gpu_memory_utilization,
            f"{fraction:g} x {format_bytes(memory)} of {what} = {format_bytes(fraction * memory)} "
            f"does not cover the model's weights ({format_bytes(weights)}): raise it above "
            f"{weights / memory:.4f} or give --device-budget",
        )
    return budget


def served_name(args: argparse.Namespace) -> str:
    """--served-model-name, else the model's own name."""
    from kvstrata.workload.zoo import DEFAULT_MODEL_NAME

    if args.served_model_name is not None:
        return args.served_model_name
    if args.model in EMBEDDED_NAMES:
        return DEFAULT_MODEL_NAME
    return Path(args.model).name or args.model


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0 = any free port)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError.field("host", host, f"an address or host name here ({exc})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ConfigError.field(
            "port", port, f"cannot listen on {host}:{port} ({exc.strerror}): pick another --port"
        ) from None
    sock.listen(2048)  # connectable from now on: requests queue until uvicorn accepts
    return sock


def stopping_server(config: Any, stop_requests: Callable[[], None]) -> Any:
    """A uvicorn.Server that stops on SIGINT / SIGTERM like uvicorn's own, except that
    requests still open after GRACEFUL_SHUTDOWN_S are aborted through the engine (their
    clients get a 503 / an error event) rather than cancelled, and that the signal is not
    re-raised once stopped: uvicorn would then die of SIGTERM before the engine is shut
    down and its store closed."""
    import uvicorn
    from uvicorn.server import HANDLED_SIGNALS

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            loop = asyncio.get_running_loop()
            timer = loop.call_later(GRACEFUL_SHUTDOWN_S, stop_requests)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            before = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
            try:
                yield
            finally:
                for sig, handler in before.items():
                    signal.signal(sig, handler)

    return Server(config)


def build_engine(args: argparse.Namespace, kv_events: Any = None) -> Any:
    """Load the model and start the engine the flags describe (`kv_events`: where
    its KV events go, None: nowhere)."""
    import torch

    from kvstrata.cli.generate import cache_kwargs
    from kvstrata.engine import Engine, EngineConfig
    from kvstrata.platform.hardware import usable_cores
    from kvstrata.workload.zoo import load_model

    quiet_transformers()
    model, tokenizer = load_model(args.model)
    # a server owns its cores: every one it may run on (the engine's thread runs the
    # forwards; its OpenMP workers spin briefly before they sleep: cli/_openmp.py)
    threads = parse_threads(args.threads) or usable_cores()
    torch.set_num_threads(threads)
    if args.kv_cache_dtype is not None:
        args.host_codec = args.disk_codec = _kv_codec(args.kv_cache_dtype)
    args.host_codec = args.host_codec or "none"
    if args.swap_space is not None:
        args.host_budget = str(_swap_bytes(args.swap_space))
    if args.gpu_memory_utilization is not None:
        args.device_budget = str(device_budget_from_utilization(args, model))
    max_tokens = (
        parse_tokens(args.max_tokens, "max_tokens") if args.max_tokens else DEFAULT_MAX_TOKENS
    )
    fields = cache_kwargs(args, model, max_tokens)
    if args.kv_cache_dtype not in (None, "auto") and not _has_lower_tier(fields):
        print(
            f"kvstrata serve: note: --kv-cache-dtype {args.kv_cache_dtype} applies to host and "
            "disk blocks; this placement keeps every block on the device (exact)",
            file=sys.stderr,
        )
    return Engine(
        model,
        tokenizer,
        config=EngineConfig(**engine_fields(args), threads=threads),
        model_name=served_name(args),
        prefix_caching=args.enable_prefix_caching,
        kv_events=kv_events,
        **fields,
    )


def _has_lower_tier(fields: dict[str, Any]) -> bool:
    return bool(fields.get("host_budget")) or fields.get("disk_dir") is not None


def run(args: argparse.Namespace) -> int:
    """Run `kvstrata serve` until SIGINT / SIGTERM."""
    check_flags(args)  # before the slow imports: bad flags answer at once
    # (OpenMP workers spin briefly, then sleep: cli/_openmp.py, set before torch loaded)
    from kvstrata.server import require_serve

    require_serve()
    import uvicorn

    from kvstrata.server import build_app
    from kvstrata.server.kv_events import make_publisher
    from kvstrata.server.status import StatusLine

    sock = bind(args.host, parse_int(args.port, "port", minimum=0, maximum=65535))
    status = None
    events = kv_events_config(args)
    publisher = None if events is None else make_publisher(events)
    try:
        engine = build_engine(args, publisher)
        try:
            name = served_name(args)
            key = os.environ.get(API_KEY_ENV) if args.api_key is None else args.api_key
            app = build_app(engine, name, key or None, serve_limits(args))  # --api-key "": none
            config = uvicorn.Config(
                app,
                log_level=args.uvicorn_log_level,
                access_log=args.access_log,
                # uvicorn cancels what is left after this; stop_requests ends it before
                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S + 10,
            )
            server = stopping_server(config, app.state.server.stop_requests)
            host, port = sock.getsockname()[:2]
            url_host = f"[{host}]" if ":" in host else host
            numa = (engine.stats().get("store") or {}).get("numa")
            if numa:  # what NUMA placement did (on one node: that it is a no-op)
                print(f"kvstrata serve: NUMA: {numa['notice']}", file=sys.stderr, flush=True)
            print(
                f"kvstrata serve: {name} at http://{url_host}:{port}/v1 (Ctrl-C stops)",
                file=sys.stderr,
                flush=True,
            )
            show = sys.stderr.isatty() if args.status is None else args.status
            status = StatusLine(engine, name).start() if show else None
            server.run(sockets=[sock])
        finally:
            if status is not None:
                status.stop()
            engine.shutdown()  # closes the store: the disk tier keeps its prefix cache
    finally:
        sock.close()
        if publisher is not None:
            publisher.shutdown()
    print("kvstrata serve: stopped (engine shut down, store closed)", file=sys.stderr)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `serve` subcommand."""
    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description=(
            "Serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
            "/v1/chat/completions, /v1/models, /health, /metrics) with continuous "
            "batching over one tiered KV store. Needs the serve extra: "
            "pip install 'kvstrata[serve]'."
        ),
    )
    from kvstrata.cli.generate import model_help
    from kvstrata.workload.zoo import CLI_DEFAULT_MODEL

    p.add_argument("--model", default=CLI_DEFAULT_MODEL, help=model_help())
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", default="8000", help="TCP port (default 8000; 0 = any free port)")
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients use (default: the model's)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require Authorization: Bearer <key> on every route but /health and /metrics "
        f"(default: ${API_KEY_ENV}; '' for none)",
    )
    lim = p.add_argument_group("request limits")
    lim.add_argument(
        "--max-request-body",
        default="8MiB",
        help="request body bytes at most, a 413 past it before it is read (default 8MiB)",
    )
    lim.add_argument(
        "--max-request-tokens",
        default=None,
        help="tokens of work one request may ask for: (prompt + max_tokens) x n over its "
        "prompts, a 400 past it; logprob entries at most 4 per token of it (default: "
        "--max-num-seqs x the model's positions)",
    )
    lim.add_argument(
        "--trust-special-tokens",
        action="store_true",
        help="a special token's text in chat content (or a chat model's completion prompt) "
        "is that token, so callers can write turns of any role (default: plain text)",
    )
    lim.add_argument(
        "--strict-fields",
        action="store_true",
        help="refuse a request field kvstrata does not know (a 400 naming it) instead of "
        "ignoring it as vLLM does (default: ignored, logged once per name and named in the "
        "X-Kvstrata-Ignored-Fields response header)",
    )
    p.add_argument(
        "--threads",
        default="auto",
        help="torch threads: N, or auto (every core this process may use)",
    )
    g = p.add_argument_group("batching (EngineConfig)")
    g.add_argument("--max-num-seqs", default="8", help="requests running at once (default 8)")
    g.add_argument(
        "--max-batched-tokens",
        "--max-num-batched-tokens",
        dest="max_batched_tokens",
        default="512",
        help="tokens one step feeds the model at most (default 512)",
    )
    g.add_argument(
        "--preemption",
        choices=("demote", "off"),
        default="demote",
        help="demote: a request that no longer fits the device budget is paused and its "
        "blocks demoted to host/disk (nothing recomputed); off: placement spreads them",
    )
    g.add_argument(
        "--blend-recompute",
        default=str(BLEND_RECOMPUTE),
        help="share of a request's documents' reused tokens recomputed in context, 0 to 1 "
        f"(default {BLEND_RECOMPUTE}; a request's blend_recompute wins; docs/blend.md)",
    )
    add_placement_flags(p)
    for action in p._actions:  # the serving meaning of two placement flags
        if action.dest == "max_tokens":
            action.help = f"tokens the cache holds over all requests (default {DEFAULT_MAX_TOKENS})"
        elif action.dest == "host_codec":
            action.help = "none (default), int8, fp8, int4, int4-g32 ..."
    p.set_defaults(host_codec=None)  # None = not given (so --kv-cache-dtype may set it)
    v = p.add_argument_group("vLLM aliases (a vLLM command line maps 1:1)")
    v.add_argument(
        "--gpu-memory-utilization",
        default=None,
        help="device KV budget = this fraction x device memory - the model's weights "
        "(CPU-only: this machine's RAM); instead of --device-budget",
    )
    v.add_argument(
        "--swap-space", default=None, help="GiB of host memory for KV: the same as --host-budget"
    )
    v.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="share cached prompt prefixes between requests (default on)",
    )
    v.add_argument(
        "--kv-cache-dtype",
        default=None,
        help="auto (lossless, default), fp8, fp8_e4m3 or int8: the codec of host and disk "
        "blocks. The device tier always holds exact KV (it is the residual window), so this "
        "saves memory only where KV is offloaded",
    )
    v.add_argument(
        "--kv-events-config",
        default=None,
        help="publish KV cache events as vLLM does, a JSON object of vLLM's keys: "
        'e.g. \'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}\' (publisher, '
        "endpoint, replay_endpoint, buffer_steps, hwm, max_queue_size, topic); needs the "
        "fleet extra (docs/kv-events.md)",
    )
    o = p.add_argument_group("output")
    o.add_argument(
        "--status",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a live one-line status on stderr (default: when stderr is a terminal)",
    )
    o.add_argument("--access-log", action="store_true", help="log every HTTP request (uvicorn)")
    o.add_argument(
        "--uvicorn-log-level", default="warning", help=f"{', '.join(LOG_LEVELS)} (default warning)"
    )
    p.set_defaults(func=run)
