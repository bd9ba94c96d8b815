"""What the vLLM backend tests run: a tiny random Llama built here (no hub) with kvstrata's
embedded byte-level tokenizer, prompts, and an `Engine` — one vLLM `LLM` with kvstrata as
its offloading backend, on the CPU in fp32 with greedy sampling."""

from __future__ import annotations

import gc
import json
import shutil
import time
from pathlib import Path
from typing import Any

VLLM_BLOCK = 32  # tokens per vLLM block (a multiple of 32 on the CPU)
NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 2, 2, 32


def build_tiny_llama(path: Path, seed: int) -> Path:
    """A random-init 2-layer Llama (4 heads, 2 kv heads, head dim 32) with kvstrata's
    embedded byte-level tokenizer, saved where vLLM can load it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import kvstrata

    config = LlamaConfig(
        vocab_size=259,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=4096,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)  # wide weights: every token of a prompt matters
    model.save_pretrained(path)
    tokenizer_dir = Path(kvstrata.__file__).parent / "models" / "kvstrata-code-tiny"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)
    return path


def prompts(count: int, num_tokens: int, seed: int = 1) -> list[list[int]]:
    """`count` prompts of random byte tokens (no eos), distinct from their first block."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(num_tokens)] for _ in range(count)]


class Engine:
    """One vLLM LLM with kvstrata as its offloading backend, and what it reported."""

    def __init__(self, model: Path, stats_file: Path, **fields: Any) -> None:
        from vllm import LLM

        from kvstrata.integrations.vllm import kv_transfer_config

        self.stats_file = stats_file
        stats_file.unlink(missing_ok=True)
        started = time.perf_counter()
        self.llm = LLM(
            model=str(model),
            enforce_eager=True,
            dtype="float32",
            block_size=VLLM_BLOCK,
            kv_cache_memory_bytes=64 << 20,
            seed=0,
            kv_transfer_config=kv_transfer_config(stats_file=str(stats_file), **fields),
        )
        self.startup_s = time.perf_counter() - started

    def generate(self, batch: list[list[int]], max_tokens: int = 12) -> tuple[list, list]:
        """Greedy tokens and cached prompt tokens (vLLM's num_cached_tokens) per prompt;
        vLLM's own prefix cache is emptied afterwards, so what a later call finds
        cached came from kvstrata."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        assert self.llm.reset_prefix_cache()
        return [list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens for o in outs]

    def stats(self) -> dict[str, Any]:
        return json.loads(self.stats_file.read_text())

    def settle(self, timeout: float = 60.0) -> dict[str, Any]:
        """Step the engine until every stored block is on the disk tier (stores finish
        a step after their request, disk writes on the scheduler's writer thread)."""
        deadline = time.monotonic() + timeout
        while True:
            self.generate([[1, 2, 3]], max_tokens=1)
            stats = self.stats()
            done = stats["disk_path"] is None or stats["disk_written"] >= stats["stored"]
            if done or time.monotonic() > deadline:
                return stats
            time.sleep(0.2)

    def close(self) -> dict[str, Any]:
        """Shut the engine down (its scheduler closes the store: the disk index is
        committed and the directory lock released); the final stats."""
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()
        return self.stats()
