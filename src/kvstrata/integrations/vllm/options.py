"""The backend's settings: vLLM's `kv_connector_extra_config`, checked at the edge.

The keys are `CacheConfig`'s field names where they mean the same thing (budgets,
codecs, `disk_dir`, `policy`, `block_size`), plus the `KVStore` keyword `model_key`
and `stats_file`; vLLM's own keys of the OffloadingConnector are checked as vLLM
reads them (whole numbers >= 1, real booleans) and passed through. Every bad
value is one `ConfigError` line naming the key, the value and the fix — raised while
vLLM starts, in the scheduler and in the worker process alike.

vLLM reads `block_size` too: the tokens of one offloaded chunk, a multiple of its
own KV block size. kvstrata stores one block per chunk, so the two agree.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvstrata.config import FIELD_NAMES, CacheConfig
from kvstrata.core.errors import ConfigError

# CacheConfig fields that mean something here; vLLM owns the device KV (its blocks,
# budget and eviction), so the device-tier fields do not.
CACHE_FIELDS = (
    "block_size",
    "host_budget",
    "host_codec",
    "disk_dir",
    "disk_budget",
    "disk_codec",
    "disk_compress",
    "disk_delta",
    "disk_o_direct",
    "policy",
    "remote_url",
    "remote_codec",
    "remote_ttl",
    "remote_timeout",
)
OWN_KEYS = ("model_key", "stats_file")
# Keys vLLM's OffloadingConnector itself reads from the same dict (vllm 0.32).
VLLM_KEYS = (
    "spec_name",
    "spec_module_path",
    "blocks_per_chunk",
    "offload_prompt_only",
    "self_describing_kv_events",
    "canonical_layout",
)
VLLM_BOOL_KEYS = ("offload_prompt_only", "self_describing_kv_events", "canonical_layout")
DEFAULT_POLICY = "lru"  # an offload cache has no sequences: "window" is store order (FIFO)


@dataclass(frozen=True)
class VllmOptions:
    """What the backend was asked for.

    Fields:
        cache: the CacheConfig fields above, validated by CacheConfig itself.
        block_size: tokens per stored block, or None for one vLLM block (per chunk).
        model_key: names the model and its weights in every block key (default:
            vLLM's model name plus, with a disk tier, a digest of its weight files or
            hub commit: plan.model_identity); two models given one model_key share
            blocks — only for the same weights under two names.
        stats_file: a JSON file the scheduler rewrites with the backend's counters
            (hits per tier, corrupt blocks refused, bytes per block), or None.
    """

    cache: CacheConfig
    block_size: int | None = None
    model_key: str | None = None
    stats_file: str | None = None

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> VllmOptions:
        """Validate `kv_connector_extra_config` (ConfigError, one line)."""
        if not isinstance(extra, Mapping):
            raise ConfigError.field("kv_connector_extra_config", extra, "a JSON object")
        known = (*CACHE_FIELDS, *OWN_KEYS, *VLLM_KEYS)
        for name, value in extra.items():
            if name in FIELD_NAMES and name not in CACHE_FIELDS:
                raise ConfigError.field(
                    name,
                    value,
                    "not used by the vLLM backend: vLLM owns the device KV (size it with "
                    "--kv-cache-memory-bytes or --gpu-memory-utilization); kvstrata takes "
                    f"{', '.join(CACHE_FIELDS)}",
                )
            if name not in known:
                raise ConfigError.unknown(str(name), value, known)
        _check_vllm_keys(extra)
        if extra.get("canonical_layout"):
            raise ConfigError.field(
                "canonical_layout",
                extra["canonical_layout"],
                "a layout of vLLM's own CPU offloading; kvstrata reads vLLM's pages as they "
                "are: drop it",
            )
        fields = {name: extra[name] for name in CACHE_FIELDS if name in extra}
        fields.setdefault("policy", DEFAULT_POLICY)
        if "block_size" in fields:
            # vLLM has checked it is a multiple of its block size; CacheConfig checks the rest
            fields["block_size"] = _whole(fields["block_size"], "block_size")
        cache = CacheConfig(**fields)
        if "disk_codec" in extra and cache.disk_dir is None:
            raise ConfigError.field(
                "disk_codec", extra["disk_codec"], "set disk_dir (and disk_budget) to add a disk"
            )
        if cache.host_budget == 0:
            raise ConfigError.field(
                "host_budget",
                extra.get("host_budget", 0),
                "the vLLM backend moves every block through the host tier: set host_budget, "
                "e.g. '1GiB' (the disk tier keeps what does not fit)",
            )
        for name in OWN_KEYS:
            value = extra.get(name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ConfigError.field(name, value, "a non-empty string, or leave it out")
        _check_stats_file(extra.get("stats_file"))
        return cls(
            cache=cache,
            block_size=cache.block_size if "block_size" in fields else None,
            model_key=extra.get("model_key"),
            stats_file=extra.get("stats_file"),
        )


def _check_vllm_keys(extra: Mapping[str, Any]) -> None:
    """vLLM reads its own keys with int() and bool(): refuse what those would silently
    truncate or misread (2.7 -> 2, "false" -> True)."""
    for name in VLLM_BOOL_KEYS:
        if name in extra and not isinstance(extra[name], bool):
            raise ConfigError.field(name, extra[name], "true or false (a JSON boolean)")
    for name in ("spec_name", "spec_module_path"):
        if name in extra and (not isinstance(extra[name], str) or not extra[name]):
            raise ConfigError.field(name, extra[name], "a non-empty string")
    if "blocks_per_chunk" in extra:
        value = extra["blocks_per_chunk"]
        if _whole(value, "blocks_per_chunk", "a whole number of vLLM blocks, e.g. 2") < 1:
            raise ConfigError.field("blocks_per_chunk", value, "at least 1")
        if "block_size" in extra:
            raise ConfigError.field(
                "blocks_per_chunk", value, "give block_size or blocks_per_chunk, not both"
            )


def _check_stats_file(path: str | None) -> None:
    """The scheduler rewrites the stats file (tmp file + rename) in its directory."""
    if path is None:
        return
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ConfigError.field("stats_file", path, "a file path, not a directory")
    if not os.path.isdir(directory):
        raise ConfigError.field(
            "stats_file", path, f"its directory {directory!r} does not exist: create it first"
        )
    if not os.access(directory, os.W_OK):
        raise ConfigError.field("stats_file", path, f"its directory {directory!r} is not writable")


def _whole(value: Any, field: str, accepted: str = "a whole number of tokens, e.g. 64") -> int:
    """vLLM reads `block_size` with int(): refuse what int() would silently truncate."""
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError.field(field, value, accepted)
    return value
