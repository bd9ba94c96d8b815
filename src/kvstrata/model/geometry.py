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

KVGeometry is the one owner of KV sizing: the block layout of a model's KV (`to_layout`,
and `head_layout`, the per-head K/V a store or vLLM page holds) and the bytes per token,
per layer and per context derived from it; the budgets, the planner and the vLLM backend
ask it. Reading configs lives in kvstrata.model.hf_config, the presets in
kvstrata.model.presets, the support check in kvstrata.model.support.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch

from kvstrata.codecs.registry import get_codec
from kvstrata.core.errors import ConfigError
from kvstrata.core.layout import BlockLayout
from kvstrata.model.dtypes import DTYPES, dtype_name, is_dtype_name
from kvstrata.model.groups import LayerGroup
from kvstrata.model.hf_config import geometry_fields, read_config_file
from kvstrata.model.presets import PRESETS, packaged_config
from kvstrata.model.weights import safetensors_params

# Block sizes tried, in order, when a codec needs whole token groups (int4-g128 keys).
CODEC_BLOCK_SIZES = (64, 128, 256)


def _exact(value: Fraction) -> int | float:
    """An int when the byte count is whole, else the fractional count as a float."""
    return int(value) if value.denominator == 1 else float(value)


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
        return cls(**geometry_fields(config, name))

    @classmethod
    def from_json(cls, path: str | Path) -> KVGeometry:
        """Read a config.json file, or the config.json of a model directory.

        Raises:
            ConfigError: missing file, invalid JSON, or missing/malformed fields.
        """
        path, data = read_config_file(path)
        geometry = cls.from_hf_config(data, name=str(path))
        if geometry.num_params is None:  # any family: count the weights beside the config
            geometry = replace(geometry, num_params=safetensors_params(path.parent))
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
        packaged = packaged_config(key)
        if packaged is not None:  # the embedded model's own config is the truth
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
                num_layers=self.num_layers,
                num_kv_heads=1,
                head_dim=self.kv_lora_rank,
                block_size=block_size,
                dtype=torch_dtype,
                v_head_dim=self.qk_rope_head_dim,
            )
        return self.head_layout(block_size, torch_dtype)

    def head_layout(
        self,
        block_size: int,
        dtype: torch.dtype,
        *,
        num_layers: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        v_head_dim: int | None = None,
    ) -> BlockLayout:
        """The block layout of the K/V the attention heads produce, per KV head: what
        kvstrata's store keeps per slot (one layer group) and a vLLM page holds (one
        layer). For MLA the expanded heads, not the latent (that is `to_layout`).

        Args:
            block_size: tokens per block.
            dtype: the torch dtype of the K/V, as is.
            num_layers: the layers one block spans; None (or 0) = all of them.
            num_kv_heads / head_dim / v_head_dim: override the config (the K/V a model
                really produces); None (or 0) = the config's.
        """
        return BlockLayout(
            num_layers=num_layers or self.num_layers,
            num_kv_heads=num_kv_heads or self.num_kv_heads,
            head_dim=head_dim or self.head_dim,
            block_size=block_size,
            dtype=dtype,
            v_head_dim=v_head_dim or self.v_head_dim,
        )

    def _token_bytes(self, codec: str, dtype: object, block_size: int | None) -> Fraction:
        """Exact stored bytes per token, all layers (see `bytes_per_token`)."""
        if is_dtype_name(codec):
            return Fraction(self.to_layout(1, dtype_name(codec, "codec")).raw_block_bytes)
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

    def layer_bytes(
        self,
        num_tokens: int,
        codec: str = "none",
        dtype: object = None,
        block_size: int | None = None,
    ) -> float:
        """Stored KV bytes of `num_tokens` tokens of one (average) layer:
        num_tokens * bytes_per_token / num_layers, in the arithmetic of `bytes_per_token`'s
        value (int, or float when fractional); codec / dtype / block_size as there."""
        return num_tokens * self.bytes_per_token(codec, dtype, block_size) / self.num_layers

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
