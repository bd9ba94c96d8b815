"""CacheConfig flags shared by every command that builds a store, beyond the placement
flags of `generate.add_placement_flags`: the remote tier's (`--remote-*`) and query-aware
key selection's (`--attention-budget`, `--attention-summary`, `--attention-page`,
`--attention-score`, `--attention-dense-layers`, `--attention-coarse`,
`--attention-refine`, `--attention-channels`)."""

from __future__ import annotations

import argparse
from typing import Any

from kvstrata.config import CacheConfig
from kvstrata.core.units import parse_float, parse_int

FIELDS = ("remote_url", "remote_codec", "remote_ttl", "remote_timeout")
ATTENTION_FIELDS = (
    "attention_budget", "attention_summary", "attention_page", "attention_score",
    "attention_dense_layers", "attention_coarse", "attention_refine", "attention_channels",
)  # fmt: skip


def add_cache_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--attention-budget", default=None, help="lossy: keys each decode step attends, as "
        "tokens (1k) or a share of the context (0.125); the query picks them (Quest-style)"
    )  # fmt: skip
    g.add_argument(
        "--attention-summary", default=None, help="page summary it scores: minmax or mean"
    )
    g.add_argument(
        "--attention-page", type=int, default=None,
        help="keys per scored page (4): fewer choose more precisely, for more summary bytes",
    )  # fmt: skip
    g.add_argument(
        "--attention-score", default=None,
        help="a page's score for a KV head: its query heads' best (max) or their sum",
    )  # fmt: skip
    g.add_argument(
        "--attention-dense-layers", type=int, default=None,
        help="with a budget: the first this many layers still attend every key",
    )  # fmt: skip
    g.add_argument(
        "--attention-coarse", type=int, default=None,
        help="pages per group summary (e.g. 16): a head scores groups, then its best "
        "groups' pages; 0 (the default) scores every page",
    )  # fmt: skip
    g.add_argument(
        "--attention-refine", type=float, default=None,
        help="with --attention-coarse: groups refined per page chosen (2)",
    )  # fmt: skip
    g.add_argument(
        "--attention-channels", type=int, default=None,
        help="query channels (largest |q|) each row scores pages over (16; 0: all)",
    )  # fmt: skip
    add_remote_flags(g)


def cache_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The CacheConfig fields of these flags (ConfigError, one line)."""
    kw = {n: getattr(args, n) for n in ATTENTION_FIELDS if getattr(args, n, None) is not None}
    if kw:
        kw = {n: getattr(CacheConfig(**kw), n) for n in kw}
    return kw | remote_fields(args)


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
