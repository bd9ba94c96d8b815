"""CacheConfig flags shared by every command that builds a store: the placement flags
(`add_placement_flags`: block size, budgets, codecs, disk tier, residual window ...), the
remote tier's (`--remote-*`) and query-aware key selection's (`--attention-budget`,
`--attention-summary`, `--attention-page`, `--attention-score`,
`--attention-dense-layers`, `--attention-coarse`, `--attention-refine`,
`--attention-channels`, `--attention-prefetch`, `--attention-prefetch-budget`) and the
host tier's under memory pressure (`--host-pressure`, `--host-headroom`), and
`--numa`."""

from __future__ import annotations

import argparse
from typing import Any

from kvstrata.config import HOST_PRESSURE, CacheConfig
from kvstrata.core.selection import check_choice
from kvstrata.core.units import parse_float, parse_int, parse_size
from kvstrata.platform.numa import check_numa

FIELDS = ("remote_url", "remote_codec", "remote_ttl", "remote_timeout")
PRESSURE_FIELDS = ("host_pressure", "host_headroom")
ATTENTION_FIELDS = (
    "attention_budget",
    "attention_summary",
    "attention_page",
    "attention_score",
    "attention_dense_layers",
    "attention_coarse",
    "attention_refine",
    "attention_channels",
    "attention_prefetch",
    "attention_prefetch_budget",
)


def add_placement_flags(p: argparse.ArgumentParser) -> None:
    """The CacheConfig flags shared by commands that build a TieredCache."""
    g = p.add_argument_group("KV placement (CacheConfig fields)")
    g.add_argument("--block-size", default="64", help="tokens per block (default 64)")
    g.add_argument("--max-tokens", default=None, help="cache capacity (default prompt + new)")
    g.add_argument("--resident-fraction", default=None, help="KV kept on the device, e.g. 0.1")
    g.add_argument("--device-budget", default=None, help="device KV bytes, e.g. 64MiB")
    g.add_argument("--host-budget", default=None, help="host KV bytes (default: enough)")
    g.add_argument("--host-codec", default="none", help="none, int8, fp8, int4, int4-g32 ...")
    g.add_argument("--disk-dir", default=None, help="directory of a disk tier (none)")
    g.add_argument("--disk-budget", default=None, help="disk KV bytes (default: enough)")
    g.add_argument("--disk-codec", default=None, help="disk codec (default: the host codec)")
    g.add_argument(
        "--disk-compress", action="store_true", help="lossless zstd on disk blocks (extra)"
    )
    g.add_argument(
        "--disk-delta",
        action="store_true",
        help="with --disk-compress: delta-code keys first (lossless; pays most on int8 "
        "keys, for more CPU time than zstd alone: docs/codecs.md)",
    )
    g.add_argument("--disk-o-direct", action="store_true", help="disk I/O with O_DIRECT")
    g.add_argument("--residual", default="128", help="newest tokens kept exact (lossy codecs)")
    g.add_argument("--sinks", default="4", help="first tokens kept on the device (default 4)")
    g.add_argument("--staging-tokens", default=None, help="device staging buffer (4096)")
    g.add_argument("--cold-attention", default="auto", help="auto, local or stage")
    g.add_argument(
        "--host-pressure",
        default=None,
        help="auto: the host tier moves its coldest blocks to disk under memory pressure "
        "(cgroup limit, MemAvailable, PSI) and grows back when memory frees; off (default)",
    )
    g.add_argument(
        "--host-headroom",
        default=None,
        help="with --host-pressure auto: memory kept free (256MiB); twice it grows back",
    )
    g.add_argument(
        "--numa",
        default=None,
        help="NUMA placement of the host arenas and the engine thread: auto (default: the "
        "GPU's node; a no-op on one node), off, or a node id (docs/numa.md)",
    )
    add_cache_flags(g)


def add_cache_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--attention-budget",
        default=None,
        help="lossy: keys each decode step attends, as "
        "tokens (1k) or a share of the context (0.125); the query picks them (Quest-style)",
    )
    g.add_argument(
        "--attention-summary", default=None, help="page summary it scores: minmax or mean"
    )
    g.add_argument(
        "--attention-page",
        type=int,
        default=None,
        help="keys per scored page (4): fewer choose more precisely, for more summary bytes",
    )
    g.add_argument(
        "--attention-score",
        default=None,
        help="a page's score for a KV head: its query heads' best (max) or their sum",
    )
    g.add_argument(
        "--attention-dense-layers",
        type=int,
        default=None,
        help="with a budget: the first this many layers still attend every key",
    )
    g.add_argument(
        "--attention-coarse",
        type=int,
        default=None,
        help="pages per group summary (e.g. 16): a head scores groups, then its best "
        "groups' pages; 0 (the default) scores every page",
    )
    g.add_argument(
        "--attention-refine",
        type=float,
        default=None,
        help="with --attention-coarse: groups refined per page chosen (2)",
    )
    g.add_argument(
        "--attention-channels",
        type=int,
        default=None,
        help="query channels (largest |q|) each row scores pages over (16; 0: all)",
    )
    g.add_argument(
        "--attention-prefetch",
        default=None,
        help="with a budget over disk / staged tiers: hold the next step's predicted "
        "blocks — last (what this step read), learned (recency/frequency), off (default)",
    )
    g.add_argument(
        "--attention-prefetch-budget",
        default=None,
        help="bytes the prediction may hold on the compute device (1GiB)",
    )
    add_remote_flags(g)


def cache_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The CacheConfig fields of these flags (ConfigError, one line)."""
    kw = {n: getattr(args, n) for n in ATTENTION_FIELDS if getattr(args, n, None) is not None}
    if kw:
        kw = {n: getattr(CacheConfig(**kw), n) for n in kw}
    if getattr(args, "numa", None) is not None:  # checked against this machine's nodes
        kw["numa"] = check_numa(args.numa)
    return kw | pressure_fields(args) | remote_fields(args)


def pressure_fields(args: argparse.Namespace) -> dict[str, Any]:
    """--host-pressure / --host-headroom (ConfigError, one line; their pairing with the
    host and disk tiers is checked with the whole config)."""
    kw = {n: getattr(args, n) for n in PRESSURE_FIELDS if getattr(args, n, None) is not None}
    if "host_pressure" in kw:
        check_choice("host_pressure", kw["host_pressure"], HOST_PRESSURE)
    if "host_headroom" in kw:
        kw["host_headroom"] = parse_size(kw["host_headroom"], "host_headroom")
    return kw


def add_remote_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--remote-url",
        default=None,
        help="a Redis / Valkey server many processes share: redis://host:6379/0 (rediss:// "
        "for TLS; the password in the URL or $KVSTRATA_REMOTE_PASSWORD)",
    )
    g.add_argument("--remote-codec", default=None, help="remote block codec (default: disk's)")
    g.add_argument(
        "--remote-ttl", default=None, help="seconds a remote block lives (default: no limit)"
    )
    g.add_argument(
        "--remote-timeout",
        default=None,
        help="shortest deadline of a remote read, s (0.5); a large read gets what the link "
        "model predicts for its bytes x8, up to the cost of recomputing its tokens",
    )


def remote_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The remote tier's CacheConfig fields from --remote-* (ConfigError, one line)."""
    kw: dict[str, Any] = {n: getattr(args, n) for n in FIELDS if getattr(args, n, None) is not None}
    if "remote_ttl" in kw:
        kw["remote_ttl"] = parse_int(kw["remote_ttl"], "remote_ttl", maximum=10**9, what="seconds")
    if "remote_timeout" in kw:
        kw["remote_timeout"] = parse_float(kw["remote_timeout"], "remote_timeout", minimum=0.001)
    if kw:
        CacheConfig(**kw)  # the URL, codec and their pairing, before any model loads
    return kw
