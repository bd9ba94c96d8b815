"""The built-in models: published config.json values of well-known models (the fields
that size KV and weights), by preset name, and where the embedded model's own packaged
config.json lives."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


def packaged_config(name: str) -> Path | None:
    """The config.json shipped inside kvstrata for preset `name` (the embedded model), or
    None when the preset has no packaged model."""
    path = Path(__file__).parents[1] / "checkpoints" / name / "config.json"
    return path if path.is_file() else None
