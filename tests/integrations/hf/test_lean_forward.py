"""The engine's lean forward (integrations.hf.lean) against transformers' forward."""

from __future__ import annotations

import pytest
import torch

from hf_models import tiny_model
from kvstrata.engine import Engine, EngineConfig, SamplingParams
from kvstrata.integrations.hf.lean import lean_forward


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_lean_forward_gives_transformers_logits_bit_for_bit(family, one_thread):
    """Through the same packed steps — prefill chunks beside decodes, sliding windows
    (Mistral, Qwen2), q/k norms (Qwen3), biases (Qwen2), preemption to the host tier —
    the same tokens, sampled logprobs and prompt logprobs, bit for bit."""
    model = tiny_model(family, attention_bias=family == "llama")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (70, 23, 41, 9)]
    params = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=5, prompt_logprobs=2)
    outs = {}
    for lean in (True, False):
        config = EngineConfig(max_batched_tokens=32, lean_forward=lean)
        with Engine(model, block_size=16, host_budget="1MiB", config=config) as engine:
            assert (engine.runner.lean is not None) == lean
            outs[lean] = engine.generate(prompts, [params] * len(prompts))
    moved = outs[True][0].logprobs[0].logprob != outs[True][1].logprobs[0].logprob
    assert moved  # (the logprobs compared below are not all one value)
    for a, b in zip(outs[True], outs[False], strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs and a.prompt_logprobs == b.prompt_logprobs


def test_other_families_and_hooked_models_keep_transformers_forward():
    assert lean_forward(tiny_model("phi3")) is None  # fused qkv: not the Llama layer
    assert lean_forward(tiny_model("gemma2", attn="eager")) is None
    model = tiny_model("llama")
    assert lean_forward(model) is not None
    handle = model.model.layers[1].mlp.register_forward_hook(lambda *a: None)
    assert lean_forward(model) is None  # a hook the lean forward would skip
    handle.remove()
    assert lean_forward(model) is not None


def test_lean_forward_is_a_checked_engine_field():
    from kvstrata.core.errors import ConfigError

    with pytest.raises(ConfigError, match="lean_forward"):
        EngineConfig(lean_forward="yes")


def test_a_failed_lean_step_ends_its_requests_and_the_engine_goes_on(one_thread):
    model = tiny_model("llama")
    proj = model.model.layers[1].mlp.down_proj
    calls = {"n": 0}
    original = proj.forward

    def flaky(x):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected fault")
        return original(x)

    proj.forward = flaky  # a projection's own forward is the one the lean forward calls
    prompt = torch.randint(3, 97, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    with Engine(model, block_size=16) as engine:
        assert engine.runner.lean is not None
        failed = engine.generate([prompt], params)[0]
        assert failed.finish_reason == "abort" and "injected fault" in failed.error
        assert engine.stats()["live_blocks"] == 0
        ok = engine.generate([prompt], params)[0]
    del proj.forward
    with Engine(model, block_size=16, config=EngineConfig(lean_forward=False)) as engine:
        assert ok.token_ids == engine.generate([prompt], params)[0].token_ids


def test_a_layer_with_a_patched_forward_keeps_transformers_forward():
    model = tiny_model("llama")
    mlp = model.model.layers[0].mlp
    mlp.forward = mlp.forward  # e.g. a user's instrumentation: the lean forward skips it
    assert lean_forward(model) is None
