"""Reading a Hugging Face model config — a `PretrainedConfig`, a config.json dict or a
config.json file — into the fields of a KV geometry: layers, heads, head dims, dtype,
sliding-window layers, MLA latent sizes, KV-sharing layers and the parameter count.
Every missing or malformed field is a one-line ConfigError naming the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvstrata.core.errors import ConfigError
from kvstrata.model.dtypes import dtype_name
from kvstrata.model.weights import gated_mlp_params


def config_data(config: Any, where: str) -> dict:
    """A config as a dict (multimodal wrappers: their language model's part)."""
    data = config.to_dict() if hasattr(config, "to_dict") else config
    if not isinstance(data, dict):
        raise ConfigError.field(where, type(data).__name__, "a config dict or PretrainedConfig")
    if isinstance(data.get("text_config"), dict):
        data = {**data["text_config"], "model_type": data["text_config"].get("model_type", "")}
    return data


def get_int(data: dict[str, Any], keys: tuple[str, ...], name: str, default: int | None = None):
    """The first of `keys` that is set, as a positive int (else `default`).

    Raises:
        ConfigError: the value is not a positive int, or none is set and no default.
    """
    for key in keys:
        value = data.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError.field(f"{name}: {key}", value, "a positive integer")
            return value
    if default is not None:
        return default
    raise ConfigError.field(f"{name}: {keys[0]}", None, "required field is missing")


def geometry_fields(config: Any, name: str = "") -> dict[str, Any]:
    """The KVGeometry fields of a transformers config object or a config.json dict.

    Args:
        config: a `PretrainedConfig` (anything with `to_dict()`) or a plain dict.
        name: where it came from, used in error messages (and the geometry's name).

    Returns:
        Keyword arguments for `KVGeometry`; `num_params` is exact for Llama-style
        models, else taken from a "num_params" entry or None.

    Raises:
        ConfigError: a required field is missing or malformed (names the field).
    """
    where = name or "config"
    data = config_data(config, where)
    model_type = str(data.get("model_type") or "unknown")
    num_layers = get_int(data, ("num_hidden_layers", "n_layer", "num_layers"), where)
    # Gemma-3n style: the last layers reuse the K/V of earlier ones and cache none
    shared = data.get("num_kv_shared_layers") or 0
    if shared:
        if isinstance(shared, bool) or not isinstance(shared, int) or not 0 < shared < num_layers:
            raise ConfigError.field(
                f"{where}: num_kv_shared_layers", shared, f"an integer in [0, {num_layers})"
            )
        num_layers -= shared
        if isinstance(data.get("layer_types"), list):
            data = {**data, "layer_types": data["layer_types"][:num_layers]}
    num_heads = get_int(data, ("num_attention_heads", "n_head", "num_heads"), where)
    num_kv_heads = get_int(
        data, ("num_key_value_heads", "num_kv_heads", "multi_query_group_num"), where, num_heads
    )
    if data.get("multi_query") is True and not data.get("new_decoder_architecture"):
        num_kv_heads = 1  # multi-query (GPTBigCode, Falcon-7B): one K/V head
    hidden = data.get("hidden_size", data.get("n_embd", data.get("d_model")))
    default_dim = hidden // num_heads if isinstance(hidden, int) and hidden > 0 else None
    head_dim = get_int(data, ("head_dim", "kv_channels"), where, default_dim)
    kv_lora_rank = data.get("kv_lora_rank")
    rope_dim = None
    if kv_lora_rank is not None:  # MLA: the cache holds the latent, one "head"
        kv_lora_rank = get_int(data, ("kv_lora_rank",), where)
        rope_dim = get_int(data, ("qk_rope_head_dim",), where)
        head_dim = get_int(data, ("qk_nope_head_dim",), where, 128) + rope_dim
    v_head_dim = get_int(data, ("v_head_dim",), where, head_dim)
    raw_dtype = data.get("dtype") or data.get("torch_dtype") or "float32"  # HF default
    try:
        dtype = dtype_name(raw_dtype)
    except ConfigError:
        raise ConfigError.field(
            f"{where}: torch_dtype", raw_dtype, "float32, float16 or bfloat16"
        ) from None
    window, sliding = sliding_layers(data, num_layers, where)
    params = data.get("num_params")
    if not isinstance(params, int):
        params = gated_mlp_params(
            data,
            model_type=model_type,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
        )
    return dict(
        model_type=model_type,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        dtype=dtype,
        sliding_window=window,
        sliding_layers=sliding,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=rope_dim,
        num_params=params,
        name=name,
        shared_kv_layers=shared,
    )


def sliding_layers(data: dict[str, Any], num_layers: int, where: str):
    """(window, sliding layer indices) from layer_types / sliding_window / max_window_layers."""
    window = data.get("sliding_window")
    if data.get("use_sliding_window") is False or window is None:
        return None, ()
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ConfigError.field(
            f"{where}: sliding_window", window, "a positive token count or null"
        )
    layer_types = data.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            raise ConfigError.field(
                f"{where}: layer_types", layer_types, f"a list of {num_layers} attention types"
            )
        sliding = tuple(i for i, kind in enumerate(layer_types) if "sliding" in str(kind))
    elif "max_window_layers" in data:  # Qwen2: layers from max_window_layers on slide
        sliding = tuple(range(int(data["max_window_layers"]), num_layers))
    else:  # Mistral v0.1: every layer slides
        sliding = tuple(range(num_layers))
    return (window, sliding) if sliding else (None, ())


def read_config_file(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """A config.json file, or the config.json of a model directory: (its path, its dict).

    Raises:
        ConfigError: missing file, invalid JSON, or not a JSON object.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError.field("model", str(path), "no such config.json file")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError.field("model", str(path), f"not a readable JSON file ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError.field("model", str(path), "config.json must hold a JSON object")
    return path, data
