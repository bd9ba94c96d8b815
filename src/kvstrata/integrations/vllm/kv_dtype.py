"""vLLM's KV cache dtype as kvstrata reads it: the model dtype, or an fp8 KV cache.

vLLM names the dtype of the KV pages in `OffloadingConfig.model.dtype`: the model's
dtype ("float32", "float16", "bfloat16") with `--kv-cache-dtype auto`, else the KV
cache dtype itself. Of its quantized KV caches kvstrata reads the plain fp8 ones
(what vLLM's CPU backend accepts): `fp8` (= `fp8_e4m3`, OCP e4m3fn) and `fp8_e5m2`,
one byte per value with the layer's k/v scale already applied. The codecs take them
as they are (codecs/fp8_input.py): `none` keeps the bytes, the others quantize them.
"""

from __future__ import annotations

import torch

from kvstrata.core.errors import ConfigError
from kvstrata.model.dtypes import DTYPE_ALIASES, DTYPES

FP8_KV_DTYPES: dict[str, tuple[str, torch.dtype]] = {
    "fp8": ("fp8_e4m3", torch.float8_e4m3fn),  # vLLM: fp8 = fp8_e4m3
    "fp8_e4m3": ("fp8_e4m3", torch.float8_e4m3fn),
    "fp8_e5m2": ("fp8_e5m2", torch.float8_e5m2),
}


def kv_cache_dtype(value: str) -> tuple[str, torch.dtype]:
    """(kvstrata's name, torch dtype) of the KV pages vLLM names `value`.

    Raises:
        ConfigError: a KV cache dtype kvstrata cannot read (one line, the accepted ones).
    """
    text = str(value).lower().removeprefix("torch.")
    if text in FP8_KV_DTYPES:
        return FP8_KV_DTYPES[text]
    name = DTYPE_ALIASES.get(text, text)
    if name not in DTYPES:
        raise ConfigError.field(
            "kv_cache_dtype",
            value,
            "kvstrata reads KV pages of float32, float16, bfloat16 (the model's dtype) "
            f"and {', '.join(FP8_KV_DTYPES)}; not vLLM's other quantized KV caches",
        )
    return name, DTYPES[name][0]
