"""KV and weight dtype names: the three kvstrata sizes ("fp32", "fp16", "bf16"), their
torch dtypes and element sizes, and the spellings (HF config, torch) that name them."""

from __future__ import annotations

import torch

from kvstrata.core.errors import ConfigError

# dtype names -> (torch dtype, bytes per element). Codec names are looked up in the registry.
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "fp32": (torch.float32, 4),
    "fp16": (torch.float16, 2),
    "bf16": (torch.bfloat16, 2),
}
# Other spellings of the DTYPES names (config.json's torch_dtype, torch's repr).
DTYPE_ALIASES = {
    "float32": "fp32",
    "float": "fp32",
    "torch.float32": "fp32",
    "float16": "fp16",
    "half": "fp16",
    "torch.float16": "fp16",
    "bfloat16": "bf16",
    "torch.bfloat16": "bf16",
}


def is_dtype_name(name: str) -> bool:
    """True when `name` (any case) names a dtype rather than a codec."""
    return name.lower() in DTYPES or name.lower() in DTYPE_ALIASES


def dtype_name(value: object, field: str = "dtype") -> str:
    """Normalise a dtype ("float16", torch.bfloat16, "bf16") to "fp32" | "fp16" | "bf16".

    Raises:
        ConfigError: an unknown dtype; the message lists the accepted names.
    """
    name = DTYPE_ALIASES.get(str(value).lower(), str(value).lower())
    if name not in DTYPES:
        raise ConfigError.field(field, value, f"one of {', '.join(DTYPES)}")
    return name
