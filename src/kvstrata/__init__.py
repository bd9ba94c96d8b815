"""kvstrata: a tiered, paged, compressed KV cache for LLM inference.

Importing kvstrata before torch sets `OMP_WAIT_POLICY=PASSIVE` unless the environment
already names a policy: idle OpenMP threads then sleep instead of spinning. When
another process competes for the cores, spinning workers take the cycles it needs and
the engine's requests slow down many times over; on an idle machine, with one thread,
the policy made no difference (the figures: docs/MEASUREMENTS.md). `kvstrata serve`
lets its workers spin briefly instead (cli/_openmp.py).
"""

import os as _os
import sys as _sys

# read once, when torch loads its OpenMP runtime. The marker says the policy is this
# default (child processes inherit both): `kvstrata serve`, which owns its cores, then
# lets the workers spin briefly instead (cli/_openmp.py).
if "torch" not in _sys.modules and "OMP_WAIT_POLICY" not in _os.environ:
    _os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    _os.environ["KVSTRATA_OMP_DEFAULTED"] = "1"

from kvstrata.core.errors import (
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
from kvstrata.core.units import parse_size, parse_tokens
from kvstrata.core.version import __version__

_LAZY = {
    "CacheConfig": "kvstrata.config",
    "TieredCache": "kvstrata.integrations.hf.cache",
    "KVStore": "kvstrata.store.kvstore",
    "enable": "kvstrata.integrations.hf.attention",
    "plan": "kvstrata.workload.memory_plan",
    "load_geometry": "kvstrata.workload.zoo",
    "get_codec": "kvstrata.codecs.registry",
    "Engine": "kvstrata.engine",
    "EngineConfig": "kvstrata.engine",
    "SamplingParams": "kvstrata.engine",
    "Chunks": "kvstrata.workload.chunks",
    "blend_prompt": "kvstrata.integrations.hf.blend_store",
}


def __getattr__(name: str):
    # torch and transformers are imported only when what needs them is used: importing
    # kvstrata itself loads neither (fast CLI start-up; thread settings made after it count)
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvstrata' has no attribute {name!r}")


__all__ = [
    "__version__",
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
    "Chunks",
    "blend_prompt",
    "enable",
    "get_codec",
    "load_geometry",
    "plan",
    "parse_size",
    "parse_tokens",
]
