"""The remote tier's flags (`--remote-*`), shared by every command that builds a store."""

from __future__ import annotations

import argparse
from typing import Any

from kvstrata.config import CacheConfig
from kvstrata.core.units import parse_float, parse_int

FIELDS = ("remote_url", "remote_codec", "remote_ttl", "remote_timeout")


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
    g.add_argument("--remote-timeout", default=None, help="deadline of one remote read, s (0.5)")


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
