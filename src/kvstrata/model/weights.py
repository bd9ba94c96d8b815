"""Parameter counts, which size a model's weights: computed from the config of a
Llama-style (gated MLP, RMSNorm) decoder, or read from the headers of the safetensors
files beside a config.json (no tensor data is read)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

# Gated-MLP decoders whose parameter count `gated_mlp_params` knows how to compute.
GATED_MLP_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def gated_mlp_params(
    data: dict[str, Any],
    *,
    model_type: str,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> int | None:
    """Exact parameter count of a Llama-style (gated MLP, RMSNorm) decoder, else None.

    Args:
        data: the config dict (intermediate_size, vocab_size, hidden_size, attention_bias,
            tie_word_embeddings).
        model_type / num_layers / num_heads / num_kv_heads / head_dim: the attention shape,
            as the KV geometry read it.
    """
    inter, vocab, hidden = (data.get(k) for k in ("intermediate_size", "vocab_size", "hidden_size"))
    if model_type not in GATED_MLP_TYPES or not all(
        isinstance(v, int) for v in (inter, vocab, hidden)
    ):
        return None
    q_dim, kv_dim = num_heads * head_dim, num_kv_heads * head_dim
    bias = data.get("attention_bias", model_type == "qwen2")  # Qwen2 has qkv bias
    attn = hidden * q_dim + 2 * hidden * kv_dim + q_dim * hidden
    attn += (q_dim + 2 * kv_dim) if bias else 0
    per_layer = attn + 3 * hidden * inter + 2 * hidden  # + two RMSNorm weights
    embeddings = vocab * hidden * (1 if data.get("tie_word_embeddings", False) else 2)
    return embeddings + num_layers * per_layer + hidden


def safetensors_params(model_dir: Path) -> int | None:
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
