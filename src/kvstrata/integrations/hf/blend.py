"""Blending: a prompt's KV built from documents' KV computed elsewhere (CacheBlend).

A document's KV computed in another prompt (`hf.blend_store` keeps the KV it gets right
after the prompt's head) differs from the KV the same tokens get here in two ways.
Their position: keys carry RoPE, a rotation by the token's position, so moving a key
from position p to p + d is one more rotation by d (exact, to rounding: `move_keys`).
And their context: from the second layer on, a token's K/V depend on the tokens before
it, which the document alone did not see.
CacheBlend (Yao et al., EuroSys '25, arXiv:2405.16444) repairs the second for a few
tokens only: it runs the first layer over every token (its output, the second layer's
input, is then exact), compares the second layer's values computed from it with the
reused ones, and recomputes through the remaining layers the r % of tokens that deviate
most ("high-KV-deviation" tokens; here the score also counts the attention the question
gives a token, `_choose`); every other token keeps its reused K/V. The tokens
of the prompt that no document covers (the question, the text between documents) and
each document's first tokens (its attention sinks when it was computed alone) are
always recomputed.

`Blender.blend` does this over dense tensors with the model's own modules (the lean
families of `hf.lean`: Llama, Mistral, Qwen2, Qwen3); its callers read the reused K/V
from the store and write the blended K/V back (`hf.blend_store`). With every token
recomputed (r = 1) it is a full prefill: the same K/V to rounding.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvstrata.core.errors import UnsupportedModelError
from kvstrata.integrations.hf.lean import lean_forward

SINK_TOKENS = 4  # a document's first tokens: always recomputed
QUERY_ROWS = 512  # queries attended at once
SELECT_LAYER = 1  # the layer whose value deviation chooses the recomputed tokens
QUESTION_ROWS = 256  # the question's last tokens whose attention scores a token
# RoPE kinds whose angle is not position x a fixed frequency (it changes with the
# length), so a key cannot be moved by one rotation
UNMOVABLE_ROPE = ("dynamic", "longrope")


@dataclass
class Reuse:
    """K/V reused for the tokens [start, start + T) of a prompt: `k`, `v` per layer
    [L, Hkv, T, D] (already at their positions in the prompt), `have` [T] whether a
    token has reused K/V at all, `sink` [T] whether it must be recomputed anyway."""

    k: torch.Tensor
    v: torch.Tensor
    have: torch.Tensor
    sink: torch.Tensor


@dataclass
class Blended:
    """The K/V of tokens [start, start + T) for every layer ([L, Hkv, T, D]) and which
    of them were recomputed past the selection layer."""

    k: torch.Tensor
    v: torch.Tensor
    recomputed: torch.Tensor  # [T] bool


class Blender:
    """The blending forward of one model (see the module docstring).

    Raises UnsupportedModelError for a model outside the lean families (no rotary
    position embedding of the rotate-half kind it knows how to move)."""

    def __init__(self, model: torch.nn.Module) -> None:
        config = model.config
        lean = lean_forward(model)
        if lean is None:
            raise UnsupportedModelError(
                f"model_type={getattr(config, 'model_type', '?')!r}: blending needs a "
                "Llama-family decoder with rotary positions (llama, mistral, qwen2, qwen3) "
                "and no hooks on its modules; send the prompt without documents"
            )
        self.model_type = config.model_type
        rope_type = getattr(model.model.rotary_emb, "rope_type", "default")
        if rope_type in UNMOVABLE_ROPE:
            raise UnsupportedModelError(
                f"model_type={self.model_type!r}: rope_type={rope_type!r} turns a key by an "
                "angle that depends on the sequence's length, so a document's keys cannot be "
                "moved; send the prompt without documents"
            )
        self.lean = lean
        self.layers = lean.layers
        self.embed, self.rotary, self.rope = lean.embed, lean.rotary, lean.rope
        decoder = type(model.model.layers[0])
        self.rotate_half = sys.modules[decoder.__module__].rotate_half
        # rotary's cos / sin carry this factor (1 for plain RoPE): a move is one rotation
        self.rope_scale = float(getattr(model.model.rotary_emb, "attention_scaling", 1.0))
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype

    def check_window(self, length: int) -> None:
        """Sliding-window layers narrower than the prompt would need the window's own
        masking in every blended layer: refused in one line."""
        windows = {lay.window for lay in self.layers if lay.window is not None}
        if windows and min(windows) < length:
            raise UnsupportedModelError(
                f"model_type={self.model_type!r}: sliding-window layers of {min(windows)} "
                f"tokens are narrower than this prompt of {length}: blending attends over "
                "the whole prompt; send it without documents"
            )

    # -- moving keys -----------------------------------------------------------------------------
    def move_keys(self, k: torch.Tensor, delta: int) -> torch.Tensor:
        """Keys [..., T, D] computed at positions p moved to p + `delta` (rotated by
        delta; values need nothing)."""
        if delta == 0:
            return k
        pos = torch.tensor([[delta]], device=k.device)
        probe = torch.empty(1, 1, k.shape[-1], device=k.device, dtype=torch.float32)
        cos, sin = self.rotary(probe, pos)  # [1, 1, D]
        cos = (cos[0] / self.rope_scale).to(k.dtype)
        sin = (sin[0] / self.rope_scale).to(k.dtype)
        return k * cos + self.rotate_half(k) * sin

    # -- the blending forward ----------------------------------------------------------------------
    @torch.inference_mode()
    def blend(
        self,
        ids: list[int],
        start: int,
        prefix_k: torch.Tensor | None = None,
        prefix_v: torch.Tensor | None = None,
        reuse: Reuse | None = None,
        recompute: float = 1.0,
    ) -> Blended:
        """K/V of `ids` at positions start .. start + T - 1 for every layer.

        Args:
            prefix_k, prefix_v: the exact K/V of positions 0 .. start - 1 ([L, Hkv,
                start, D]; None when start is 0).
            reuse: reused K/V for `ids` (None: every token computed, a full prefill).
            recompute: fraction of the reused tokens recomputed (1: all of them).
        """
        dev = self.device
        total = len(ids)
        pos = torch.arange(start, start + total, device=dev)
        h = self.embed(torch.tensor(ids, device=dev)[None])
        cos, sin = self.rotary(h, pos[None])
        rows = None  # the rows still computed ([n] indices into the T tokens); None: all
        ks: list[torch.Tensor] = []
        vs: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            x = layer.norm1(h)
            n = x.shape[1]
            shape = (1, n, -1, layer.head_dim)
            q = layer.q(x).view(shape)
            k = layer.k(x).view(shape)
            if layer.q_norm is not None:
                q, k = layer.q_norm(q), layer.k_norm(k)
            c, s = (cos, sin) if rows is None else (cos[:, rows], sin[:, rows])
            q, k = self.rope(q.transpose(1, 2), k.transpose(1, 2), c, s)
            v = layer.v(x).view(shape).transpose(1, 2)
            if rows is None:
                full_k, full_v = k[0], v[0]
                if reuse is not None and i == SELECT_LAYER and recompute < 1:
                    rows = _choose(v[0], q, k[0], reuse, i, recompute)
                    h, q = h[:, rows], q[:, :, rows]
            else:
                assert reuse is not None
                full_k, full_v = reuse.k[i].clone(), reuse.v[i].clone()
                full_k[:, rows], full_v[:, rows] = k[0], v[0]
            ks.append(full_k)
            vs.append(full_v)
            if i == len(self.layers) - 1:
                break  # the last layer's output feeds no K/V
            keys, values = full_k, full_v
            if prefix_k is not None and start > 0:
                keys = torch.cat((prefix_k[i], keys), dim=1)
                values = torch.cat((prefix_v[i], values), dim=1)
            q_pos = pos if rows is None else pos[rows]
            o = _attend(q, keys, values, q_pos, layer.scaling)
            h = h + layer.o(o.transpose(1, 2).reshape(1, q.shape[2], -1))
            x = layer.norm2(h)
            h = h + layer.down(layer.act(layer.gate(x)) * layer.up(x))
        recomputed = torch.ones(total, dtype=torch.bool, device=dev)
        if rows is not None:
            recomputed[:] = False
            recomputed[rows] = True
        return Blended(torch.stack(ks), torch.stack(vs), recomputed)


def _choose(
    v: torch.Tensor, q: torch.Tensor, k: torch.Tensor, reuse: Reuse, layer: int, recompute: float
) -> torch.Tensor:
    """The rows recomputed past the selection layer: every token without reused K/V,
    the sinks, and the `recompute` share of the reused ones that score highest (sorted
    indices). A token's score adds two shares, each scaled to its maximum: how far its
    values at `layer` computed in context are from the reused ones (CacheBlend's
    deviation), and how much attention the tokens after the last document (the
    question) give it at that layer — recomputing what the question reads keeps
    retrieval close to a full prefill (measured in `kvstrata bench blend`)."""
    forced = ~reuse.have | reuse.sink
    score = (v.float() - reuse.v[layer].float()).pow(2).sum(dim=(0, 2))
    score = score / score.max().clamp_min(1e-30)
    after = int(reuse.have.nonzero().max()) + 1 if bool(reuse.have.any()) else len(reuse.have)
    if after < q.shape[2]:  # the question's queries [Hkv, group * n, D] over the keys
        hkv = k.shape[0]
        first = max(after, q.shape[2] - QUESTION_ROWS)
        qs = q[0, :, first:].reshape(hkv, -1, q.shape[-1]).float()
        read = torch.softmax(qs @ k.float().transpose(1, 2) / math.sqrt(q.shape[-1]), dim=-1)
        read = read.sum(dim=(0, 1))
        score = score + read / read.max().clamp_min(1e-30)
    score[forced] = -1.0
    candidates = int((~forced).sum())
    top = min(candidates, math.ceil(recompute * candidates))
    chosen = forced.clone()
    if top > 0:
        chosen[torch.topk(score, top).indices] = True
    return chosen.nonzero().flatten()


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scaling: float
) -> torch.Tensor:
    """q [1, Hq, n, D] at positions `q_pos` over k / v [Hkv, S, D] at 0 .. S - 1,
    causally: [1, Hq, n, Dv] — QUERY_ROWS queries at a time (the mask and the scores
    of a long prompt's every query at once would take gigabytes)."""
    keys = torch.arange(k.shape[1], device=k.device)
    out = []
    for lo in range(0, q.shape[2], QUERY_ROWS):
        rows = slice(lo, lo + QUERY_ROWS)
        mask = keys[None, :] <= q_pos[rows, None]
        out.append(
            F.scaled_dot_product_attention(
                q[:, :, rows], k[None], v[None], attn_mask=mask, scale=scaling, enable_gqa=True
            )
        )
    return out[0] if len(out) == 1 else torch.cat(out, dim=2)
