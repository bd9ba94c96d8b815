"""`kvstrata bench selection --engine`: decode speed of query-aware key selection where a
user meets it — the engine's greedy generation (its lean forward and native decode
projections), full attention and each budget over the same placement.

Per configuration and repeat, one Engine (no prefix cache) computes the prompt (the
window's first context - `tokens` tokens) and decodes `tokens` tokens greedily; the
configurations alternate within each repeat. Reported per configuration: decode ms per
token (median of the gaps between outputs, over repeats), attention ms per decode step
(inside the store's attention, all layers, median), both as ratios to full attention,
and the share of decoded tokens equal to full attention's (greedy agreement: the first
token that differs changes every later input, so this is a prefix).
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any


def _one(model: Any, tokenizer: Any, ids: list[int], fields: dict, tokens: int) -> dict:
    """One engine's greedy decode of `tokens` tokens after prompt `ids`."""
    from kvstrata.engine import Engine, EngineConfig, SamplingParams

    config = EngineConfig(max_num_seqs=1)  # one request: the device holds one open block
    engine = Engine(model, tokenizer, config=config, prefix_caching=False, **fields)
    try:
        runtime = engine.store.runtime
        spent = [0.0]
        inner = runtime.attend

        def timed(*args: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*args)
            finally:
                spent[0] += time.perf_counter() - t0

        runtime.attend = timed
        outs: list[tuple[float, float, list[int]]] = []
        done = threading.Event()

        def on_output(out: Any) -> None:
            outs.append((time.perf_counter(), spent[0], list(out.token_ids)))
            if out.finished:
                done.set()

        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        engine.submit(ids, params, on_output=on_output, first_output=True)
        done.wait()
    finally:
        engine.shutdown()
    # outs[0]: the prompt's first token; each later output: the tokens of its steps
    steps = [
        (b[0] - a[0], b[1] - a[1], len(b[2])) for a, b in zip(outs, outs[1:], strict=False) if b[2]
    ]
    return {
        "token_ids": [t for _, _, new in outs for t in new],
        "step_s": [d / n for d, _, n in steps],
        "attention_s": [a / n for _, a, n in steps],
    }


def engine_decode(
    model: Any,
    tokenizer: Any,
    ids: list[int],
    configs: dict[str, dict],
    tokens: int = 64,
    repeats: int = 2,
    progress: Any = None,
) -> list[dict[str, Any]]:
    """Rows (config, decode_ms, attention_ms, decode_speedup, attention_speedup,
    agreement) of greedy decoding through the Engine; the first config is the
    baseline. `configs` maps a name to the CacheConfig fields of its store."""
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    for _ in range(repeats):
        for name, fields in configs.items():
            runs[name].append(_one(model, tokenizer, ids, fields, tokens))
            if progress:
                progress(1)
    base = next(iter(configs))
    ref = runs[base][0]["token_ids"]

    def med(name: str, key: str) -> float:
        return statistics.median(v for run in runs[name] for v in run[key])

    rows = []
    for name in configs:
        got = runs[name][0]["token_ids"]
        same = next(
            (i for i, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b),
            min(len(got), len(ref)),
        )
        step, attn = med(name, "step_s"), med(name, "attention_s")
        rows.append({
            "config": name,
            "decode_ms": 1000 * step,
            "attention_ms": 1000 * attn,
            "decode_speedup": med(base, "step_s") / step,
            "attention_speedup": med(base, "attention_s") / attn if attn else None,
            "agreement": same / max(1, len(ref)),
        })  # fmt: skip
    return rows
