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
    "parse_size",
    "parse_tokens",
]
