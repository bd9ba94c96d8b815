"""Which models kvstrata's cache serves: per-layer softmax K/V of one shape. The check
refuses, in one line naming the model type, encoder-decoder models, linear-attention /
SSM state layers, MLA latents whose attention expands them, and layers of differing K/V
shapes."""

from __future__ import annotations

from typing import Any

from kvstrata.core.errors import UnsupportedModelError
from kvstrata.model.hf_config import config_data

# layer types whose KV a block cache holds (softmax attention over past keys)
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
# per-layer config fields that change the shape of a layer's K/V
SHAPE_FIELDS = ("head_dim", "num_key_value_heads", "v_head_dim")


def check_cacheable(config: Any, name: str = "") -> None:
    """Refuse models whose caches are not per-layer softmax K/V (encoder-decoder
    cross-attention, linear-attention / SSM state layers).

    Raises:
        UnsupportedModelError: names the model type and what is not supported.
    """
    data = config_data(config, name or "config")
    model_type = data.get("model_type") or "?"
    if data.get("is_encoder_decoder"):
        raise UnsupportedModelError(
            f"model_type={model_type!r}: encoder-decoder models (cross-attention caches) "
            "are not supported by TieredCache; use a decoder-only model"
        )
    other = sorted({t for t in data.get("layer_types") or [] if t not in ATTENTION_LAYER_TYPES})
    if other:
        raise UnsupportedModelError(
            f"model_type={model_type!r} has layers of type {other}: TieredCache serves "
            "softmax-attention layers only (no linear-attention / SSM state caches)"
        )
    if data.get("kv_lora_rank") is not None:
        raise UnsupportedModelError(
            f"model_type={model_type!r} caches a compressed MLA latent that its attention "
            "expands over the whole history (kv_b_proj): TieredCache serves models whose "
            "attention reads the cached K/V directly (the planner does size MLA caches)"
        )
    per_layer = data.get("per_layer_config")
    if isinstance(per_layer, dict):
        for field_name in SHAPE_FIELDS:
            default = data.get(field_name)
            for layer, fields in sorted(per_layer.items()):
                value = fields.get(field_name) if isinstance(fields, dict) else None
                if value is None or value == default:
                    continue
                if default is None:  # no global value: the first layer that names one
                    default = value
                    continue
                raise UnsupportedModelError(
                    f"model_type={model_type!r}: layer {layer} has {field_name}={value} where "
                    f"others have {default}: TieredCache stores one K/V shape for every layer"
                )
