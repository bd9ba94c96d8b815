"""A block's RoPE frame, found from its keys: what `lowrank-pre-*` needs and is not told.

Hugging Face's rotate-half RoPE stores a key at position p as post = s * R(p θ) pre:
each pair of dims (j, j + D/2) of the pre-RoPE key turned by the angle p θ_j, times the
rotary's attention scaling s. Pre-RoPE keys are far closer to a low-rank subspace than
post-RoPE ones (ShadowKV), but un-rotating needs p, and a codec is handed K/V blocks
without their tokens' positions (a demotion, a disk write or a remote put carries slots,
not positions).

A block holds consecutive tokens p0 .. p0 + bs - 1, so only p0 is unknown. Turning each
key back by its offset t leaves R(p0 θ) pre_t / s, whose block mean is R(p0 θ) turned
from the pre-RoPE mean. That mean is large and the same at every position in the
models we calibrate (a few channels carry most of it), so p0 is where the matched filter

    score(p) = Re sum_j z_j conj(mu_j) exp(-i p θ_j)

peaks, z_j and mu_j being pair j of the block's offset-turned mean and of the calibrated
pre-RoPE mean as complex numbers. Evaluated at every p < `positions` (one matrix product
per layer against cos/sin tables); on SmolLM2's held-out text it gives p0 exactly for
nearly every block and close to it for the rest (docs/MEASUREMENTS.md).

The found p0 is a *frame*, not a claim: the codec stores it with the block and decodes
with it, so decoding is the exact inverse of encoding's rotation whatever p0 was found
(a wrong p0 only leaves more of the key outside the subspace — which the codec measures,
and then stores the block in the post-RoPE frame instead). Nothing assumes that positions
equal cache indices: left padding, shifted positions or a prompt cut from a longer one
all work.
"""

from __future__ import annotations

import math

import torch

from kvstrata.core.errors import ConfigError

SCORE_CHUNK = 1 << 24  # score entries (block-heads x positions) per matrix product


class RopeFrame:
    """One model's rotate-half RoPE: per layer the pair frequencies θ [L, D/2] and
    scaling s [L], and the positions [0, `positions`) a block start is searched in."""

    def __init__(self, freq: torch.Tensor, scale: torch.Tensor, positions: int) -> None:
        if freq.dim() != 2 or scale.shape != freq.shape[:1] or positions < 1:
            raise ConfigError.field(
                "codec_calibration", tuple(freq.shape), "a rope frame [layers, head_dim / 2]"
            )
        self.freq = freq.double()
        self.scale = scale.float()
        self.positions = int(positions)
        self._tables: dict[tuple[int, torch.device], torch.Tensor] = {}  # by kind of θ
        self._offsets: dict[tuple[int, torch.device], tuple[torch.Tensor, ...]] = {}
        # layers of equal θ share tables: kind[layer] indexes the distinct θ rows
        self.kinds, self.kind = torch.unique(self.freq, dim=0, return_inverse=True)
        self._freqs: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def half(self) -> int:
        return int(self.freq.shape[1])

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(θ fp64, s fp32) on `device`."""
        hit = self._freqs.get(device)
        if hit is None:
            hit = self._freqs[device] = (self.freq.to(device), self.scale.to(device))
        return hit

    # -- rotation --------------------------------------------------------------------------
    def _offset_turn(self, layer: torch.Tensor, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of t θ for the offsets t < bs: [bs, D/2] when the block-heads' layers
        share one θ (the usual model), else [N, bs, D/2]; the tables are cached."""
        dev = layer.device
        hit = self._offsets.get((bs, dev))
        if hit is None:
            freq = self.kinds.to(dev)  # [C, h]: the distinct θ rows
            ang = torch.arange(bs, dtype=torch.float64, device=dev)[None, :, None] * freq[:, None]
            kind = self.kind.to(dev)
            hit = self._offsets[(bs, dev)] = (torch.cos(ang).float(), torch.sin(ang).float(), kind)
        cos, sin, kind = hit
        if cos.shape[0] == 1:
            return cos[0], sin[0]
        k = kind[layer]
        return cos[k], sin[k]

    def turn(
        self, x: torch.Tensor, start: torch.Tensor, layer: torch.Tensor, inverse: bool
    ) -> torch.Tensor:
        """x [N, bs, D] (fp32) turned by (start + t) θ of its layer, scaled by s — or the
        inverse: turned back and divided by s. start, layer: [N] int64."""
        _, bs, d = x.shape
        h = self.half
        if d != 2 * h:
            raise ConfigError.field(
                "codec_calibration", d, f"keys of head dim {2 * h} (the rope frame's)"
            )
        freq, scale = self._on(x.device)
        base = (start.double()[:, None] * freq[layer]).remainder_(2 * math.pi)  # [N, h]
        s = scale[layer][:, None, None]
        if inverse:
            s = 1.0 / s
        cb, sb = torch.cos(base).float()[:, None] * s, torch.sin(base).float()[:, None] * s
        co, so = self._offset_turn(layer, bs)
        cos = torch.addcmul(cb * co, sb, so, value=-1)  # s cos((start + t) θ), [N, bs, h]
        sin = torch.addcmul(sb * co, cb, so)
        if inverse:
            sin.neg_()
        x1, x2 = x[..., :h], x[..., h:]
        out = torch.empty_like(x)
        lo, hi = out[..., :h], out[..., h:]
        torch.mul(x1, cos, out=lo)
        lo.addcmul_(x2, sin, value=-1)
        torch.mul(x2, cos, out=hi)
        hi.addcmul_(x1, sin)
        return out

    # -- the block's start -----------------------------------------------------------------
    def _table(self, layer: int, device: torch.device) -> torch.Tensor:
        """[positions, D]: cos(p θ) | sin(p θ) of `layer` (shared by layers of equal θ)."""
        key = (int(self.kind[layer]), device)
        hit = self._tables.get(key)
        if hit is None:
            freq = self._on(device)[0][layer]
            p = torch.arange(self.positions, dtype=torch.float64, device=device)[:, None]
            ang = (p * freq).remainder_(2 * math.pi)
            hit = self._tables[key] = torch.cat([torch.cos(ang), torch.sin(ang)], dim=1).float()
        return hit

    def locate(self, x: torch.Tensor, layer: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
        """The start position [N] (int64) of each block x [N, bs, D] of post-RoPE keys:
        the matched filter's peak against the pre-RoPE mean [N, D] of its layer and head."""
        n, bs, _ = x.shape
        h = self.half
        zero = torch.zeros(n, dtype=torch.long, device=x.device)
        z = self.turn(x, zero, layer, inverse=True).mean(1)  # R(p0 θ) mean(pre)
        zx, zy, mx, my = z[:, :h], z[:, h:], mean[:, :h], mean[:, h:]
        # z conj(mu) = a + i b; Re((a + i b) exp(-i p θ)) = a cos(p θ) + b sin(p θ)
        ab = torch.cat([zx * mx + zy * my, zy * mx - zx * my], dim=1)
        out = torch.empty(n, dtype=torch.long, device=x.device)
        step = max(1, SCORE_CHUNK // self.positions)
        for lay in torch.unique(layer).tolist():
            rows = (layer == lay).nonzero().flatten()
            table = self._table(lay, x.device)
            for i in range(0, rows.numel(), step):
                r = rows[i : i + step]
                out[r] = (ab[r] @ table.T).argmax(1)
        return out


def frame_of(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> RopeFrame | None:
    """The calibration's rope frame, or None when the file has none."""
    if "rope_freq" not in tensors:
        return None
    if "rope_scale" not in tensors or not str(meta.get("max_positions", "")).isdigit():
        raise ConfigError.field(
            "codec_calibration", sorted(meta), "a rope frame with rope_scale and max_positions"
        )
    return RopeFrame(tensors["rope_freq"], tensors["rope_scale"], int(meta["max_positions"]))


def frame_from_rotary(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, float] | None:
    """(θ [D/2], s) of a forward's rotary tables cos, sin [T, D] (positions 0..T-1), or
    None when they are not rotate-half RoPE (halves unequal, or fewer than 2 positions).

    θ_j is the mean step of pair j's unwrapped angle over the T positions (the tables
    come in the model's dtype: one step read off bf16 tables would be ~1e-2 rad off,
    the mean over 2k positions ~1e-5), checked by rebuilding the tables from it."""
    eps = torch.finfo(cos.dtype).eps if cos.dtype.is_floating_point else 0.0
    cos, sin = cos.double(), sin.double()
    if cos.dim() != 2 or cos.shape[0] < 2 or cos.shape[1] % 2:
        return None
    h = cos.shape[1] // 2
    if not (torch.equal(cos[:, :h], cos[:, h:]) and torch.equal(sin[:, :h], sin[:, h:])):
        return None
    scale = float(cos[0, 0])
    tol = (1e-3 + 8 * eps) * abs(scale)
    if scale <= 0 or not bool(torch.allclose(cos[0], torch.full_like(cos[0], scale), atol=tol)):
        return None
    angle = torch.atan2(sin[:, :h], cos[:, :h])  # [T, h], wrapped
    step = torch.remainder(angle.diff(dim=0) + math.pi, 2 * math.pi) - math.pi
    freq = step.sum(0) / (cos.shape[0] - 1)  # the unwrapped angle's mean step
    t = torch.arange(cos.shape[0], dtype=torch.float64)[:, None]
    again = scale * torch.cos(t * freq)
    if not bool(torch.allclose(again, cos[:, :h], atol=tol + 1e-3 * abs(scale))):
        return None  # not one frequency per pair (θ >= π, or another rotary)
    return freq, scale
