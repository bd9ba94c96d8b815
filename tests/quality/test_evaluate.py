"""The quality harness on a tiny random byte-level model: exactness of `none`, a small but
real error for lossy codecs, consistent perplexity / bits-per-byte arithmetic."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from kvstrata.core.errors import ConfigError
from kvstrata.quality.evaluate import (
    LOSSLESS_TOLERANCE_PCT,
    PplResult,
    compare,
    exact_cache_factory,
    heldout_stream,
    heldout_windows,
    perplexity,
    placement,
    tiered_cache_factory,
    top1_agreement,
    window_perplexity,
)
from kvstrata.workload.zoo import EOS_ID, load_model

CONTEXT = 64
BLOCK = 16


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    model, _ = load_model(tiny_dir)
    return model


@pytest.fixture(scope="module")
def windows(tiny_dir):
    return heldout_windows(tiny_dir, CONTEXT, 2)


def test_heldout_windows_are_deterministic_byte_windows(tiny_dir, windows):
    import json

    stream = heldout_stream(tiny_dir)
    encoder = (Path(json.__file__).parent / "encoder.py").read_bytes()
    decoder = (Path(json.__file__).parent / "decoder.py").read_bytes()
    # Files in listing order, each followed by <eos>; the missing file is skipped.
    assert stream == [*encoder, EOS_ID, *decoder, EOS_ID]
    assert windows == [list(encoder[:CONTEXT]), list(encoder[CONTEXT : 2 * CONTEXT])]
    assert heldout_windows(tiny_dir, CONTEXT, 2) == windows
    too_many = len(stream) // CONTEXT + 1
    with pytest.raises(ConfigError, match="windows="):
        heldout_windows(tiny_dir, CONTEXT, too_many)
    with pytest.raises(ConfigError, match="context="):
        heldout_windows(tiny_dir, 1, 1)


def test_exact_perplexity_matches_one_parallel_forward(tiny, windows):
    """Token-by-token through DynamicCache = one teacher-forced forward of the window."""
    ids = torch.tensor(windows[0])
    res = perplexity(tiny, ids, exact_cache_factory(tiny), CONTEXT)
    with torch.no_grad():
        logits = tiny(ids[None]).logits[0, :-1]
    nll = float(torch.nn.functional.cross_entropy(logits, ids[1:], reduction="sum"))
    assert res.num_tokens == CONTEXT - 1
    assert res.num_bytes == CONTEXT - 1  # all byte tokens, no <eos> in the first window
    assert res.nll == pytest.approx(nll, rel=1e-5)
    assert res.argmax_ids == logits.argmax(-1).tolist()
    assert res.ppl == pytest.approx(math.exp(nll / (CONTEXT - 1)), rel=1e-5)
    assert res.bits_per_byte == pytest.approx(nll / math.log(2) / (CONTEXT - 1), rel=1e-5)


def test_prefill_changes_nothing_for_the_exact_cache(tiny, windows):
    one = window_perplexity(tiny, windows[0], DynamicCache(config=tiny.config))
    ten = window_perplexity(tiny, windows[0], DynamicCache(config=tiny.config), prefill=10)
    assert ten.num_tokens == one.num_tokens == CONTEXT - 1
    assert ten.nll == pytest.approx(one.nll, rel=1e-5)
    assert ten.argmax_ids == one.argmax_ids


def test_bits_per_byte_arithmetic():
    res = PplResult(nll=10 * math.log(2), num_tokens=5, num_bytes=4, argmax_ids=[1, 2])
    assert res.bits_per_byte == 2.5
    assert res.ppl == pytest.approx(math.exp(2 * math.log(2)))
    both = res.merged(PplResult(0.0, 1, 1, [3]))
    assert (both.num_tokens, both.num_bytes, both.argmax_ids) == (6, 5, [1, 2, 3])
    assert both.bits_per_byte == 2.0
    assert top1_agreement([1, 2, 3, 4], [1, 0, 3, 0]) == 0.5
    with pytest.raises(ValueError, match="length"):
        top1_agreement([1], [1, 2])


def test_placement_fields(tiny):
    # 1 layer-pair... 2 layers x 1 KV head x 16 dims x fp32 x (K + V) = 256 B/token.
    none_block = 2 * 1 * (16 + 16) * 4 * BLOCK
    kw = placement(tiny, CONTEXT, codec="none", resident=0.5, block_size=BLOCK)
    assert kw["device_budget"] == 2 * none_block  # 4 blocks in all, half resident
    assert kw["host_budget"] == 3 * none_block  # 2 cold + 1 spare
    assert kw["host_codec"] == "none" and "disk_dir" not in kw
    assert "host_budget" not in placement(tiny, CONTEXT, resident=1.0, block_size=BLOCK)
    # A lossy codec keeps sinks + residual + open block on the device whatever `resident`.
    lossy = placement(
        tiny, CONTEXT, codec="int8", resident=0.1, block_size=BLOCK, residual_tokens=16
    )
    assert lossy["device_budget"] == 3 * none_block
    assert lossy["host_codec"] == "int8"
    disk = placement(tiny, CONTEXT, resident=0.5, block_size=BLOCK, disk_dir="/x")
    assert (disk["host_budget"], disk["disk_budget"]) == (none_block, 2 * none_block)
    with pytest.raises(ConfigError, match="resident="):
        placement(tiny, CONTEXT, resident=0.0)
    with pytest.raises(ConfigError, match="valid codecs"):
        placement(tiny, CONTEXT, codec="banana")


def test_none_is_exact_and_int8_is_small(tiny, windows, tmp_path):
    configs = {
        "none-host": placement(tiny, CONTEXT, codec="none", resident=0.25, block_size=BLOCK),
        "none-disk": placement(
            tiny, CONTEXT, codec="none", resident=0.25, block_size=BLOCK, disk_dir=str(tmp_path)
        ),
        "int8": placement(
            tiny, CONTEXT, codec="int8", resident=0.1, block_size=BLOCK, residual_tokens=16
        ),
    }
    steps = []
    report = compare(tiny, windows, configs, CONTEXT, progress=steps.append)
    assert len(steps) == 4 * 2 * (CONTEXT - 1)  # exact + 3 configs, 2 windows, 1 step/token
    assert report.exact.num_tokens == 2 * (CONTEXT - 1)
    for name in ("none-host", "none-disk"):
        res = report.configs[name]
        assert abs(res.delta_ppl_pct) < LOSSLESS_TOLERANCE_PCT, (name, res.delta_ppl_pct)
        assert res.top1_agreement == 1.0
        assert res.result.argmax_ids == report.exact.argmax_ids
    int8 = report.configs["int8"]
    # the lossy history is really attended: far above float rounding
    assert abs(int8.delta_ppl_pct) > 10 * LOSSLESS_TOLERANCE_PCT, int8.delta_ppl_pct
    assert abs(int8.delta_ppl_pct) < 1.0
    assert int8.top1_agreement >= 0.95
    # each window got a fresh disk tier directory
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache-0", "cache-1"]
    assert tiny.config._attn_implementation == "sdpa"


def test_lossy_offloaded_history_changes_the_result(tiny, windows):
    """Guard against a harness that does not attend the stored history: quantizing the
    history to fp8 must move the NLL, and keeping it on the device must not."""
    offloaded = placement(
        tiny, CONTEXT, codec="fp8", resident=0.1, block_size=BLOCK, residual_tokens=16
    )
    resident = placement(tiny, CONTEXT, codec="fp8", resident=1.0, block_size=BLOCK)
    exact = perplexity(tiny, windows[0], exact_cache_factory(tiny), CONTEXT)
    far = perplexity(tiny, windows[0], tiered_cache_factory(tiny, **offloaded), CONTEXT)
    near = perplexity(tiny, windows[0], tiered_cache_factory(tiny, **resident), CONTEXT)
    assert far.nll != pytest.approx(exact.nll, rel=1e-6)
    assert near.nll == pytest.approx(exact.nll, rel=1e-6)


def test_compare_rejects_bad_input(tiny, windows):
    with pytest.raises(ConfigError, match="windows="):
        compare(tiny, [], {}, CONTEXT)
    with pytest.raises(ConfigError, match="'exact'"):
        compare(tiny, windows, {"exact": {}}, CONTEXT)
    with pytest.raises(ConfigError, match="host_codec"):
        compare(tiny, windows, {"x": {"host_codec": ""}}, CONTEXT)
    with pytest.raises(ConfigError, match="context="):
        perplexity(tiny, windows[0], exact_cache_factory(tiny), 1)


def test_disk_placement_really_spans_three_tiers(tiny, windows, tmp_path):
    kw = placement(tiny, CONTEXT, resident=0.25, block_size=BLOCK, disk_dir=str(tmp_path))
    cache = tiered_cache_factory(tiny, **kw)(CONTEXT)
    res = window_perplexity(tiny, windows[0], cache)
    exact = window_perplexity(tiny, windows[0], DynamicCache(config=tiny.config))
    occupancy = cache.stats()["tiers"]
    # 63 tokens cached = 4 blocks: 1 on the device, 1 on the host, 2 on disk.
    assert {t: o["used_blocks"] for t, o in occupancy.items()} == {
        "device": 1,
        "host": 1,
        "disk": 2,
    }
    assert res.argmax_ids == exact.argmax_ids
    assert res.nll == pytest.approx(exact.nll, rel=1e-6)
