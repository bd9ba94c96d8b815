"""A lean forward for the engine's packed steps on the Llama family of decoders.

transformers' forward is general: every call goes through the output-capturing and
kwarg-merging decorators, builds a mask, and every one of a layer's ~12 modules
through `Module.__call__` (hooks, forward-pre-hooks, the attention interface lookup).
For a decode step that is a fixed cost per layer that small models pay many times
over their arithmetic (most of a step on the embedded 4-layer model:
docs/MEASUREMENTS.md).

`lean_forward(model)` returns a `LeanForward` for the families whose layer is
exactly "norm → q/k/v → RoPE → attention → o → residual → norm → gate·up → down →
residual" (Llama, Mistral, Qwen2, Qwen3), else None (the engine keeps transformers'
forward, which stays the reference). It calls the model's own modules' `forward`
(the same weights, norms, rotary embedding and activation, the projections the
native decode kernel may take) in the same order with the same operations, so its
logits equal those of transformers' forward through the same `StepCache` bit for bit
(tests compare them). What it leaves out is the per-call machinery only; on decode-sized
inputs RoPE and the RMSNorms take one native call each that gives the same bits
(hf.lean_ops, adopted per model only where a probe shows it does).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from kvstrata.integrations.hf.lean_ops import native_norm, native_rope

# model_type -> (decoder layer class, whether the config's sliding_window applies to
# every layer (Mistral) rather than the per-layer attribute of Qwen2 / Qwen3)
FAMILIES: dict[str, tuple[str, bool]] = {
    "llama": ("LlamaDecoderLayer", False),
    "mistral": ("MistralDecoderLayer", True),
    "qwen2": ("Qwen2DecoderLayer", False),
    "qwen3": ("Qwen3DecoderLayer", False),
}


@dataclass
class _Layer:
    """One decoder layer's callables (bound `forward`s: no `Module.__call__`)."""

    norm1: Any
    q: Any
    k: Any
    v: Any
    q_norm: Any
    k_norm: Any
    o: Any
    norm2: Any
    gate: Any
    up: Any
    down: Any
    act: Any
    head_dim: int
    scaling: float
    window: int | None


class LeanForward:
    """The packed-step forward of a supported model (see `lean_forward`)."""

    def __init__(self, model: Any, layers: list[_Layer], rope: Any) -> None:
        inner = model.model
        self.embed = inner.embed_tokens.forward
        self.rotary = inner.rotary_emb.forward
        self.norm = native_norm(inner.norm)
        self.lm_head = model.lm_head.forward
        self.layers = layers
        self.rope = rope

    def __call__(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: Any, rows: torch.Tensor
    ) -> torch.Tensor:
        """Logits [1, len(rows), vocab] of the packed row's tokens at `rows`."""
        h = self.embed(input_ids)
        cos, sin = self.rotary(h, position_ids)
        total = h.shape[1]
        rope = self.rope
        for i, layer in enumerate(self.layers):
            x = layer.norm1(h)
            shape = (1, total, -1, layer.head_dim)
            q = layer.q(x).view(shape)
            k = layer.k(x).view(shape)
            if layer.q_norm is not None:
                q, k = layer.q_norm(q), layer.k_norm(k)
            q, k = rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            v = layer.v(x).view(shape).transpose(1, 2)
            kv, _ = cache.update(k, v, i)
            o, _ = kv.kvstrata_attend(i, q, layer.scaling, layer.window, None, None)
            h = h + layer.o(o.reshape(1, total, -1).contiguous())
            x = layer.norm2(h)
            h = h + layer.down(layer.act(layer.gate(x)) * layer.up(x))
        return self.lm_head(self.norm(h[:, rows, :]))


def lean_forward(model: Any) -> LeanForward | None:
    """A `LeanForward` over `model` when its family and modules are the known ones
    (nothing hooked, plain `nn.Linear` projections), else None."""
    config = model.config
    family = FAMILIES.get(getattr(config, "model_type", None))
    inner = getattr(model, "model", None)
    if family is None or inner is None or getattr(config, "final_logit_softcapping", None):
        return None
    layer_class, config_window = family
    decoders = list(inner.layers)[: config.num_hidden_layers]
    if not decoders or any(type(d).__name__ != layer_class for d in decoders):
        return None
    if _hooked(model):
        return None
    rope = getattr(sys.modules[type(decoders[0]).__module__], "apply_rotary_pos_emb", None)
    if rope is None:
        return None
    layers = []
    rope = native_rope(rope, decoders[0].self_attn.head_dim)
    for d in decoders:
        attn, mlp = d.self_attn, d.mlp
        linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)
        linears += (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        if any(type(m) is not torch.nn.Linear for m in linears):
            return None
        window = getattr(config if config_window else attn, "sliding_window", None)
        q_norm = getattr(attn, "q_norm", None)
        layers.append(
            _Layer(
                native_norm(d.input_layernorm),
                attn.q_proj.forward,
                attn.k_proj.forward,
                attn.v_proj.forward,
                None if q_norm is None else native_norm(q_norm),
                None if q_norm is None else native_norm(attn.k_norm),
                attn.o_proj.forward,
                native_norm(d.post_attention_layernorm),
                mlp.gate_proj.forward,
                mlp.up_proj.forward,
                mlp.down_proj.forward,
                getattr(mlp.act_fn, "forward", mlp.act_fn),
                attn.head_dim,
                attn.scaling,
                window,
            )
        )
    return LeanForward(model, layers, rope)


def _hooked(model: torch.nn.Module) -> bool:
    """Whether any module below the top one has hooks (accelerate's offload, a user's
    probe) or a `forward` of its own (a patched layer; a projection's own `forward`,
    e.g. the native decode path, is the one called): the lean forward would skip them,
    so the model keeps transformers'."""
    for module in model.modules():
        if module is model:
            continue
        if module._forward_hooks or module._forward_pre_hooks or hasattr(module, "_hf_hook"):
            return True
        if "forward" in vars(module) and type(module) is not torch.nn.Linear:
            return True
    return bool(torch.nn.modules.module._global_forward_hooks) or bool(
        torch.nn.modules.module._global_forward_pre_hooks
    )
