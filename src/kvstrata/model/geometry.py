"""KV geometry of a model: what one token costs in KV bytes, per layer and in total.

Bytes per token, all layers, K and V:

    MHA / GQA / MQA:  2 * L * Hkv * D * elem            (Llama-2-7B fp16: 524,288 B)
    MLA (DeepSeek):   L * (kv_lora_rank + qk_rope_head_dim) * elem
                      (the compressed latent c_kv plus the shared rope key, as MLA-aware
                      engines cache it; transformers' eager DeepSeek-V2 caches the
                      expanded per-head K/V instead, which is far larger)

Sliding-window layers (Mistral v0.1, Qwen2 with use_sliding_window) only keep the last
`sliding_window` tokens, so `bytes_for_context` sums min(window, context) per layer.

Codec sizes come from the codec registry (`block_nbytes(layout) / block_size`), so scale
and zero-point bytes are counted exactly as the tiers store them.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch

from kvstrata.core.errors import ConfigError
from kvstrata.core.layout import BlockLayout
from kvstrata.model.groups import LayerGroup

# dtype names -> (torch dtype, bytes per element). Codec names are looked up in the registry.
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "fp32": (torch.float32, 4),
    "fp16": (torch.float16, 2),
    "bf16": (torch.bfloat16, 2),
}
_DTYPE_ALIASES = {
    "float32": "fp32",
    "float": "fp32",
    "torch.float32": "fp32",
    "float16": "fp16",
    "half": "fp16",
    "torch.float16": "fp16",
    "bfloat16": "bf16",
    "torch.bfloat16": "bf16",
}
# Block sizes tried, in order, when a codec needs whole token groups (int4-g128 keys).
CODEC_BLOCK_SIZES = (64, 128, 256)
# Gated-MLP decoders whose parameter count `_estimate_params` knows how to compute.
_GATED_MLP_TYPES = ("llama", "mistral", "qwen2", "qwen3")

# Published config.json values (only the fields that size KV and weights), plus the
# parameter count where it cannot be derived from them (MoE, OPT).
# fmt: off
PRESETS: dict[str, dict[str, Any]] = {
    "llama-2-7b": {
        "model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
        "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 11008,
        "vocab_size": 32000, "torch_dtype": "float16",
    },
    "llama-2-13b": {
        "model_type": "llama", "num_hidden_layers": 40, "hidden_size": 5120,
        "num_attention_heads": 40, "num_key_value_heads": 40, "intermediate_size": 13824,
        "vocab_size": 32000, "torch_dtype": "float16",
    },
    "llama-2-70b": {
        "model_type": "llama", "num_hidden_layers": 80, "hidden_size": 8192,
        "num_attention_heads": 64, "num_key_value_heads": 8, "intermediate_size": 28672,
        "vocab_size": 32000, "torch_dtype": "float16",
    },
    "llama-3-8b": {
        "model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
        "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
        "vocab_size": 128256, "torch_dtype": "bfloat16",
    },
    "llama-3-70b": {
        "model_type": "llama", "num_hidden_layers": 80, "hidden_size": 8192,
        "num_attention_heads": 64, "num_key_value_heads": 8, "intermediate_size": 28672,
        "vocab_size": 128256, "torch_dtype": "bfloat16",
    },
    "mistral-7b": {  # v0.1: every layer slides over 4096 tokens
        "model_type": "mistral", "num_hidden_layers": 32, "hidden_size": 4096,
        "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
        "vocab_size": 32000, "sliding_window": 4096, "torch_dtype": "bfloat16",
    },
    "qwen2.5-7b": {  # sliding_window is set but use_sliding_window is false: all full
        "model_type": "qwen2", "num_hidden_layers": 28, "hidden_size": 3584,
        "num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 18944,
        "vocab_size": 152064, "sliding_window": 131072, "use_sliding_window": False,
        "max_window_layers": 28, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    "qwen2.5-72b": {
        "model_type": "qwen2", "num_hidden_layers": 80, "hidden_size": 8192,
        "num_attention_heads": 64, "num_key_value_heads": 8, "intermediate_size": 29568,
        "vocab_size": 152064, "sliding_window": 131072, "use_sliding_window": False,
        "max_window_layers": 80, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    "deepseek-v2-lite": {  # MLA; 15.7B total parameters (MoE, 2.4B active)
        "model_type": "deepseek_v2", "num_hidden_layers": 27, "hidden_size": 2048,
        "num_attention_heads": 16, "num_key_value_heads": 16, "kv_lora_rank": 512,
        "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "vocab_size": 102400, "torch_dtype": "bfloat16",
        "num_params": 15_700_000_000,
    },
    "opt-175b": {
        "model_type": "opt", "num_hidden_layers": 96, "hidden_size": 12288,
        "num_attention_heads": 96, "ffn_dim": 49152, "vocab_size": 50272,
        "torch_dtype": "float16", "num_params": 175_000_000_000,
    },
    # The project's embedded model (modelzoo.tiny_code_config; a packaged config.json wins).
    "kvstrata-code-tiny": {
        "model_type": "llama", "num_hidden_layers": 4, "hidden_size": 256,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "intermediate_size": 688, "vocab_size": 259, "tie_word_embeddings": True,
        "torch_dtype": "float32",
    },
}
# fmt: on


def dtype_name(value: object, field: str = "dtype") -> str:
    """Normalise a dtype ("float16", torch.bfloat16, "bf16") to "fp32" | "fp16" | "bf16".

    Raises:
        ConfigError: an unknown dtype; the message lists the accepted names.
    """
    name = _DTYPE_ALIASES.get(str(value).lower(), str(value).lower())
    if name not in DTYPES:
        raise ConfigError.field(field, value, f"one of {', '.join(DTYPES)}")
    return name


def _exact(value: Fraction) -> int | float:
    """An int when the byte count is whole, else the fractional count as a float."""
    return int(value) if value.denominator == 1 else float(value)


def _get_int(data: dict[str, Any], keys: tuple[str, ...], name: str, default: int | None = None):
    for key in keys:
        value = data.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError.field(f"{name}: {key}", value, "a positive integer")
            return value
    if default is not None:
        return default
    raise ConfigError.field(f"{name}: {keys[0]}", None, "required field is missing")


def _estimate_params(data: dict[str, Any], geometry: KVGeometry) -> int | None:
    """Exact parameter count of a Llama-style (gated MLP, RMSNorm) decoder, else None."""
    inter, vocab, hidden = (data.get(k) for k in ("intermediate_size", "vocab_size", "hidden_size"))
    if geometry.model_type not in _GATED_MLP_TYPES or not all(
        isinstance(v, int) for v in (inter, vocab, hidden)
    ):
        return None
    q_dim, kv_dim = (
        geometry.num_heads * geometry.head_dim,
        geometry.num_kv_heads * geometry.head_dim,
    )
    bias = data.get("attention_bias", geometry.model_type == "qwen2")  # Qwen2 has qkv bias
    attn = hidden * q_dim + 2 * hidden * kv_dim + q_dim * hidden
    attn += (q_dim + 2 * kv_dim) if bias else 0
    per_layer = attn + 3 * hidden * inter + 2 * hidden  # + two RMSNorm weights
    embeddings = vocab * hidden * (1 if data.get("tie_word_embeddings", False) else 2)
    return embeddings + geometry.num_layers * per_layer + hidden


def _safetensors_params(model_dir: Path) -> int | None:
    """Parameters stored in a model directory's safetensors files, read from their
    headers alone (None when there are none or a header is unreadable)."""
    total = 0
    try:
        index = model_dir / "model.safetensors.index.json"
        if index.is_file():  # the shards it names (not e.g. a consolidated copy beside)
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            files = [model_dir / name for name in names]
        elif (model_dir / "model.safetensors").is_file():
            files = [model_dir / "model.safetensors"]
        else:
            files = sorted(model_dir.glob("*.safetensors"))
        for file in files:
            with file.open("rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
            for name, entry in header.items():
                if name != "__metadata__":
                    total += math.prod(entry["shape"])
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
    return total or None


@dataclass(frozen=True)
class KVGeometry:
    """The part of a model config that sizes its KV cache (and its weights).

    Fields:
        model_type: HF `model_type` ("llama", "mistral", "qwen2", "deepseek_v2", ...).
        num_layers / num_heads / num_kv_heads / head_dim: attention shape.
        v_head_dim: value head dim (differs from head_dim for MLA).
        dtype: the model's dtype name ("fp32", "fp16", "bf16").
        sliding_window: window of the sliding layers (None: no sliding layer).
        sliding_layers: indices of the layers that use the window.
        kv_lora_rank / qk_rope_head_dim: MLA latent sizes (None for non-MLA models).
        num_params: parameter count (sizes the weights), None when unknown.
        name: preset name or config path, for messages.
        shared_kv_layers: the model's last layers that reuse earlier layers' K/V and
            cache none (Gemma-3n); `num_layers` counts only the layers that cache.
    """

    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    dtype: str = "fp16"
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    num_params: int | None = None
    name: str = ""
    shared_kv_layers: int = 0

    @property
    def attention_layers(self) -> int:
        """The model's attention layers: those that cache K/V and those that reuse it."""
        return self.num_layers + self.shared_kv_layers

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        bad = [i for i in self.sliding_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ConfigError.field("layer_types", bad[0], f"layer index in [0, {self.num_layers})")
        if self.sliding_layers and self.sliding_window is None:
            raise ConfigError.field("sliding_window", None, "sliding layers need a window size")

    # -- constructors -------------------------------------------------------------------

    @classmethod
    def from_hf_config(cls, config: Any, name: str = "") -> KVGeometry:
        """Read the KV geometry from a transformers config object or a config.json dict.

        Args:
            config: a `PretrainedConfig` (anything with `to_dict()`) or a plain dict.
            name: where it came from, used in error messages.

        Returns:
            The geometry; `num_params` is exact for Llama-style models, else taken from a
            "num_params" entry or None.

        Raises:
            ConfigError: a required field is missing or malformed (names the field).
        """
        where = name or "config"
        data = _config_data(config, where)
        model_type = str(data.get("model_type") or "unknown")
        num_layers = _get_int(data, ("num_hidden_layers", "n_layer", "num_layers"), where)
        # Gemma-3n style: the last layers reuse the K/V of earlier ones and cache none
        shared = data.get("num_kv_shared_layers") or 0
        if shared:
            if (
                isinstance(shared, bool)
                or not isinstance(shared, int)
                or not (0 < shared < num_layers)
            ):
                raise ConfigError.field(
                    f"{where}: num_kv_shared_layers", shared, f"an integer in [0, {num_layers})"
                )
            num_layers -= shared
            if isinstance(data.get("layer_types"), list):
                data = {**data, "layer_types": data["layer_types"][:num_layers]}
        num_heads = _get_int(data, ("num_attention_heads", "n_head", "num_heads"), where)
        num_kv_heads = _get_int(
            data, ("num_key_value_heads", "num_kv_heads", "multi_query_group_num"), where, num_heads
        )
        if data.get("multi_query") is True and not data.get("new_decoder_architecture"):
            num_kv_heads = 1  # multi-query (GPTBigCode, Falcon-7B): one K/V head
        hidden = data.get("hidden_size", data.get("n_embd", data.get("d_model")))
        default_dim = hidden // num_heads if isinstance(hidden, int) and hidden > 0 else None
        head_dim = _get_int(data, ("head_dim", "kv_channels"), where, default_dim)
        kv_lora_rank = data.get("kv_lora_rank")
        rope_dim = None
        if kv_lora_rank is not None:  # MLA: the cache holds the latent, one "head"
            kv_lora_rank = _get_int(data, ("kv_lora_rank",), where)
            rope_dim = _get_int(data, ("qk_rope_head_dim",), where)
            head_dim = _get_int(data, ("qk_nope_head_dim",), where, 128) + rope_dim
        v_head_dim = _get_int(data, ("v_head_dim",), where, head_dim)
        raw_dtype = data.get("dtype") or data.get("torch_dtype") or "float32"  # HF default
        try:
            dtype = dtype_name(raw_dtype)
        except ConfigError:
            raise ConfigError.field(
                f"{where}: torch_dtype", raw_dtype, "float32, float16 or bfloat16"
            ) from None
        window, sliding = _sliding_layers(data, num_layers, where)
        geometry = cls(
            model_type=model_type, num_layers=num_layers, num_heads=num_heads,
            num_kv_heads=num_kv_heads, head_dim=head_dim, v_head_dim=v_head_dim, dtype=dtype,
            sliding_window=window, sliding_layers=sliding, kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=rope_dim, name=name, shared_kv_layers=shared,
        )  # fmt: skip
        params = data.get("num_params")
        if not isinstance(params, int):
            params = _estimate_params(data, geometry)
        return replace(geometry, num_params=params)

    @classmethod
    def from_json(cls, path: str | Path) -> KVGeometry:
        """Read a config.json file, or the config.json of a model directory.

        Raises:
            ConfigError: missing file, invalid JSON, or missing/malformed fields.
        """
        path = Path(path).expanduser()
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError.field("model", str(path), "no such config.json file")
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError.field(
                "model", str(path), f"not a readable JSON file ({exc})"
            ) from None
        if not isinstance(data, dict):
            raise ConfigError.field("model", str(path), "config.json must hold a JSON object")
        geometry = cls.from_hf_config(data, name=str(path))
        if geometry.num_params is None:  # any family: count the weights beside the config
            geometry = replace(geometry, num_params=_safetensors_params(path.parent))
        return geometry

    @classmethod
    def from_preset(cls, name: str) -> KVGeometry:
        """A built-in model: one of `PRESETS` (published config.json values).

        Raises:
            ConfigError: unknown name; the message lists the presets.
        """
        key = name.lower()
        if key not in PRESETS:
            raise ConfigError.field(
                "model", name, f"presets: {', '.join(PRESETS)}; or a config.json / model directory"
            )
        packaged = Path(__file__).parents[1] / "models" / key / "config.json"
        if packaged.is_file():  # the embedded model's own config is the truth
            return replace(cls.from_json(packaged), name=key)
        return cls.from_hf_config(PRESETS[key], name=key)

    # -- sizes --------------------------------------------------------------------------

    @property
    def is_mla(self) -> bool:
        """True for multi-head latent attention (DeepSeek-V2/V3): the cache is the latent."""
        return self.kv_lora_rank is not None

    def to_layout(self, block_size: int, dtype: object = None) -> BlockLayout:
        """The block layout of this model's KV (what tiers and codecs size).

        For MLA the cache is one latent "head" per layer: K holds c_kv
        (kv_lora_rank wide) and V holds the shared rope key (qk_rope_head_dim wide).

        Args:
            block_size: tokens per block.
            dtype: KV dtype name or torch dtype; None = the model's dtype.
        """
        torch_dtype = DTYPES[dtype_name(dtype if dtype is not None else self.dtype)][0]
        if self.is_mla:
            assert self.kv_lora_rank is not None and self.qk_rope_head_dim is not None
            return BlockLayout(
                num_layers=self.num_layers, num_kv_heads=1, head_dim=self.kv_lora_rank,
                block_size=block_size, dtype=torch_dtype, v_head_dim=self.qk_rope_head_dim,
            )  # fmt: skip
        return BlockLayout(
            num_layers=self.num_layers, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            block_size=block_size, dtype=torch_dtype, v_head_dim=self.v_head_dim,
        )  # fmt: skip

    def _token_bytes(self, codec: str, dtype: object, block_size: int | None) -> Fraction:
        """Exact stored bytes per token, all layers (see `bytes_per_token`)."""
        if codec.lower() in DTYPES or codec.lower() in _DTYPE_ALIASES:
            return Fraction(self.to_layout(1, dtype_name(codec, "codec")).raw_block_bytes)
        from kvstrata.codecs.registry import get_codec

        impl = get_codec(codec)
        sizes = (block_size,) if block_size is not None else CODEC_BLOCK_SIZES
        error: ConfigError | None = None
        for size in sizes:
            layout = self.to_layout(size, dtype)
            try:
                impl.validate(layout)
            except ConfigError as exc:  # e.g. int4-g128 needs whole 128-token groups
                error = exc
                continue
            return Fraction(impl.block_nbytes(layout), size)
        assert error is not None
        raise error

    def bytes_per_token(
        self, codec: str = "none", dtype: object = None, block_size: int | None = None
    ) -> int | float:
        """KV bytes of one token, all layers, K and V, as stored by `codec`.

        Args:
            codec: a dtype name ("fp32", "fp16", "bf16": plain element size) or a
                registered codec ("none" = the KV dtype, "fp8", "int8", "int4", ...).
            dtype: the KV dtype the codec encodes from; None = the model's dtype.
            block_size: block size for codecs whose scales are per block; None = the
                first of 64, 128, 256 the codec accepts.

        Returns:
            Bytes per token: an int, or a float when a codec's scales make it fractional.

        Raises:
            ConfigError: unknown codec or dtype (lists the valid names).
        """
        return _exact(self._token_bytes(codec, dtype, block_size))

    def kv_tokens_for_layer(self, layer: int, context: int, block_size: int | None = None) -> int:
        """Tokens layer `layer` keeps for a `context`-token sequence (sliding: the window).

        With `block_size`, what kvstrata's store holds: a sliding layer keeps the
        blocks from the first one its window (plus one block of slack) still sees
        (kvstrata.model.groups), so planner and cache agree to within a block per group."""
        if not 0 <= layer < self.num_layers:
            raise ConfigError.field("layer", layer, f"a layer index in [0, {self.num_layers})")
        if layer in self.sliding_layers and self.sliding_window is not None:
            if block_size is None:
                return min(self.sliding_window, context)
            group = LayerGroup(0, (layer,), self.sliding_window)
            return context - group.first_live_block(context, block_size) * block_size
        return context

    def bytes_for_context(
        self,
        context: int,
        codec: str = "none",
        dtype: object = None,
        block_size: int | None = None,
    ) -> int | float:
        """KV bytes of one `context`-token sequence, honouring sliding windows.

        Args:
            context: tokens in the sequence.
            codec / dtype / block_size: as in `bytes_per_token`.

        Returns:
            Bytes (int, or float when fractional).
        """
        per_layer_token = self._token_bytes(codec, dtype, block_size) / self.num_layers
        tokens = sum(
            self.kv_tokens_for_layer(i, context, block_size) for i in range(self.num_layers)
        )
        return _exact(per_layer_token * tokens)

    def describe(self) -> str:
        """One line: '32 layers x 32 KV heads x 128 (fp16), sliding 4096 on 32 layers'."""
        if self.is_mla:
            shape = (
                f"{self.num_layers} layers x MLA latent {self.kv_lora_rank}+{self.qk_rope_head_dim}"
            )
        else:
            shape = f"{self.num_layers} layers x {self.num_kv_heads} KV heads x {self.head_dim}"
        text = f"{self.model_type}: {shape} ({self.dtype})"
        if self.sliding_layers:
            text += f", sliding window {self.sliding_window} on {len(self.sliding_layers)} layers"
        return text


def _sliding_layers(data: dict[str, Any], num_layers: int, where: str):
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


def load_geometry(spec: str) -> KVGeometry:
    """A geometry from a preset name, a config.json path, a model directory or a GGUF file.

    Args:
        spec: "llama-3-8b", "/models/x/config.json" or "/models/x".

    Raises:
        ConfigError: unknown preset / missing or malformed config (lists the presets).
    """
    path = Path(spec).expanduser()
    if spec.lower() in PRESETS:
        return KVGeometry.from_preset(spec)
    if path.suffix.lower() == ".gguf" and path.is_file():
        from kvstrata.model.gguf import gguf_file_dir

        path = gguf_file_dir(path)  # converted into the cache once
    if path.is_dir() or path.is_file():
        return KVGeometry.from_json(path)
    return KVGeometry.from_preset(spec)  # raises, listing the presets


# layer types whose KV a block cache holds (softmax attention over past keys)
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
# per-layer config fields that change the shape of a layer's K/V
_SHAPE_FIELDS = ("head_dim", "num_key_value_heads", "v_head_dim")


def _config_data(config: Any, where: str) -> dict:
    """A config as a dict (multimodal wrappers: their language model's part)."""
    data = config.to_dict() if hasattr(config, "to_dict") else config
    if not isinstance(data, dict):
        raise ConfigError.field(where, type(data).__name__, "a config dict or PretrainedConfig")
    if isinstance(data.get("text_config"), dict):
        data = {**data["text_config"], "model_type": data["text_config"].get("model_type", "")}
    return data


def check_cacheable(config: Any, name: str = "") -> None:
    """Refuse models whose caches are not per-layer softmax K/V (encoder-decoder
    cross-attention, linear-attention / SSM state layers).

    Raises:
        UnsupportedModelError: names the model type and what is not supported.
    """
    from kvstrata.core.errors import UnsupportedModelError

    data = _config_data(config, name or "config")
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
        for name in _SHAPE_FIELDS:
            default = data.get(name)
            for layer, fields in sorted(per_layer.items()):
                value = fields.get(name) if isinstance(fields, dict) else None
                if value is None or value == default:
                    continue
                if default is None:  # no global value: the first layer that names one
                    default = value
                    continue
                raise UnsupportedModelError(
                    f"model_type={model_type!r}: layer {layer} has {name}={value} where "
                    f"others have {default}: TieredCache stores one K/V shape for every layer"
                )
