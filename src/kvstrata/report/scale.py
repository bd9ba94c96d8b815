"""How much the report measures: `smoke` (tests, seconds), `quick` (<= 15 minutes on a
2-core machine) and `full` (bigger machines). Sizes only: the method is the same."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Scale:
    """Sizes of every section of one report run.

    Fields:
        name: "smoke", "quick" or "full" (the flag that chose it).
        repeats: interleaved timed rounds of every timed comparison (medians).
        block_size: tokens per block of the decode, strategy and quality caches.
        residual_tokens: the full-precision window a lossy placement keeps on the device
            (with the sinks); smoke keeps it small so that scoring reads lossy blocks.
        resident: device share of the offloading strategies (seed: 5-20 %).
        strategy_context / strategy_steps: prompt tokens and timed decode steps of the
            strategy table's speed column.
        ppl_window / ppl_windows: held-out windows (tokens, count) of the ΔPPL column,
            scored one token per forward.
        greedy_prompts / greedy_prompt_tokens / greedy_new: greedy agreement runs.
        resident_context / resident_fractions / resident_codecs: the resident sweep.
        decode_steps: timed decode steps of the sweeps.
        contexts / context_resident: the context sweep and the tiered cache's fixed
            device share (tokens).
        tier_size_mib / tier_samples: tier throughput size and single-block reads.
        codecs / codec_size_mib / codec_ppl_window: the codec section.
        compression_model / compression_contexts / compression_repeats: the compression
            section's delta-coding table: its model (None: the report's model, as the
            strategy table chooses it), the contexts of real K/V it codes and its
            interleaved timing rounds.
        prefix_tokens / prefix_suffix: prefix reuse prompt.
        serve_requests / serve_prompt_tokens / serve_max_tokens: engine workload.
    """

    name: str
    repeats: int
    block_size: int
    residual_tokens: int
    resident: float
    strategy_context: int
    strategy_steps: int
    ppl_window: int
    ppl_windows: int
    greedy_prompts: int
    greedy_prompt_tokens: int
    greedy_new: int
    resident_context: int
    resident_fractions: tuple[float, ...]
    resident_codecs: tuple[str, ...]
    decode_steps: int
    contexts: tuple[int, ...]
    context_resident: int
    tier_size_mib: int
    tier_samples: int
    codecs: tuple[str, ...]
    codec_size_mib: int
    codec_ppl_window: int
    compression_model: str | None
    compression_contexts: tuple[int, ...]
    compression_repeats: int
    prefix_tokens: int
    prefix_suffix: int
    serve_requests: int
    serve_prompt_tokens: int
    serve_max_tokens: int


_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
_CODECS = ("none", "fp8", "int8", "int4", "int4-g32", "int4-g128")

SCALES: dict[str, Scale] = {
    "smoke": Scale(
        name="smoke",
        repeats=1,
        block_size=64,
        residual_tokens=64,
        resident=0.1,
        strategy_context=320,
        strategy_steps=2,
        ppl_window=320,
        ppl_windows=1,
        greedy_prompts=1,
        greedy_prompt_tokens=256,
        greedy_new=4,
        resident_context=512,
        resident_fractions=(0.1, 0.5, 1.0),
        resident_codecs=("none", "int4"),
        decode_steps=2,
        contexts=(128, 256, 512),
        context_resident=128,
        tier_size_mib=1,
        tier_samples=8,
        codecs=("none", "int8", "int4"),
        codec_size_mib=1,
        codec_ppl_window=320,
        compression_model="tiny",
        compression_contexts=(256,),
        compression_repeats=1,
        prefix_tokens=128,
        prefix_suffix=8,
        serve_requests=2,
        serve_prompt_tokens=8,
        serve_max_tokens=2,
    ),
    "quick": Scale(
        name="quick",
        repeats=5,
        block_size=64,
        residual_tokens=128,
        resident=0.1,
        strategy_context=1024,
        strategy_steps=16,
        ppl_window=512,
        ppl_windows=2,
        greedy_prompts=3,
        greedy_prompt_tokens=512,
        greedy_new=32,
        resident_context=8192,
        resident_fractions=_FRACTIONS,
        resident_codecs=("none", "int8", "int4"),
        decode_steps=16,
        contexts=(1024, 2048, 4096, 8192, 16384, 32768),
        context_resident=1024,
        tier_size_mib=64,
        tier_samples=200,
        codecs=_CODECS,
        codec_size_mib=32,
        codec_ppl_window=1024,
        compression_model=None,
        compression_contexts=(2048,),
        compression_repeats=3,
        prefix_tokens=2048,
        prefix_suffix=32,
        serve_requests=8,
        serve_prompt_tokens=128,
        serve_max_tokens=32,
    ),
    "full": Scale(
        name="full",
        repeats=5,
        block_size=64,
        residual_tokens=128,
        resident=0.1,
        strategy_context=4096,
        strategy_steps=64,
        ppl_window=2048,
        ppl_windows=2,
        greedy_prompts=4,
        greedy_prompt_tokens=1024,
        greedy_new=128,
        resident_context=16384,
        resident_fractions=_FRACTIONS,
        resident_codecs=("none", "fp8", "int8", "int4"),
        decode_steps=64,
        contexts=(1024, 2048, 4096, 8192, 16384, 32768, 65536),
        context_resident=1024,
        tier_size_mib=128,
        tier_samples=200,
        codecs=_CODECS,
        codec_size_mib=64,
        codec_ppl_window=2048,
        compression_model=None,
        compression_contexts=(2048, 4096),
        compression_repeats=3,
        prefix_tokens=4096,
        prefix_suffix=32,
        serve_requests=8,
        serve_prompt_tokens=256,
        serve_max_tokens=64,
    ),
}
