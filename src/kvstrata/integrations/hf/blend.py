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
most ("high-KV-deviation" tokens); every other token keeps its reused K/V. Here the
tokens recomputed are instead the ones the question (the tokens after the last document)
reads most over every layer, found by a probe of the question's rows alone over the
reused K/V (`Blender._select`); deviation chooses only when no question follows. The tokens
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
SELECT_LAYER = 1  # chosen here: its K/V are still exact; later layers blend
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
        run = _Run(pos, cos, sin, start, prefix_k, prefix_v)
        # (a model of SELECT_LAYER layers or fewer has nothing to blend: all computed)
        selecting = reuse is not None and recompute < 1 and len(self.layers) > SELECT_LAYER
        every = SELECT_LAYER if selecting else len(self.layers)
        ks: list[torch.Tensor] = []
        vs: list[torch.Tensor] = []
        for i in range(every):  # every token (before the selection layer, or all of them)
            q, k, v = self._qkv(i, h, run, None)
            ks.append(k)
            vs.append(v)
            if i < len(self.layers) - 1:  # the last layer's output feeds no K/V
                h = self._mix(i, h, q, k, v, run, None)
        recomputed = torch.ones(total, dtype=torch.bool, device=dev)
        if selecting:
            assert reuse is not None
            # the selection layer's input is exact for every token, so are its K/V
            q, k, v = self._qkv(SELECT_LAYER, h, run, None)
            rows = self._select(h, q, k, v, reuse, recompute, run)
            tail = self._rows_pass(h[:, rows], q[:, :, rows], k, v, rows, reuse, run)
            ks += tail.k
            vs += tail.v
            recomputed[:] = False
            recomputed[rows] = True
        return Blended(torch.stack(ks), torch.stack(vs), recomputed)

    def _qkv(
        self, i: int, h: torch.Tensor, run: _Run, rows: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer i's queries [1, Hq, n, D] and keys / values [Hkv, n, D] of the rows
        whose inputs are h [1, n, hidden] (`rows` of the T tokens; None: all)."""
        layer = self.layers[i]
        x = layer.norm1(h)
        shape = (1, x.shape[1], -1, layer.head_dim)
        q = layer.q(x).view(shape)
        k = layer.k(x).view(shape)
        if layer.q_norm is not None:
            q, k = layer.q_norm(q), layer.k_norm(k)
        c, s = (run.cos, run.sin) if rows is None else (run.cos[:, rows], run.sin[:, rows])
        q, k = self.rope(q.transpose(1, 2), k.transpose(1, 2), c, s)
        v = layer.v(x).view(shape).transpose(1, 2)
        return q, k[0], v[0]

    def _mix(
        self,
        i: int,
        h: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        run: _Run,
        rows: torch.Tensor | None,
    ) -> torch.Tensor:
        """Layer i's output for the rows: their queries over the prefix and every
        token's keys / values `k`, `v` [Hkv, T, D], then the MLP."""
        keys, values = run.with_prefix(i, k, v)
        q_pos = run.pos if rows is None else run.pos[rows]
        return self._finish(i, h, _attend(q, keys, values, q_pos, self.layers[i].scaling))

    def _finish(self, i: int, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Layer i's output for rows h [1, n, hidden] from their attention o [1, Hq, n, Dv]."""
        layer = self.layers[i]
        h = h + layer.o(o.transpose(1, 2).reshape(1, o.shape[2], -1))
        x = layer.norm2(h)
        return h + layer.down(layer.act(layer.gate(x)) * layer.up(x))

    def _rows_pass(
        self,
        h: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rows: torch.Tensor,
        reuse: Reuse,
        run: _Run,
        probe: bool = False,
    ) -> _Tail:
        """The layers from SELECT_LAYER on over `rows` only (h [1, n, hidden] their
        inputs there, q their queries; k / v that layer's K/V of every token); every
        other token keeps its reused K/V.

        A probe (`rows`: the question's) keeps no K/V: its result is the attention the
        rows give each of the T tokens, summed over the layers (each layer's scaled to
        its largest); the tokens with neither reused K/V nor a row in it (the text
        between documents, a document's last partial block) are hidden from it past
        SELECT_LAYER — a score needs no more."""
        last = len(self.layers) - 1
        tail = _Tail([], [], torch.zeros(len(run.pos), device=h.device) if probe else None)
        if probe:  # what the probe's rows may see: SELECT_LAYER's K/V are every token's
            every = _visible(run.start + len(run.pos), run.pos[rows])
            hide = ~reuse.have
            hide[rows] = False
            partial = every & run.shown(hide)[None, :]
        for i in range(SELECT_LAYER, last + 1):
            if i > SELECT_LAYER:
                q, kr, vr = self._qkv(i, h, run, rows)
                k, v = reuse.k[i].clone(), reuse.v[i].clone()
                k[:, rows], v[:, rows] = kr, vr
            if tail.reads is None:
                tail.k.append(k)
                tail.v.append(v)
                if i < last:
                    h = self._mix(i, h, q, k, v, run, rows)
                continue
            read, o = self._reads(i, q, k, v, run, every if i == SELECT_LAYER else partial)
            tail.reads += read
            if i < last:
                h = self._finish(i, h, o)
        return tail

    def _reads(
        self,
        i: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        run: _Run,
        seen: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's attention of a probe's queries q [1, Hq, m, D] over the keys `seen`
        [m, start + T] bool, computed once for both results: what it gives each of the T
        tokens, summed over heads and queries and scaled to its largest ([T]), and its
        output [1, Hq, m, Dv]."""
        keys, values = run.with_prefix(i, k, v)
        hkv, m = keys.shape[0], q.shape[2]
        qs = q[0].reshape(hkv, -1, q.shape[-1]).float()  # [Hkv, group * m, D]
        score = qs @ keys.float().transpose(1, 2) * self.layers[i].scaling
        score.masked_fill_(~seen.repeat(qs.shape[1] // m, 1)[None], float("-inf"))
        weights = torch.softmax(score, dim=-1)
        o = (weights @ values.float()).reshape(1, -1, m, values.shape[-1]).to(q.dtype)
        read = weights.sum(dim=(0, 1))[run.start :]
        return read / read.max().clamp_min(1e-30), o

    def _select(
        self,
        h: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        reuse: Reuse,
        recompute: float,
        run: _Run,
    ) -> torch.Tensor:
        """The rows recomputed from the selection layer on (sorted indices): every
        token without reused K/V, the sinks, and the `recompute` share of the reused
        ones that score highest.

        A reused token's score is the attention the question (the tokens after the
        last document, at most QUESTION_ROWS of them) gives it, summed over every layer
        — read in a first pass of the question's rows alone over the reused K/V (a
        probe: cheap, a few dozen rows). Recomputing what the question reads brought a
        small model's answers much closer to a full prefill than CacheBlend's value
        deviation at one layer (measured: docs/blend.md). With no question after the
        documents, the score is that deviation at the selection layer (CacheBlend's)."""
        forced = ~reuse.have | reuse.sink
        candidates = int((~forced).sum())
        top = min(candidates, math.ceil(recompute * candidates))
        if top == 0:
            return forced.nonzero().flatten()
        after = int(reuse.have.nonzero().max()) + 1
        question = torch.arange(after, len(reuse.have), device=h.device)[-QUESTION_ROWS:]
        if len(question):
            probe = self._rows_pass(
                h[:, question], q[:, :, question], k, v, question, reuse, run, probe=True
            )
            assert probe.reads is not None
            score = probe.reads
        else:
            score = (v.float() - reuse.v[SELECT_LAYER].float()).pow(2).sum(dim=(0, 2))
        score[forced] = -1.0
        chosen = forced.clone()
        chosen[torch.topk(score, top).indices] = True
        return chosen.nonzero().flatten()


@dataclass
class _Run:
    """One blending forward's positions, rotary tables and exact prefix K/V."""

    pos: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    start: int
    prefix_k: torch.Tensor | None
    prefix_v: torch.Tensor | None

    def shown(self, hide: torch.Tensor) -> torch.Tensor:
        """[start + T] the keys a query may see (all of the prefix's), from `hide` [T]."""
        return torch.cat((torch.ones(self.start, dtype=torch.bool, device=hide.device), ~hide))

    def with_prefix(self, i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Layer i's keys / values of the whole prompt so far: the prefix's, then k, v."""
        if self.prefix_k is None or self.prefix_v is None or self.start == 0:
            return k, v
        return torch.cat((self.prefix_k[i], k), dim=1), torch.cat((self.prefix_v[i], v), dim=1)


@dataclass
class _Tail:
    """A pass over the chosen rows: the K/V of each layer from SELECT_LAYER on, or the
    question's reads of each token (`reads`, a probe)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    reads: torch.Tensor | None


def _visible(keys: int, q_pos: torch.Tensor) -> torch.Tensor:
    """[n, keys] whether a query at `q_pos` sees a key at 0 .. keys - 1: the earlier ones."""
    return torch.arange(keys, device=q_pos.device)[None, :] <= q_pos[:, None]


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scaling: float
) -> torch.Tensor:
    """q [1, Hq, n, D] at positions `q_pos` over k / v [Hkv, S, D] at 0 .. S - 1,
    causally: [1, Hq, n, Dv] — QUERY_ROWS queries at a time (the mask and the scores
    of a long prompt's every query at once would take gigabytes)."""
    out = []
    for lo in range(0, q.shape[2], QUERY_ROWS):
        rows = slice(lo, lo + QUERY_ROWS)
        mask = _visible(k.shape[1], q_pos[rows])
        out.append(
            F.scaled_dot_product_attention(
                q[:, :, rows], k[None], v[None], attn_mask=mask, scale=scaling, enable_gqa=True
            )
        )
    return out[0] if len(out) == 1 else torch.cat(out, dim=2)
