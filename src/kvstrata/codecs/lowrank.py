"""`lowrank-r<R>[-int8][+<vcodec>]`: keys projected on a calibrated rank-R basis (ShadowKV).

Per layer and KV head, calibration (``kvstrata calibrate``) gives the mean mu and the
principal directions U [D, R] of the model's post-RoPE keys. A key k is stored as its R
coefficients c = U^T (k - mu) and decoded as mu + U c: lossy, the error is the key's
energy outside the subspace. Post-RoPE, because the cache stores post-RoPE keys and no
caller hands a codec the tokens' positions (un-rotating needs them; the pre-RoPE variant
is measured by kvstrata/bench/lowrank_heads.py through the model's k_proj instead).

Stored per block per (layer, kv head), block size bs:

    K: layer [1, 1] int16 (which layer's basis; see codecs/_calibrated.py)
       + coef [bs, R] fp16                         (lowrank-rR: 2R bytes per token)
       or coef [bs, R] uint8 + scale, zero [bs, 1] fp16   (lowrank-rR-int8: R + 4)
    V: the fields of the value codec after '+' (default 'none': the model dtype)

`lowrank-pre-r<R>[-int8][+<vcodec>]` projects *pre*-RoPE keys instead (ShadowKV's frame,
where keys are far closer to low rank): no caller tells a codec positions, so each block's
start is found from its keys (codecs/_rope.py) and stored with it (an int32 per block and
head); decoding turns the projection back with that start, the exact inverse of the
un-rotation. A block whose keys fit the post-RoPE subspace better (a start badly found, a
head with little mean to find it by) is stored in the post-RoPE frame instead, start -1.
It needs a calibration file with the model's RoPE frame (``rope_freq``, written by
``kvstrata calibrate`` for rotate-half RoPE).

e.g. ``CacheConfig(host_codec="lowrank-r32+int8", codec_calibration="smollm2.safetensors")``.
"""

from __future__ import annotations

import re

import torch

from kvstrata.codecs import _reference as ref
from kvstrata.codecs._calibrated import CalibratedCodec, check_finite
from kvstrata.codecs._rope import RopeFrame, frame_of
from kvstrata.codecs.base import Codec
from kvstrata.codecs.calibration import FIELD, FIX, Calibration
from kvstrata.core.errors import CodecError, ConfigError
from kvstrata.core.layout import BlockLayout, FieldSpec

PATTERN = re.compile(r"lowrank(-pre)?-r(\d+)(-int8)?(?:\+(.+))?")
HELP = "lowrank[-pre]-r<R>[-int8][+<value codec>] (R = key rank, e.g. lowrank-r32+int8)"


class LowRankCodec(CalibratedCodec):
    """Keys on a per-(layer, kv head) calibrated basis of rank R; values by `values`."""

    family = "lowrank"

    def __init__(
        self,
        rank: int,
        int8: bool,
        values: Codec,
        calibration: Calibration | None,
        *,
        shared: bool = False,
        search: bool = False,
        pre: bool = False,
    ) -> None:
        vname = "" if values.name == "none" else f"+{values.name}"
        base = f"lowrank{'-pre' if pre else ''}-r{rank}{'-int8' if int8 else ''}{vname}"
        super().__init__(base, calibration)
        if rank < 1:
            raise ConfigError.field("codec", base, "a key rank R >= 1, e.g. lowrank-r32")
        self.rank, self.int8, self.values, self.pre = rank, int8, values, pre
        self._frame_of: RopeFrame | None = None
        self.shared = shared  # one basis per layer for all heads (measured, not registered)
        self.search = search  # always pick the best-fitting layer's basis (measured)
        if calibration is not None and rank >= calibration.head_dim:
            raise ConfigError.field(
                "codec", base, f"a key rank below the head dim {calibration.head_dim}"
            )

    def validate(self, layout: BlockLayout) -> None:
        super().validate(layout)
        self.values.validate(layout)

    def check_calibration(self) -> None:
        if self.pre:
            self.rope()

    def rope(self) -> RopeFrame:
        """The calibration's RoPE frame (`lowrank-pre-*`), or a one-line error."""
        if self._frame_of is None:
            cal = self.cal()
            frame = frame_of(cal.tensors, cal.meta)
            if frame is None:
                raise ConfigError.field(
                    FIELD,
                    cal.path,
                    f"codec {self.base!r} needs the model's RoPE frame, which this file "
                    "lacks (written before it was recorded, or the model's rotary is not "
                    f"rotate-half RoPE); {FIX}, or use lowrank-r{self.rank} (post-RoPE)",
                )
            self._frame_of = frame
        return self._frame_of

    def derive(self, key: str) -> torch.Tensor:
        t = self.cal().tensors
        if key == "basis":  # [L, H, D, R]
            if self.shared:
                return (
                    t["k_layer_basis"][:, None, :, : self.rank]
                    .expand(-1, self.cal().num_kv_heads, -1, -1)
                    .contiguous()
                )
            return t["k_basis"][..., : self.rank].contiguous()
        if key == "mean":  # [L, H, D]
            if self.shared:
                return t["k_layer_mean"][:, None].expand(-1, self.cal().num_kv_heads, -1)
            return t["k_mean"]
        if key == "pre_basis":  # [L, H, D, R] of the pre-RoPE keys
            return t["kpre_basis"][..., : self.rank].contiguous()
        if key == "pre_mean":
            return t["kpre_mean"]
        return t[key]

    def fields(self, kind: str, layout: BlockLayout) -> dict[str, FieldSpec]:
        if kind != "k":
            return self.values.fields(kind, layout)
        bs, r = layout.block_size, self.rank
        if layout.head_dim <= r:
            raise ConfigError.field(
                "codec", self.base, f"a key rank below the head dim {layout.head_dim}"
            )
        out = {"layer": FieldSpec(1, 1, torch.int16)}
        if self.pre:  # the block's start in the pre-RoPE frame, -1 = post-RoPE frame
            out["start"] = FieldSpec(1, 1, torch.int32)
        if self.int8:
            out |= {
                "coef": FieldSpec(bs, r, torch.uint8),
                "scale": FieldSpec(bs, 1, torch.float16),
                "zero": FieldSpec(bs, 1, torch.float16),
            }
        else:
            out["coef"] = FieldSpec(bs, r, torch.float16)
        return out

    def _layers(self, x: torch.Tensor, whole: bool, bs: int) -> torch.Tensor:
        """Layer index per block and head: [G, H, nb] (int64)."""
        g, h, t, _ = x.shape
        if self.hint is not None and not self.search:
            return torch.full((g, h, t // bs), self.hint, dtype=torch.long, device=x.device)
        if whole and not self.search:
            return torch.arange(g, device=x.device)[:, None, None].expand(g, h, t // bs)
        res = self.residuals(x, self.tensor("mean", x.device), self.tensor("basis", x.device), bs)
        return res.argmin(-1)

    def _frame(self, layers: torch.Tensor, device: torch.device):
        """Basis [G, H, nb, D, R] and mean [G, H, nb, D] of each block."""
        heads = torch.arange(layers.shape[1], device=device)[None, :, None]
        return self.tensor("basis", device)[layers, heads], self.tensor("mean", device)[
            layers, heads
        ]

    def encode(self, kind: str, x: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
        if kind != "k":
            self.values.encode(kind, x, out)
            return
        xg, whole = self.runs(kind, x)
        check_finite(xg)
        g, h, t, d = xg.shape
        nb = out["layer"].shape[-2]
        bs = self.blocks_of(t, nb, self.name)
        xf = xg.float()
        layers = self._layers(xf, whole, bs)
        basis, mean = self._frame(layers, xf.device)
        xb = xf.reshape(g, h, nb, bs, d) - mean[:, :, :, None]
        coef = xb @ basis
        if self.pre:
            coef, start = self._encode_pre(xf.reshape(-1, bs, d), layers, xb, coef)
            out["start"].copy_(start.reshape(out["start"].shape))
        coef = coef.reshape(*out["coef"].shape[:-2], t, self.rank)
        out["layer"].copy_(layers.reshape(out["layer"].shape))
        if not self.int8:
            if bool((coef.abs() > 65504).any()):
                raise CodecError(f"codec {self.name!r}: key coefficients exceed fp16 range")
            out["coef"].copy_(coef)
            return
        ref.int8_encode(coef, out["coef"], out["scale"], out["zero"])

    def decode(self, kind: str, enc: dict[str, torch.Tensor], out: torch.Tensor) -> None:
        if kind != "k":
            self.values.decode(kind, enc, out)
            return
        og, _ = self.runs(kind, out)
        g, h, t, d = og.shape
        layers = enc["layer"].to(out.device).reshape(g, h, -1).long()
        nb = layers.shape[-1]
        bs = self.blocks_of(t, nb, self.name)
        if bool(((layers < 0) | (layers >= self.cal().num_layers)).any()):
            raise CodecError(f"codec {self.name!r}: a block names a layer outside the model")
        if self.int8:
            coef = torch.empty(enc["coef"].shape, dtype=torch.float32, device=out.device)
            ref.int8_decode(enc["coef"], enc["scale"], enc["zero"], coef)
        else:
            coef = enc["coef"].float()
        coef = coef.reshape(g, h, nb, bs, self.rank)
        if self.pre:
            start = enc["start"].to(out.device).reshape(-1).long()
            if bool((start < -1).any()):
                raise CodecError(f"codec {self.name!r}: a block names a negative start")
            out.copy_(self._decode_pre(coef, layers, start).reshape(out.shape))
            return
        basis, mean = self._frame(layers, out.device)
        keys = coef @ basis.transpose(-1, -2) + mean[:, :, :, None]
        out.copy_(keys.reshape(out.shape))

    # -- the pre-RoPE frame ------------------------------------------------------------------
    def _flat_frame(
        self, layers: torch.Tensor, pre: bool, rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, ...]:
        """Layer [n], basis [n, D, R] and mean [n, D] of the block-heads `rows` (all when
        None) of layers [G, H, nb], flattened: in the pre-RoPE frame or the post-RoPE one."""
        dev = layers.device
        heads = torch.arange(layers.shape[1], device=dev)[None, :, None].expand_as(layers)
        lay, head = layers.reshape(-1), heads.reshape(-1)
        if rows is not None:
            lay, head = lay[rows], head[rows]
        basis, mean = ("pre_basis", "pre_mean") if pre else ("basis", "mean")
        return lay, self.tensor(basis, dev)[lay, head], self.tensor(mean, dev)[lay, head]

    def _encode_pre(
        self, x: torch.Tensor, layers: torch.Tensor, centred: torch.Tensor, post: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Coefficients [N, bs, R] and start [N] of blocks x [N, bs, D]: in the pre-RoPE
        frame at the found start, or the post-RoPE ones (`post`, of `centred`) with start
        -1 where those leave less of the block outside the subspace."""
        frame = self.rope()
        lay, pbasis, pmean = self._flat_frame(layers, pre=True)
        start = frame.locate(x, lay, pmean)
        c = frame.turn(x, start, lay, inverse=True) - pmean[:, None]
        coef = c @ pbasis
        n = x.shape[0]
        post, centred = post.reshape(n, *post.shape[-2:]), centred.reshape(n, *x.shape[1:])
        off_pre = c.square().sum((1, 2)) - coef.square().sum((1, 2))
        off_post = centred.square().sum((1, 2)) - post.square().sum((1, 2))
        keep = off_pre <= off_post
        coef = torch.where(keep[:, None, None], coef, post)
        return coef, torch.where(keep, start, torch.full_like(start, -1))

    def _decode_pre(
        self, coef: torch.Tensor, layers: torch.Tensor, start: torch.Tensor
    ) -> torch.Tensor:
        """Keys [N, bs, D] of coef [G, H, nb, bs, R]: each block in its stored frame (the
        bases of only the blocks of each frame are gathered)."""
        bs = coef.shape[-2]
        coef = coef.reshape(-1, bs, self.rank)
        out = torch.empty(coef.shape[0], bs, self.cal().head_dim, device=coef.device)
        pre = (start >= 0).nonzero().flatten()
        post = (start < 0).nonzero().flatten()
        if post.numel():
            _, basis, mean = self._flat_frame(layers, False, post)
            out[post] = coef[post] @ basis.transpose(-1, -2) + mean[:, None]
        if pre.numel():
            lay, basis, mean = self._flat_frame(layers, True, pre)
            rec = coef[pre] @ basis.transpose(-1, -2) + mean[:, None]
            out[pre] = self.rope().turn(rec, start[pre], lay, inverse=False)
        return out
