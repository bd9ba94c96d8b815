"""kvstrata: a tiered, paged, compressed KV cache for LLM inference."""

from kvstrata.config import CacheConfig
from kvstrata.errors import (
    BlockCorruptError,
    BlockMissingError,
    CodecError,
    ConfigError,
    KvstrataError,
    OutOfBlocksError,
    TierFullError,
    TierIOError,
    UnsupportedModelError,
)
from kvstrata.units import parse_size, parse_tokens

__version__ = "0.1.0"

_LAZY = {
    "TieredCache": "kvstrata.integrations.hf",
    "KVStore": "kvstrata.store",
    "enable": "kvstrata.integrations.hf",
    "plan": "kvstrata.planner",
    "load_geometry": "kvstrata.geometry",
    "get_codec": "kvstrata.codecs.registry",
    "Engine": "kvstrata.engine",
    "EngineConfig": "kvstrata.engine",
    "SamplingParams": "kvstrata.engine",
}


def __getattr__(name: str):
    # transformers is imported only when the integration is used (fast CLI start-up)
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvstrata' has no attribute {name!r}")


__all__ = [
    "BlockCorruptError",
    "BlockMissingError",
    "CacheConfig",
    "CodecError",
    "ConfigError",
    "KvstrataError",
    "OutOfBlocksError",
    "TierFullError",
    "TierIOError",
    "UnsupportedModelError",
    "TieredCache",
    "KVStore",
    "Engine",
    "EngineConfig",
    "SamplingParams",
    "enable",
    "get_codec",
    "load_geometry",
    "plan",
    "parse_size",
    "parse_tokens",
]
