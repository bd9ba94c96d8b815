"""kvstrata.workload.memory_plan and kvstrata.platform.hardware: the seed's numbers."""

from __future__ import annotations

import json

import pytest

from kvstrata.codecs.registry import codec_names
from kvstrata.core.errors import ConfigError
from kvstrata.platform.hardware import GIB, get_gpu, get_link, make_hardware
from kvstrata.workload.memory_plan import (
    Workload,
    memory_saved,
    plan,
    resident_tokens,
    transfer_seconds,
)
from kvstrata.workload.zoo import load_geometry

LLAMA2 = load_geometry("llama-2-7b")


def hw(gpu="rtx4090", **kw):
    kw.setdefault("host_memory", 128 * GIB)
    return make_hardware(gpu, **kw)


def test_seed_transfer_bound_4gib_over_pcie4():
    seconds = transfer_seconds(4 * GIB, get_link("pcie4").bandwidth)
    assert seconds == 4 * GIB / 25e9
    assert round(seconds * 1e3) == 172


def test_memory_saved_seed_arithmetic():
    assert memory_saved(4, 0.5) == 0.875
    assert memory_saved(4, 0.4) == pytest.approx(0.9)


def test_seed_keep_1k_of_8k_saves_87_5_percent():
    p = plan(LLAMA2, hw(), Workload(context_tokens=8192, concurrency=4))
    assert p.tiers.resident_tokens == 1024
    assert p.tiers.device_bytes == 4 * GIB // 2  # 0.5 GiB per request
    assert p.memory_saved == 0.875
    assert p.tiers.host_bytes == 4 * 3.5 * GIB


def test_seed_int8_plus_80_percent_offload_saves_90_percent():
    if "int8" not in codec_names():
        pytest.skip("int8 codec not registered yet")
    work = Workload(context_tokens=10240, codec="int8", resident_fraction=0.2)
    p = plan(LLAMA2, hw(), work)
    assert p.tiers.resident_tokens == 2048
    ratio = LLAMA2.bytes_per_token("int8", "fp16") / 524_288
    assert p.memory_saved == pytest.approx(1 - 0.2 * ratio, rel=1e-12)
    # The seed ignores int8's scale/zero bytes (90 %); counted, it is ~89.7 %.
    assert p.memory_saved == pytest.approx(0.90, abs=0.005)


def test_rtx4090_8k_x4_recommends_offload_with_budget():
    p = plan(LLAMA2, hw(), Workload(context_tokens=8192, concurrency=4))
    assert p.weights_bytes == 6_738_415_616 * 2
    assert p.kv_total_bytes == 16 * GIB
    assert p.reserve_bytes == int(0.1 * 24 * GIB)
    assert p.kv_room_bytes == 24 * GIB - p.weights_bytes - p.reserve_bytes
    assert not p.fits_on_gpu and p.feasible
    assert p.verdict == "recommend"
    assert len(p.reasons_for) == 6 and p.reasons_against == []
    assert p.block_size == 128
    assert p.tiers.host_bytes + p.tiers.device_bytes == 16 * GIB
    assert p.bounds.host_link_s == 14 * GIB / 25e9
    assert p.bounds.all_on_gpu_s == (p.weights_bytes + 16 * GIB) / 1008e9
    assert p.bounds.tiered_s == p.bounds.host_link_s
    json.dumps(p.to_dict())  # serialisable


def test_h200_2k_advises_against():
    p = plan(LLAMA2, hw("h200"), Workload(context_tokens=2048))
    assert p.fits_on_gpu and p.verdict == "advise against"
    text = " ".join(p.reasons_against)
    assert "fits" in text and ">= 80 GiB" in text and "<= 2k" in text


def test_latency_and_slow_link_count_against():
    hardware = hw(link="pcie3-x8")
    p = plan(LLAMA2, hardware, Workload(context_tokens=8192, concurrency=4, priority="latency"))
    text = " ".join(p.reasons_against)
    assert "latency-sensitive" in text and "PCIe 3.0 x8" in text
    assert p.block_size == 64
    assert p.verdict == "neutral"  # it does not fit, so offload is the only way, but slow


def test_host_too_small_says_which_budget_to_raise():
    p = plan(LLAMA2, hw(host_memory=8 * GIB), Workload(context_tokens=8192, concurrency=4))
    assert not p.feasible
    assert p.tiers.host_bytes == int(8 * GIB * 0.8)
    assert p.tiers.unplaced_bytes == 14 * GIB - p.tiers.host_bytes
    assert "--host-memory" in p.raise_hint and "--disk-link" in p.raise_hint
    with_disk = plan(
        LLAMA2,
        hw(host_memory=8 * GIB, disk_link="nvme-gen4"),
        Workload(context_tokens=8192, concurrency=4),
    )
    assert with_disk.feasible and with_disk.tiers.disk_bytes == p.tiers.unplaced_bytes
    assert with_disk.bounds.disk_link_s == with_disk.tiers.disk_bytes / 7e9


def test_weights_do_not_fit():
    p = plan(load_geometry("llama-2-70b"), hw(), Workload(context_tokens=4096))
    assert p.kv_room_bytes < 0 and not p.feasible
    assert p.verdict == "advise against" and "weights" in p.raise_hint


def test_sliding_window_caps_kv():
    p = plan(load_geometry("mistral-7b"), hw(), Workload(context_tokens=32768, concurrency=4))
    assert p.kv_per_request_bytes == 4096 * 131_072
    row = next(r for r in p.table if r.context_tokens == 131072)
    # what the store holds with 256-token blocks: the 4096-token window + one block of
    # slack, from a block boundary: 131072 - (131072 - 4095 - 256) // 256 * 256 tokens
    assert row.per_request["fp16"] == 4352 * 131_072


def test_planner_counts_sliding_blocks_like_the_store():
    from kvstrata.model.budgets import blocks_held
    from kvstrata.model.groups import layer_groups

    g = load_geometry("mistral-7b")
    groups = layer_groups(g.num_layers, g.sliding_layers, g.sliding_window)
    for ctx in (100, 4096, 4097, 5000, 131072):
        tokens = blocks_held(groups, ctx, 64) * 64  # whole blocks (the last one partial)
        planned = g.bytes_for_context(ctx, "fp16", block_size=64)
        per_token = g.bytes_per_token("fp16")
        assert 0 <= tokens * per_token - planned < 64 * per_token


def test_memory_table():
    p = plan(load_geometry("llama-3-8b"), hw(), Workload(context_tokens=8192, concurrency=2))
    assert [r.context_tokens for r in p.table] == [1024 * k for k in (1, 2, 4, 8, 16, 32, 64, 128)]
    row = p.table[3]
    assert row.per_request["fp16"] == 8192 * 131_072
    assert row.total["fp16"] == 2 * 8192 * 131_072
    if "int4" in codec_names():
        assert row.per_request["int4"] == 8192 * 36_864


def test_resident_tokens_clamped_to_5_20_percent_in_blocks():
    assert resident_tokens(Workload(context_tokens=8192), 128) == 1024
    assert resident_tokens(Workload(context_tokens=131072), 256) == 6656  # 5 %, whole blocks
    assert resident_tokens(Workload(context_tokens=2048), 64) == 448  # 20 % = 409.6 -> 7 blocks
    assert resident_tokens(Workload(context_tokens=100), 64) == 64


def test_params_required_when_unknown():
    g = load_geometry("llama-3-8b").__class__(
        model_type="x", num_layers=2, num_heads=2, num_kv_heads=2, head_dim=8, v_head_dim=8
    )
    with pytest.raises(ConfigError, match=r"^params=None"):
        plan(g, hw(), Workload(context_tokens=1024))
    assert plan(g, hw(), Workload(context_tokens=1024, params=10**6)).weights_bytes == 2 * 10**6


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"concurrency": 0}, "concurrency"),
        ({"priority": "fast"}, "priority"),
        ({"block_size": 8}, "block_size"),
        ({"resident_fraction": 2.0}, "resident_fraction"),
    ],
)
def test_workload_validation(kwargs, field):
    with pytest.raises(ConfigError, match=f"^{field}="):
        Workload(context_tokens=1024, **kwargs)


def test_hardware_presets_and_overrides():
    assert get_gpu("a100-80").memory_bytes == 80 * GIB
    assert get_gpu("h100").bandwidth == 3350e9
    assert get_gpu("rtx4090", memory=16 * GIB).memory_bytes == 16 * GIB
    assert get_link("pcie5").bandwidth == 50e9
    assert make_hardware(disk_link="nvme-gen3", host_memory=1).disk.bandwidth == 3.5e9
    assert make_hardware(host_memory=None).host_memory > 0  # this machine's RAM
    with pytest.raises(ConfigError, match=r"^gpu='v100'.*rtx4090.*h200"):
        get_gpu("v100")
    with pytest.raises(ConfigError, match=r"^link='pcie6'.*pcie3-x8"):
        get_link("pcie6")
    with pytest.raises(ConfigError, match=r"^disk_link='sata'.*nvme-gen4"):
        make_hardware(disk_link="sata")
    with pytest.raises(ConfigError, match=r"^gpu_memory=-1"):
        get_gpu("l4", memory=-1)
