"""Tiny random models of several families for exactness tests (DESIGN.md testing notes:
a larger initializer_range so the models are not blind to old context)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from transformers import DynamicCache

from kvstrata.workload.zoo import build_byte_tokenizer, tiny_code_config

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


def seeded_ids(seed: int, n: int) -> torch.Tensor:
    """[1, n] token ids of the tiny models' vocabulary (3..96), from `seed`."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 97, (1, n), generator=g)


def greedy_ids(model, ids: torch.Tensor, cache, n: int) -> torch.Tensor:
    """`model.generate` of exactly n greedy tokens through `cache`."""
    return model.generate(ids, cache=cache, max_new_tokens=n, min_new_tokens=n, do_sample=False)


def shared_prefix_case(
    model, prefix: int, tail: int, seeds: tuple[int, ...], new: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Prompts of one `prefix`-token prefix (seed 7) and a `tail` of each seed, and their
    greedy references with a DynamicCache — checked to depend on the prefix's first
    tokens (else a cache that served the wrong prefix could not show)."""
    start = seeded_ids(7, prefix)
    prompts = [torch.cat([start, seeded_ids(seed, tail)], dim=1) for seed in seeds]
    refs = [greedy_ids(model, p, DynamicCache(config=model.config), new) for p in prompts]
    flipped = prompts[1].clone()
    flipped[0, :16] = (flipped[0, :16] + 1 - 3) % 94 + 3
    alt = greedy_ids(model, flipped, DynamicCache(config=model.config), new)
    assert not torch.equal(alt, refs[1]), "reference ignores the shared prefix: test is blind"
    return prompts, refs
