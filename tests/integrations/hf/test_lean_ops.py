"""The lean forward's native RoPE and RMSNorm (integrations.hf.lean_ops): the model's own
bits, taken only where the probe shows them, and the model's function elsewhere."""

from __future__ import annotations

import sys

import pytest
import torch

from hf_models import tiny_model
from kvstrata.integrations.hf import lean_ops
from kvstrata.integrations.hf.lean import lean_forward
from kvstrata.platform import native

pytestmark = pytest.mark.skipif(not native.available(), reason="needs the native kernels")


def _rope_of(model):
    layer = model.model.layers[0]
    return sys.modules[type(layer).__module__].apply_rotary_pos_emb


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_rope_and_norms_give_the_models_bits(family):
    model = tiny_model(family)
    lean = lean_forward(model)
    assert isinstance(lean.rope, lean_ops.NativeRope)
    assert isinstance(lean.layers[0].norm1, lean_ops.NativeRMSNorm)
    assert isinstance(lean.norm, lean_ops.NativeRMSNorm)
    if family == "qwen3":
        assert isinstance(lean.layers[0].q_norm, lean_ops.NativeRMSNorm)
    cfg = model.config
    hq, hk = cfg.num_attention_heads, cfg.num_key_value_heads
    dim = model.model.layers[0].self_attn.head_dim
    rope, norm = _rope_of(model), model.model.layers[1].post_attention_layernorm
    gen = torch.Generator().manual_seed(5)
    for tokens in (1, 2, 7, 16):
        pos = torch.arange(1000, 1000 + tokens)[None]
        # the lean forward's layouts: [1, T, H, D] projections viewed as [1, H, T, D]
        q = torch.randn(1, tokens, hq, dim, generator=gen).transpose(1, 2)
        k = torch.randn(1, tokens, hk, dim, generator=gen).transpose(1, 2)
        cos, sin = model.model.rotary_emb(q, pos)
        want, got = rope(q, k, cos, sin), lean.rope(q, k, cos, sin)
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
        h = torch.randn(1, tokens, cfg.hidden_size, generator=gen) * 30
        with torch.inference_mode():
            assert torch.equal(norm(h), lean.layers[1].norm2(h))


def test_what_the_kernels_do_not_take_runs_the_models_function(monkeypatch):
    model = tiny_model("llama")
    lean = lean_forward(model)
    norm = model.model.layers[0].input_layernorm
    calls = []
    monkeypatch.setattr(lean.layers[0].norm1, "forward", lambda h: calls.append(h) or norm(h))
    d = model.config.hidden_size
    lean.layers[0].norm1(torch.randn(1, lean_ops.MAX_ELEMENTS // d + 1, d))  # a prefill chunk
    lean.layers[0].norm1(torch.randn(1, 2, d, dtype=torch.float64))  # another dtype
    lean.layers[0].norm1(torch.randn(1, d, 2).transpose(1, 2))  # not contiguous
    assert len(calls) == 3
    with torch.inference_mode():  # as the engine runs it: the native path
        lean.layers[0].norm1(torch.randn(1, 2, d))
    assert len(calls) == 3
    # autograd: the native path records nothing, so a norm that needs a backward is torch's
    h = torch.randn(1, 1, d, requires_grad=True)
    lean.layers[0].norm1(h).sum().backward()
    assert h.grad is not None and len(calls) == 4


def test_a_variant_the_probe_rejects_keeps_the_models_function():
    class OffsetNorm(torch.nn.Module):  # Gemma-style: (1 + weight), not the Llama norm
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(32))
            self.variance_epsilon = 1e-6

        def forward(self, h):
            var = h.pow(2).mean(-1, keepdim=True)
            return (1 + self.weight) * (h * torch.rsqrt(var + self.variance_epsilon))

    module = OffsetNorm()
    assert lean_ops.native_norm(module) == module.forward

    def partial_rope(q, k, cos, sin):  # rotates only the first half of each head
        r = q.shape[-1] // 2
        out = []
        for x in (q, k):
            rot = (
                x[..., :r] * cos[:, None, :, :r]
                + torch.cat((-x[..., r // 2 : r], x[..., : r // 2]), dim=-1) * sin[:, None, :, :r]
            )
            out.append(torch.cat((rot, x[..., r:]), dim=-1))
        return tuple(out)

    assert lean_ops.native_rope(partial_rope, 16) is partial_rope
