"""Frozen configuration, validated at the edge (CLI, dict, keyword arguments)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstrata.errors import ConfigError
from kvstrata.units import parse_size, parse_tokens

POLICIES = ("window", "lru", "lfu")
COLD_ATTENTION = ("auto", "local", "stage")


@dataclass(frozen=True)
class CacheConfig:
    """How a TieredCache lays out and places KV blocks.

    Budgets are bytes of *stored* KV (after the tier's codec). The device tier is
    sized either by `device_budget` or by `resident_fraction` of `max_tokens`
    (the seed's "keep 5-20 % resident"); `None` for both means "everything on the
    device" (sized to `max_tokens`).

    Fields:
        block_size: tokens per block (all layers, K and V). 16-512.
        max_tokens: total tokens the cache must hold across all sequences; sizes
            the device tier when no budget is given and `resident_fraction`.
        device_budget / resident_fraction: device-tier size.
        host_budget: host-tier size (0 = no host tier).
        disk_dir / disk_budget: disk tier (no disk tier when disk_dir is None).
        *_codec: codec name per tier ("none", "fp8", "int8", "int4", "int4-g32" ...).
        disk_compress: also compress each disk block layer losslessly (byte planes
            + zstd, the `compress` extra): e.g. disk_codec="int4" + disk_compress.
        disk_o_direct: disk I/O with O_DIRECT (bypasses the page cache).
        residual_tokens: newest tokens kept in full precision (lossy codecs only).
        sink_tokens: first tokens of each sequence kept on the device.
        policy: device eviction policy: "window" (newest + sinks), "lru", "lfu".
        staging_tokens: size of the device staging buffer for cold blocks.
        cold_attention: "local" attends cold host blocks where they live (CPU),
            "stage" copies them through the staging buffer, "auto" = local on a
            CPU-only machine, stage with CUDA.
        device: compute device ("auto" = cuda when present, else cpu).
    """

    block_size: int = 64
    max_tokens: int = 32768
    device_budget: int | None = None
    resident_fraction: float | None = None
    host_budget: int = 0
    disk_dir: str | None = None
    disk_budget: int = 0
    device_codec: str = "none"
    host_codec: str = "none"
    disk_codec: str = "none"
    disk_compress: bool = False
    disk_o_direct: bool = False
    residual_tokens: int = 128
    sink_tokens: int = 4
    policy: str = "window"
    staging_tokens: int = 16384
    cold_attention: str = "auto"
    device: str = "auto"

    def __post_init__(self) -> None:
        def put(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        put("block_size", parse_tokens(self.block_size, "block_size"))
        if not 1 <= self.block_size <= 4096:
            raise ConfigError.field(
                "block_size", self.block_size, "use 16-512 tokens (64-256 typical)"
            )
        put("max_tokens", parse_tokens(self.max_tokens, "max_tokens"))
        if self.device_budget is not None:
            put("device_budget", parse_size(self.device_budget, "device_budget"))
        if self.resident_fraction is not None:
            frac = self.resident_fraction
            if isinstance(frac, bool) or not isinstance(frac, int | float) or not 0 < frac <= 1:
                raise ConfigError.field(
                    "resident_fraction", frac, "a fraction in (0, 1], e.g. 0.1 for 10 % resident"
                )
            if self.device_budget is not None:
                raise ConfigError.field(
                    "resident_fraction",
                    frac,
                    "give either device_budget or resident_fraction, not both",
                )
        put("host_budget", parse_size(self.host_budget, "host_budget", allow_zero=True))
        put("disk_budget", parse_size(self.disk_budget, "disk_budget", allow_zero=True))
        if self.disk_dir is not None:
            put("disk_dir", str(Path(self.disk_dir).expanduser()))
            if self.disk_budget == 0:
                raise ConfigError.field("disk_budget", 0, "a disk tier needs a budget, e.g. '8GiB'")
        elif self.disk_budget:
            raise ConfigError.field("disk_dir", None, "set disk_dir to use disk_budget")
        for name in ("residual_tokens", "sink_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError.field(name, value, "a token count >= 0")
        put("staging_tokens", parse_tokens(self.staging_tokens, "staging_tokens"))
        if self.policy not in POLICIES:
            raise ConfigError.field("policy", self.policy, f"one of {', '.join(POLICIES)}")
        if self.cold_attention not in COLD_ATTENTION:
            raise ConfigError.field(
                "cold_attention", self.cold_attention, f"one of {', '.join(COLD_ATTENTION)}"
            )
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ConfigError.field("device", self.device, "'auto', 'cpu', 'cuda' or 'cuda:N'")
        for name in ("disk_compress", "disk_o_direct"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError.field(name, getattr(self, name), "True or False")
        if self.disk_compress and self.disk_o_direct:
            raise ConfigError.field(
                "disk_o_direct", True, "O_DIRECT cannot be combined with disk_compress; drop one"
            )
        for name in ("device_codec", "host_codec", "disk_codec"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ConfigError.field(name, value, "a codec name such as 'none', 'int8', 'int4'")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CacheConfig:
        """Build from a plain dict (YAML/JSON); unknown keys are an error naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError.field(
                unknown[0], data[unknown[0]], f"unknown field; known: {', '.join(sorted(known))}"
            )
        return cls(**data)

    def replace(self, **changes: Any) -> CacheConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)
