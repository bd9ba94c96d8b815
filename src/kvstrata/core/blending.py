"""Blending's one knob, where every layer reads it: the share of a prompt's reused
document tokens recomputed in context (integrations/hf/blend.py, docs/blend.md)."""

from __future__ import annotations

import math

from kvstrata.core.errors import ConfigError

# the default share recomputed; chosen from `kvstrata bench blend` (docs/blend.md)
BLEND_RECOMPUTE = 0.15


def check_recompute(value: object, field: str = "blend_recompute") -> float:
    """A recompute share in [0, 1] (one-line ConfigError naming `field` otherwise)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or math.isnan(value) or not 0 <= value <= 1:  # type: ignore[arg-type]
        raise ConfigError.field(field, value, "a share of the documents' tokens, 0 to 1")
    return float(value)  # type: ignore[arg-type]
