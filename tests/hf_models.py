"""Tiny random models of several families for exactness tests (DESIGN.md testing notes:
a larger initializer_range so the models are not blind to old context)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from kvstrata.model.zoo import build_byte_tokenizer, tiny_code_config

COMMON = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    initializer_range=0.3,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        {"sliding_window": 48},
    ),
    "qwen2": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        {"use_sliding_window": True, "sliding_window": 40, "max_window_layers": 1},
    ),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 16}),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, {}),
    # learned attention sinks (s_aux), sliding and full layers, a mixture of experts
    "gpt_oss": (
        transformers.GptOssConfig,
        transformers.GptOssForCausalLM,
        {
            "head_dim": 16,
            "sliding_window": 32,
            "layer_types": ["sliding_attention", "full_attention"],
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
    "gemma2": (
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        {
            "sliding_window": 32,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "tie_word_embeddings": False,
        },
    ),
}


def reference_attn(family: str) -> str:
    """transformers' attention for the DynamicCache reference: Gemma-2 soft-caps logits,
    which its sdpa path does not support, and GPT-OSS has no sdpa path at all."""
    return "eager" if family in ("gemma2", "gpt_oss") else "sdpa"


def tiny_model(family: str, attn: str = "sdpa", seed: int = 0, **overrides) -> torch.nn.Module:
    cfg_cls, model_cls, extra = FAMILIES[family]
    kwargs = {**COMMON, **extra, **overrides}
    config = cfg_cls(**kwargs)
    config._attn_implementation = attn
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    return model


def make_tiny_model_dir(path: Path) -> Path:
    """A 2-layer byte-level Llama with the real tokenizer and a held-out listing.

    initializer_range 0.3: default-init tiny models barely look at old context, which
    would make any cache look exact (DESIGN.md testing notes)."""
    torch.manual_seed(0)
    config = tiny_code_config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        initializer_range=0.3,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    build_byte_tokenizer().save_pretrained(path)
    (path / "heldout_files.txt").write_text("json/encoder.py\nno/such/file.py\njson/decoder.py\n")
    return path
