"""The serving engine: continuous batching over one shared `KVStore`.

    engine = Engine(model, tokenizer, device_budget="64MiB", host_budget="1GiB")
    outs = engine.generate(["def add(a, b):", "import os"], SamplingParams(max_tokens=32))
    async for out in engine.stream("def f():", SamplingParams(max_tokens=8)): ...

No HTTP here (see `kvstrata.server`). One engine thread owns the store and runs
every forward; requests arrive and leave from any thread.
"""

from kvstrata.engine.engine import Engine
from kvstrata.engine.params import (
    EngineConfig,
    EngineStopped,
    RequestOutput,
    RequestRejected,
    SamplingParams,
)

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineStopped",
    "RequestOutput",
    "RequestRejected",
    "SamplingParams",
]
