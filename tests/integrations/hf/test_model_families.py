"""Breadth: more transformers families through TieredCache with most of the KV off the
device (host and disk), against DynamicCache in fp32 — and a one-line refusal for the
kinds of models TieredCache cannot serve.

test_hf_integration runs the main families through every placement; this module runs
one offloaded placement over many more architectures: absolute positions (GPT-2, OPT),
partial rotary and parallel residuals (GPT-NeoX, GPT-J, Phi), multi-query (BigCode),
sliding + global layers (Gemma-3, Cohere-2), mixtures of experts (Mixtral), NoPE layers
(SmolLM3), scaled attention (Granite), and KV shared across layers (Gemma-3n).

Each comparison is checked to mean something first: changing an early prompt token
must move the reference's logits, and the cache's logits must match the reference's far
more closely than that, at every step, besides giving the same greedy tokens.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

import hf_models
import kvstrata
from kvstrata.integrations.hf import TieredCache, enable
from kvstrata.model.geometry import KVGeometry

COMMON = {**hf_models.COMMON, "max_position_embeddings": 1024}
SLIDING = dict(sliding_window=32, layer_types=["sliding_attention", "full_attention"])
FAMILIES = {
    "gpt2": {},
    "gpt_bigcode": {},
    "opt": dict(ffn_dim=128, word_embed_proj_dim=64),
    "gpt_neox": {},
    "gptj": dict(rotary_dim=8),
    "phi": {},
    "gemma": dict(head_dim=16),
    "gemma3_text": dict(head_dim=16, **SLIDING),
    "cohere2": SLIDING,
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "starcoder2": dict(sliding_window=None),
    "olmo2": {},
    "granite": dict(attention_multiplier=0.2, residual_multiplier=0.5),
    "smollm3": dict(no_rope_layers=[1, 0]),
    "gemma3n_text": dict(
        head_dim=16,
        num_hidden_layers=4,
        sliding_window=32,
        layer_types=["sliding_attention", "full_attention"] * 2,
        num_kv_shared_layers=2,
        laurel_rank=8,
        altup_num_inputs=2,
        activation_sparsity_pattern=[0.0] * 4,
        vocab_size_per_layer_input=97,
        hidden_size_per_layer_input=16,
    ),
}
PROMPT, NEW = 200, 24
# 16-token blocks: a tenth resident, 4 blocks on the host, the oldest on disk
OFFLOADED = dict(block_size=16, max_tokens=256, resident_fraction=0.1, disk_budget="4MiB")


# families whose configs have no num_key_value_heads (every head has its K/V)
MHA = ("gpt2", "opt", "gpt_neox", "gptj")


def _model(model_type: str, **extra):
    common = {k: v for k, v in COMMON.items() if model_type not in MHA or "key_value" not in k}
    try:
        config = AutoConfig.for_model(model_type, **{**common, **extra})
    except (KeyError, ValueError) as exc:  # not in this transformers version
        pytest.skip(f"transformers has no {model_type}: {exc}")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def _greedy(model, ids: torch.Tensor, cache) -> tuple[list[int], torch.Tensor]:
    with torch.no_grad():
        out = model.generate(
            ids,
            cache=cache,
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, ids.shape[1] :].tolist(), torch.cat(out.logits)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_offloaded_tokens_and_logits_match_dynamic_cache(model_type, one_thread, tmp_path):
    model = _model(model_type, **FAMILIES[model_type])
    torch.manual_seed(1)
    ids = torch.randint(3, 97, (1, PROMPT))
    ref_tokens, ref_logits = _greedy(model, ids, DynamicCache(config=model.config))
    changed = ids.clone()
    changed[0, 3] = 3 + (int(changed[0, 3]) + 10) % 94
    _, moved_logits = _greedy(model, changed, DynamicCache(config=model.config))
    moved = float((moved_logits[0] - ref_logits[0]).abs().max())
    assert moved > 1e-3, f"{model_type}: the reference does not depend on old context"

    enable(model)
    block = KVGeometry.from_hf_config(model.config).to_layout(16).raw_block_bytes
    host = 4 * block // len(set(getattr(model.config, "layer_types", None) or [0]))
    with TieredCache(model.config, disk_dir=str(tmp_path), host_budget=host, **OFFLOADED) as cache:
        tokens, logits = _greedy(model, ids, cache)
        stats = cache.stats()
    used = {tier: stats["tiers"][tier]["used_blocks"] for tier in ("device", "host", "disk")}
    assert used["host"] > 0 and used["disk"] > 0, used  # most of the KV really is offloaded
    assert tokens == ref_tokens
    error = float((logits - ref_logits).abs().max())
    assert error < 1e-4 and error < moved / 100, (error, moved)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_key_selection_on_every_family(model_type, one_thread, tmp_path):
    """Query-aware selection (attention_budget, lossy) with most of the KV off the
    device: a budget that covers the context gives DynamicCache's tokens exactly and
    never selects; a small one selects at least as often as there are decode steps (a
    sliding layer's window may be within it) and attends only its share, with finite
    logits."""
    model = _model(model_type, **FAMILIES[model_type])
    torch.manual_seed(1)
    ids = torch.randint(3, 97, (1, PROMPT))
    ref_tokens, _ = _greedy(model, ids, DynamicCache(config=model.config))
    enable(model)
    with TieredCache(model.config, block_size=16, max_tokens=256) as cache:
        _greedy(model, ids[:, :20], cache)
        assert cache.stats()["selection"] is None  # no budget: nothing selects
    for budget in (PROMPT + NEW, 48):
        with TieredCache(
            model.config, disk_dir=str(tmp_path / str(budget)), host_budget="64KiB",
            attention_budget=budget, attention_page=4, **OFFLOADED,
        ) as cache:  # fmt: skip
            tokens, logits = _greedy(model, ids, cache)
            stats = cache.stats()["selection"]
        if budget > 48:
            assert tokens == ref_tokens and stats["layers"] == 0
        else:
            assert stats["layers"] >= NEW - 1, stats  # NEW - 1 decode steps
            assert 0 < stats["attended_share"] <= 0.25, stats
            assert bool(torch.isfinite(logits).all())


def test_mla_model_is_refused_at_construction():
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(**{**COMMON, "kv_lora_rank": 32, "qk_rope_head_dim": 8})
    with pytest.raises(kvstrata.UnsupportedModelError, match="deepseek_v3.*MLA latent"):
        TieredCache(config)


def test_per_layer_head_dims_are_refused_at_construction():
    config = AutoConfig.for_model(
        "gemma4_text", **{**COMMON, "head_dim": 16, "per_layer_config": {"1": {"head_dim": 32}}}
    )
    with pytest.raises(kvstrata.UnsupportedModelError, match="layer 1 has head_dim=32"):
        TieredCache(config)


def test_layer_with_another_kv_shape_is_refused_at_its_first_write():
    model = _model("llama")
    cache = TieredCache(model.config, block_size=16, max_tokens=64)
    k, v = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    cache.update(k, v, 0)
    with pytest.raises(kvstrata.UnsupportedModelError, match="layer 1 gives K/V"):
        cache.update(k, v[..., :8], 1)  # values of another width than layer 0's
    assert cache.get_seq_length() == 0  # the step was undone
    with pytest.raises(kvstrata.UnsupportedModelError, match="keys of shape"):
        cache.update(k, v[:, :1], 0)  # fewer value heads than key heads
    cache.close()


def test_model_code_using_cached_kv_as_tensors_gets_one_line_error():
    """JetMoE repeats the cached keys itself (key.repeat) before its attention call."""
    model = _model("jetmoe", num_local_experts=4, num_experts_per_tok=2, kv_channels=16)
    enable(model)
    cache = TieredCache(model.config, block_size=16, max_tokens=64)
    with pytest.raises(kvstrata.UnsupportedModelError, match="jetmoe.*as tensors") as info:
        model(torch.arange(3, 20)[None], cache=cache)
    assert cache.get_seq_length() == 0  # the failed step was undone
    cache.close()
    assert "\n" not in str(info.value)
    assert isinstance(info.value, AttributeError)  # getattr(key, name, default) still works
    # the handle inside a list (torch.cat) is named too; the error pickles
    import pickle

    from kvstrata.integrations.hf.layers import TieredKV

    handle = TieredKV(cache, 0, torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16))
    with pytest.raises(kvstrata.UnsupportedModelError, match=r"torch\.cat\(key_states"):
        torch.cat([handle.new_k, handle], dim=2)
    again = pickle.loads(pickle.dumps(info.value))
    assert str(again) == str(info.value)


def _argmax_tokens(model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens with a DynamicCache, end-of-sequence included (the engine runs
    with ignore_eos; generate's min_new_tokens would instead forbid it)."""
    cache, ids, out = DynamicCache(config=model.config), torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(n):
            token = int(model(ids, cache=cache).logits[0, -1].argmax())
            out.append(token)
            ids = torch.tensor([[token]])
    return out


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_engine_packed_steps_match_dynamic_cache(model_type, one_thread):
    """The engine packs every running sequence into one row with per-token positions:
    every family, absolute position embeddings (GPT-2, OPT) and shared-K/V layers
    (Gemma-3n) included."""
    from kvstrata.engine import Engine, EngineConfig, SamplingParams

    model = _model(model_type, **FAMILIES[model_type])
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (70, 23, 41)]
    refs = [_argmax_tokens(model, p, 12) for p in prompts]
    config = EngineConfig(max_batched_tokens=32, preemption="off")
    with Engine(model, block_size=16, host_budget="1MiB", config=config) as engine:
        outs = engine.generate(prompts, [SamplingParams(max_tokens=12, ignore_eos=True)] * 3)
    assert [o.token_ids for o in outs] == refs


def test_a_failure_in_a_layer_that_reuses_kv_undoes_the_whole_step():
    """Gemma-3n's last layers attend with earlier layers' K/V: the step ends after the
    model's last attention layer (also read through a multimodal wrapper config), so a
    failure there still undoes it."""
    from transformers import Gemma3nConfig

    from kvstrata.attention.runtime import AttentionRuntime
    from kvstrata.store.kvstore import KVStore

    model = _model("gemma3n_text", **FAMILIES["gemma3n_text"])
    wrapper = Gemma3nConfig(text_config=model.config.to_dict())
    geometry = KVGeometry.from_hf_config(wrapper)
    assert (geometry.num_layers, geometry.attention_layers) == (2, 4)
    torch.manual_seed(3)
    ids = torch.randint(3, 97, (1, 40))
    with torch.no_grad():
        ref = DynamicCache(config=model.config)
        model(ids, cache=ref)
        want = model(ids[:, -1:], cache=ref).logits
    enable(model)
    attn = model.model.layers[3].self_attn  # reuses layer 1's K/V
    assert attn.is_kv_shared_layer

    def boom(*args, **kwargs):
        raise RuntimeError("injected failure in a shared-K/V layer")

    events = []
    real_attend, real_done = AttentionRuntime.attend, KVStore.step_done

    def attend(self, layer, *args, **kwargs):
        events.append("attend")
        return real_attend(self, layer, *args, **kwargs)

    def step_done(self, *args, **kwargs):
        events.append("done")
        return real_done(self, *args, **kwargs)

    with TieredCache(model.config, block_size=16, max_tokens=128) as cache, torch.no_grad():
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(AttentionRuntime, "attend", attend)
            mp.setattr(KVStore, "step_done", step_done)
            model(ids, cache=cache)
        assert events == ["attend"] * 4 + ["done"]  # after all four layers, not two
        real, attn.o_proj.forward = attn.o_proj.forward, boom
        with pytest.raises(RuntimeError, match="injected"):
            model(ids[:, -1:], cache=cache)
        attn.o_proj.forward = real
        assert cache.get_seq_length() == 40  # undone
        got = model(ids[:, -1:], cache=cache).logits
    assert torch.allclose(got, want, atol=1e-4)
