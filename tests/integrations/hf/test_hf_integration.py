"""TieredCache + "kvstrata" attention give the same tokens as DynamicCache (fp32).

Each reference is checked to depend on old context first (DESIGN.md testing notes):
flipping an early prompt token — and, for sliding-window models, a token inside the
window — must change the reference output, otherwise "identical tokens" proves nothing.
"""

from __future__ import annotations

import os

import pytest
import torch
from transformers import DynamicCache

import kvstrata
from hf_models import FAMILIES, reference_attn, tiny_model
from kvstrata.integrations.hf import TieredCache, enable

PROMPT_LEN = 1024
NEW_TOKENS = 200

PLACEMENTS = {
    "device": dict(max_tokens=1536),
    "resident10_host": dict(max_tokens=1536, resident_fraction=0.1, host_budget="8MiB"),
    # decode through torch partials per run instead of the native kernel
    "resident10_host_torch": dict(
        max_tokens=1536, resident_fraction=0.1, host_budget="8MiB", native_attention=False
    ),
    "resident10_host_staged": dict(
        max_tokens=1536, resident_fraction=0.1, host_budget="8MiB", cold_attention="stage"
    ),
    # 16 KiB blocks: 8 fit on the host, the oldest ~half of the 20 blocks go to disk
    "oldest_half_disk": dict(
        max_tokens=1536, resident_fraction=0.1, host_budget="128KiB", disk_budget="4MiB"
    ),
    # the same, each disk block layer compressed losslessly (byte planes + zstd)
    "oldest_half_disk_zstd": dict(
        max_tokens=1536,
        resident_fraction=0.1,
        host_budget="128KiB",
        disk_budget="4MiB",
        disk_compress=True,
    ),
    # the same through O_DIRECT
    "oldest_half_disk_o_direct": dict(
        max_tokens=1536,
        resident_fraction=0.1,
        host_budget="128KiB",
        disk_budget="4MiB",
        disk_o_direct=True,
    ),
}


def _o_direct_works(directory) -> bool:
    probe = directory / "o_direct_probe"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0))
    except OSError:
        return False
    os.close(fd)
    probe.unlink()
    return hasattr(os, "O_DIRECT")


def _prompt(seed: int = 1, length: int = PROMPT_LEN, batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 97, (batch, length), generator=g)


def _greedy(model, ids, cache, n=NEW_TOKENS, **kw):
    return model.generate(
        ids, cache=cache, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw
    )


@pytest.fixture(scope="module")
def references():
    out = {}
    for family in FAMILIES:
        model = tiny_model(family, reference_attn(family))
        ids = _prompt()
        ref = _greedy(model, ids, DynamicCache(config=model.config), n=NEW_TOKENS)
        out[family] = (model, ids, ref)
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_reference_depends_on_old_context(family, references):
    model, ids, ref = references[family]
    layer_types = getattr(model.config, "layer_types", None) or ["full_attention"]
    # A model whose every layer slides (Mistral) cannot see the first tokens at 1024.
    if "full_attention" in layer_types and not (
        family == "mistral" and model.config.sliding_window
    ):
        flipped = ids.clone()  # the first block of the prompt
        flipped[0, :32] = (flipped[0, :32] + 1 - 3) % 94 + 3
        alt = _greedy(model, flipped, DynamicCache(config=model.config), n=40)
        assert not torch.equal(alt[:, PROMPT_LEN:], ref[:, PROMPT_LEN : PROMPT_LEN + 40]), (
            f"{family}: output ignores prompt tokens 0-31; the exactness test would be blind"
        )
    window = getattr(model.config, "sliding_window", None)
    if window:
        changed = []
        for pos in (PROMPT_LEN - window + 8, PROMPT_LEN - window // 2, PROMPT_LEN - 12):
            inside = ids.clone()
            inside[0, pos] = (inside[0, pos] + 1 - 3) % 94 + 3
            alt = _greedy(model, inside, DynamicCache(config=model.config), n=40)
            changed.append(
                not torch.equal(alt[:, PROMPT_LEN:], ref[:, PROMPT_LEN : PROMPT_LEN + 40])
            )
        assert any(changed), f"{family}: output ignores every token inside the window"


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_tokens_identical(family, placement, references, tmp_path):
    model, ids, ref = references[family]
    enable(model)
    kwargs = dict(PLACEMENTS[placement])
    if "disk_budget" in kwargs:
        kwargs["disk_dir"] = str(tmp_path)
    native = kwargs.pop("native_attention", True)
    if kwargs.get("disk_compress"):
        pytest.importorskip("zstandard", reason="disk compression needs the compress extra")
    if kwargs.get("disk_o_direct") and not _o_direct_works(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT (tmpfs?)")
    try:
        cache = TieredCache(model.config, block_size=64, **kwargs)
        cache.native_attention = native
        out = _greedy(model, ids, cache)
    finally:
        model.set_attn_implementation(reference_attn(family))
    assert torch.equal(out, ref), (out != ref).nonzero()[:5].tolist()
    tiers = cache.stats()["tiers"]
    if placement != "device":
        assert tiers["host"]["used_blocks"] > 0
    if "disk" in tiers and not getattr(model.config, "sliding_window", None):
        # (a sliding model's groups drop what the window cannot see: few blocks)
        total = sum(t["used_blocks"] for t in tiers.values())
        assert tiers["disk"]["used_blocks"] >= total // 2 - 1, tiers
        assert tiers["device"]["used_blocks"] <= tiers["device"]["budget_blocks"]


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_block_sizes(family, block_size, references):
    model, ids, ref = references[family]
    enable(model)
    try:
        cache = TieredCache(
            model.config,
            block_size=block_size,
            max_tokens=2048,
            resident_fraction=0.15,
            host_budget="8MiB",
        )
        out = _greedy(model, ids, cache)
    finally:
        model.set_attn_implementation(reference_attn(family))
    assert torch.equal(out, ref)


def _llama():
    model = tiny_model("llama", "sdpa")
    return model


def _small_cache(model, **overrides) -> TieredCache:
    """16-token blocks, 4 MiB of host: every test prompt spills to the host tier."""
    kwargs = dict(block_size=16, max_tokens=512, host_budget="4MiB")
    return TieredCache(model.config, **{**kwargs, **overrides})


def test_left_padded_batch_of_three():
    model = _llama()
    g = torch.Generator().manual_seed(5)
    lengths = [300, 260, 200]
    ids = torch.zeros(3, 300, dtype=torch.long)
    mask = torch.zeros(3, 300, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, 300 - n :] = torch.randint(3, 97, (n,), generator=g)
        mask[i, 300 - n :] = 1
    ref = _greedy(model, ids, DynamicCache(config=model.config), n=60, attention_mask=mask)
    enable(model)
    cache = _small_cache(model, resident_fraction=0.2, max_tokens=1200)
    out = _greedy(model, ids, cache, n=60, attention_mask=mask)
    assert torch.equal(out, ref), (out != ref).nonzero()[:5].tolist()


def test_beam_search_three_beams():
    model = _llama()
    ids = _prompt(length=200)
    kw = dict(num_beams=3, max_new_tokens=40, min_new_tokens=40, do_sample=False)
    ref = model.generate(ids, cache=DynamicCache(config=model.config), **kw)
    enable(model)
    cache = _small_cache(model, resident_fraction=0.2, max_tokens=1200)
    out = model.generate(ids, cache=cache, **kw)
    assert torch.equal(out, ref)


def test_prompt_lookup_decoding_uses_crop():
    model = _llama()
    # a repetitive prompt so that prompt lookup proposes (and rejects) candidates
    base = _prompt(length=50)
    ids = base.repeat(1, 6)
    kw = dict(prompt_lookup_num_tokens=8, max_new_tokens=80, min_new_tokens=80, do_sample=False)
    ref = model.generate(ids, cache=DynamicCache(config=model.config), **kw)
    enable(model)
    cache = _small_cache(model, resident_fraction=0.3, max_tokens=800)
    crops = []
    original = cache.crop
    cache.crop = lambda n: (crops.append(n), original(n))[1]
    out = model.generate(ids, cache=cache, **kw)
    assert torch.equal(out, ref)
    assert crops, "prompt lookup never cropped the cache; the test did not exercise crop"


def test_model_forward_loop_matches_dynamic_cache():
    model = _llama()
    ids = _prompt(length=130)
    ref_cache = DynamicCache(config=model.config)
    ref_logits = model(ids, cache=ref_cache).logits
    enable(model)
    cache = kvstrata.integrations.hf.cache.TieredCache(model.config, block_size=16, max_tokens=512)
    logits = model(ids, cache=cache).logits
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert cache.get_seq_length() == 130


def test_peak_device_bytes_bounded_by_budget_plus_staging():
    model = tiny_model("llama", "sdpa", num_hidden_layers=1)
    enable(model)
    peaks = {}
    for context in (4096, 16384 - 64):
        cache = TieredCache(
            model.config,
            block_size=64,
            max_tokens=16384,
            resident_fraction=0.1,
            host_budget="64MiB",
            staging_tokens=512,
        )
        ids = _prompt(length=context)
        _greedy(model, ids, cache, n=64)
        stats = cache.stats()
        assert cache.get_seq_length() == context + 64 - 1 or cache.get_seq_length() == context + 64
        assert stats["peak_device_bytes"] <= stats["device_budget_bytes"] + stats["staging_bytes"]
        # and the tensors really allocated on the device are no bigger than that
        arenas = cache.manager.state.tiers["device"].arenas.values()
        allocated = sum(t.numel() * t.element_size() for t in arenas)
        assert allocated == stats["device_budget_bytes"]
        peaks[context] = stats["peak_device_bytes"]
    assert peaks[4096] == peaks[16384 - 64], peaks  # does not grow with context


def test_unsupported_model_fails_at_construction():
    from transformers import T5Config

    with pytest.raises(kvstrata.UnsupportedModelError, match="t5"):
        TieredCache(T5Config())
    model = tiny_model("llama", "sdpa")
    cfg = model.config
    cfg.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(kvstrata.UnsupportedModelError, match="linear_attention"):
        TieredCache(cfg)


def test_attention_without_tiered_cache_is_a_clear_error():
    model = _llama()
    enable(model)
    with pytest.raises(kvstrata.UnsupportedModelError, match="TieredCache"):
        model(_prompt(length=8), cache=DynamicCache(config=model.config))


def _greedy_loop(model, ids, cache, n, on_step=None):
    """Plain greedy decoding with model(...) in a loop (no logits processors)."""
    tokens = ids
    with torch.no_grad():
        logits = model(tokens, cache=cache).logits[:, -1]
        for step in range(n):
            nxt = logits.argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, nxt], dim=1)
            if on_step is not None:
                on_step(step)
            logits = model(nxt, cache=cache).logits[:, -1]
    return tokens


def test_budget_change_mid_generation_keeps_tokens():
    """The dynamic offload ratio: shrink the device budget halfway, blocks move to
    the host, and decoding goes on with the same tokens."""
    model = _llama()
    ids = _prompt(length=300)
    ref = _greedy_loop(model, ids, DynamicCache(config=model.config), 80)
    enable(model)
    cache = _small_cache(model)
    seen = {}

    def shrink(step):
        if step == 40:
            seen["before"] = cache.stats()["tiers"]["host"]["used_blocks"]
            cache.set_budget("device", 8 * cache.stats()["tiers"]["device"]["block_bytes"])
            seen["after"] = cache.stats()["tiers"]

    tokens = _greedy_loop(model, ids, cache, 80, on_step=shrink)
    assert seen["before"] == 0 and seen["after"]["host"]["used_blocks"] > 0
    assert seen["after"]["device"]["used_blocks"] <= 8
    assert torch.equal(tokens, ref)


def test_staged_path_under_inference_mode():
    """Cold chunks load on a transfer thread; it must honour inference mode."""
    model = _llama()
    ids = _prompt(length=300)
    with torch.inference_mode():
        ref = model(ids, cache=DynamicCache(config=model.config)).logits
    enable(model)
    cache = _small_cache(model, resident_fraction=0.1, cold_attention="stage")
    with torch.inference_mode():
        model(ids[:, :-1], cache=cache)
        last = model(ids[:, -1:], cache=cache).logits
    torch.testing.assert_close(last[:, -1], ref[:, -1], rtol=1e-4, atol=1e-4)
    assert cache.stats()["transfers"]["num_transfers"] > 0


def test_windowed_prefill_over_many_staged_chunks():
    """A second prefill chunk of a sliding-window model gathers its history from
    the host through tiny staging buffers (many chunks, buffers reused)."""
    model = tiny_model("mistral", "sdpa")
    ids = _prompt(length=400)
    with torch.no_grad():
        ref = model(ids, cache=DynamicCache(config=model.config)).logits
    enable(model)
    cache = _small_cache(model, resident_fraction=0.1, cold_attention="stage", staging_tokens=32)
    with torch.no_grad():
        first = model(ids[:, :300], cache=cache).logits
        second = model(ids[:, 300:], cache=cache).logits
    torch.testing.assert_close(torch.cat([first, second], 1), ref, rtol=1e-4, atol=1e-4)
    assert cache.stats()["transfers"]["num_transfers"] >= 4
