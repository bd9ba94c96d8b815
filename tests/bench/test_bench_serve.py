"""`kvstrata bench serve` on a tiny workload: every figure comes from this run."""

from __future__ import annotations

import argparse

from kvstrata.bench import serve


def test_bench_serve_measures_every_variant():
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(
        ["--requests", "3", "--prompt-tokens", "48", "--max-tokens", "4", "--repeats", "1",
         "--threads", "1", "--no-load", "--block-size", "4"]
    )  # fmt: skip
    report = serve.measure(args)
    variants = report["variants"]
    assert set(variants) == {"baseline", "c1", "c4", "c8", "c8_dev25"}
    for name, v in variants.items():
        assert v["median_s"] > 0 and v["tokens_per_s"] == 12 / v["median_s"]
        if name != "baseline":
            assert v["exact_vs_baseline"] is True, name  # greedy engine = transformers
            assert 0 < v["ttft_p50_s"] <= v["ttft_p99_s"]
    ratios = report["ratios"]
    assert (
        ratios["c8/baseline"]
        == variants["c8"]["tokens_per_s"] / variants["baseline"]["tokens_per_s"]
    )
    # the 25 % device variant really kept blocks on the host
    assert report["dev25_tiers"].get("host", 0) > 0
    assert report["prompt_tokens"] == [24, 48, 72]
    assert report["peak_running"]["c8_dev25"] == report["peak_running"]["c8"] == 3
    assert 0 < report["dev25_device_share"] < 1
