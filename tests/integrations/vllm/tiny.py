"""What the vLLM backend tests run: tiny random models built here (no hub) with kvstrata's
embedded byte-level tokenizer — a Llama, a Gemma-2-style model (sliding-window and full
layers alternating: several KV cache groups) and a Mistral with a window (every layer
sliding) — prompts, and an `Engine` — one vLLM `LLM` with kvstrata as its offloading
backend, on the CPU in fp32 with greedy sampling."""

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
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**_COMMON, num_hidden_layers=NUM_LAYERS)
    return _save(LlamaForCausalLM, config, path, seed)


def _save(model_class: Any, config: Any, path: Path, seed: int) -> Path:
    """A model of `config` with random wide weights (every token of a prompt matters),
    saved with the tokenizer."""
    import torch

    import kvstrata

    torch.manual_seed(seed)
    model = model_class(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    tokenizer_dir = Path(kvstrata.__file__).parent / "checkpoints" / "kvstrata-code-tiny"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)
    return path


_COMMON = dict(
    vocab_size=259, hidden_size=128, intermediate_size=256, num_attention_heads=4,
    num_key_value_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=4096,
    bos_token_id=256, eos_token_id=257, pad_token_id=258, tie_word_embeddings=True,
)  # fmt: skip
# Gemma-2-style: 3 sliding-window layers and 2 full ones, alternating. vLLM's hybrid
# allocator makes 3 KV cache groups of 2 layers (sliding 0+4, sliding 2 + a padding
# layer, full 1+3): several groups, one of them short.
GEMMA_LAYERS = ("sliding_attention", "full_attention") * 2 + ("sliding_attention",)
GEMMA_WINDOW = 64  # tokens: two vLLM blocks
MISTRAL_WINDOW = 80  # tokens: 2.5 vLLM blocks, so a window starts inside a 64-token chunk


def build_tiny_gemma2(path: Path, seed: int) -> Path:
    """A random-init Gemma-2-style model: GEMMA_LAYERS, window GEMMA_WINDOW (soft-capped
    attention and logits, as Gemma-2)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        **_COMMON, num_hidden_layers=len(GEMMA_LAYERS), layer_types=list(GEMMA_LAYERS),
        sliding_window=GEMMA_WINDOW, query_pre_attn_scalar=HEAD_DIM,
    )  # fmt: skip
    return _save(Gemma2ForCausalLM, config, path, seed)


def build_tiny_mistral_window(path: Path, seed: int) -> Path:
    """A random-init 2-layer Mistral whose every layer attends to MISTRAL_WINDOW tokens
    (one sliding-window KV cache group)."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(**_COMMON, num_hidden_layers=NUM_LAYERS, sliding_window=MISTRAL_WINDOW)
    return _save(MistralForCausalLM, config, path, seed)


def prompts(count: int, num_tokens: int, seed: int = 1) -> list[list[int]]:
    """`count` prompts of random byte tokens (no eos), distinct from their first block."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(num_tokens)] for _ in range(count)]


class Engine:
    """One vLLM LLM with kvstrata as its offloading backend, and what it reported."""

    def __init__(
        self, model: Path, stats_file: Path, engine_args: dict | None = None, **fields: Any
    ) -> None:
        """`engine_args`: more of LLM's arguments (tensor_parallel_size=2, ...)."""
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
            **(engine_args or {}),
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


class Rig:
    """vLLM's scheduler side (kvstrata's manager) and its workers (one per tensor-parallel
    rank) driven in this process, over KV pages made here in vLLM's CPU layout; the
    groups share one page tensor per layer slot, as under vLLM's hybrid allocator.

    Args:
        geometry: the model's config.json fields (KVGeometry.from_hf_config).
        extra: the backend's settings (kv_connector_extra_config).
        group_layers: layers per KV cache group.
        tp: tensor-parallel workers.
        blocks_per_chunk: vLLM blocks per kvstrata block.
    """

    def __init__(
        self,
        geometry: dict[str, Any],
        extra: dict[str, Any],
        group_layers: tuple[int, ...],
        tp: int = 1,
        blocks_per_chunk: int = 1,
        num_blocks: int = 16,
        seed: int = 0,
    ) -> None:
        import uuid

        import torch
        from vllm.v1.kv_offload.base import (
            CanonicalKVCacheRef,
            CanonicalKVCaches,
            CanonicalKVCacheTensor,
        )

        from kvstrata.integrations.vllm.backend_plan import VllmSide, make_plan
        from kvstrata.integrations.vllm.manager import KvstrataOffloadingManager
        from kvstrata.integrations.vllm.options import VllmOptions
        from kvstrata.integrations.vllm.store import OffloadStore
        from kvstrata.integrations.vllm.worker import KvstrataOffloadingWorker
        from kvstrata.model.geometry import KVGeometry

        geo = KVGeometry.from_hf_config(geometry)
        heads, layers = max(1, geo.num_kv_heads // tp), max(group_layers)
        page = heads * 2 * VLLM_BLOCK * geo.head_dim * 4
        options = VllmOptions.from_extra_config(extra)
        side = VllmSide(
            model_name="tiny", dtype="float32", num_layers=layers, tokens_per_block=VLLM_BLOCK,
            blocks_per_chunk=blocks_per_chunk, worker_kv_bytes_per_block=layers * page,
            engine_id=f"rig-{uuid.uuid4().hex}", world_size=tp, group_layers=group_layers,
            tp_size=tp,
        )  # fmt: skip
        self.plan = make_plan(options, side, geo)
        torch.manual_seed(seed)
        shape = (num_blocks, heads, 2, VLLM_BLOCK, geo.head_dim)
        # per rank, per layer slot: [num_blocks, heads, K|V, tokens, dim]
        self.pages = [[torch.randn(shape) for _ in range(layers)] for _ in range(tp)]
        refs = [[CanonicalKVCacheRef(i, page) for i in range(n)] for n in group_layers]
        self.workers = [
            KvstrataOffloadingWorker(  # rank 0 creates the host arena, the others join it
                self.plan,
                CanonicalKVCaches(
                    [
                        CanonicalKVCacheTensor(t.view(num_blocks, -1).view(torch.int8), page)
                        for t in self.pages[rank]
                    ],  # fmt: skip
                    refs,
                ),
                {},
                rank,
            )
            for rank in range(tp)
        ]
        self.manager = KvstrataOffloadingManager(OffloadStore(self.plan, options))
        self.store = self.manager.store
        self._jobs = 0

    def store_blocks(self, keys: list[bytes], groups: list[tuple[list[int], int]]) -> list:
        """Store `keys` (in vLLM's order: group by group) from the vLLM blocks of each
        group (`(block_ids, index of the first block in the request)`); the keys stored."""
        from vllm.v1.kv_offload.base import GPULoadStoreSpec

        out = self.manager.prepare_store(keys, None)
        assert out is not None
        spec = GPULoadStoreSpec(
            [b for ids, _ in groups for b in ids], [len(ids) for ids, _ in groups],
            [index for _, index in groups],
        )  # fmt: skip
        for worker in self.workers:
            worker.submit_store(self._job(), spec, out.store_spec)
            assert all(r.success for r in worker.get_finished())
        self.manager.complete_store(out.keys_to_store, None)
        self.manager.on_schedule_end(None)
        return out.keys_to_store

    def lookup(self, keys: list[bytes]) -> list[str]:
        """vLLM's lookups of `keys`; blocks only on disk answer RETRY and are read in one
        batch at the step's end, then looked up again (as vLLM does a step later)."""
        first = [self.manager.lookup(k, None).name for k in keys]
        if "RETRY" not in first:
            return first
        self.manager.on_schedule_end(None)
        self.store.drain()
        return [self.manager.lookup(k, None).name for k in keys]

    def load_blocks(self, keys: list[bytes], groups: list[tuple[list[int], int]]) -> None:
        """Load `keys` (hits) into the vLLM blocks of each group, as `store_blocks`."""
        from vllm.v1.kv_offload.base import GPULoadStoreSpec

        assert set(self.lookup(keys)) == {"HIT"}
        src = self.manager.prepare_load(keys, None)
        spec = GPULoadStoreSpec(
            [b for ids, _ in groups for b in ids], [len(ids) for ids, _ in groups],
            [index for _, index in groups],
        )  # fmt: skip
        for worker in self.workers:
            worker.submit_load(self._job(), src, spec)
            worker.get_finished()
        self.manager.complete_load(keys, None)
        self.manager.on_schedule_end(None)

    def _job(self) -> int:
        self._jobs += 1
        return self._jobs

    def close(self) -> dict[str, Any]:
        """Shut the manager (disk index committed) and the workers down; the stats."""
        self.manager.shutdown()
        for worker in self.workers:
            worker.shutdown()
        return self.store.stats()


def read_back(store: Any, keys: list[bytes]) -> list[str]:
    """The lookups of `keys` as vLLM repeats them: blocks only on disk answer RETRY and
    are read in one batch at the step's end; once it landed, they are looked up again."""
    from kvstrata.integrations.vllm.remote import RETRY

    first = [store.lookup(k) for k in keys]
    assert RETRY in first, first
    store.end_step()
    store.drain()
    return [store.lookup(k) for k in keys]
