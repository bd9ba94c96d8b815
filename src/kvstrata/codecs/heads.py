"""`heads<PCT>-<kept>-<other>`: important KV heads in one codec, the rest in another.

Calibration (``kvstrata calibrate``) ranks the KV heads of every layer by importance (by
default the attention-output damage that quantizing the head's history causes; see
kvstrata/quality/calibrate.py). The top PCT % of each layer's heads (rounded to whole
heads) are stored with the `kept` codec, the others with `other`, e.g.
``heads33-int8-int4``: one of SmolLM2's 3 KV heads per layer in int8, two in int4.
No head is dropped.

Fields are per (layer, kv head) and alike for every head, but the heads of a layer no
longer take alike bytes: a block of one layer is stored as one byte string

    layer (int16) | kept heads' fields | other heads' fields | zero padding

split evenly over the layer's H head rows, i.e. per block per (layer, kv head) one
`data` field [1, ceil(bytes / H)] uint8. Callers always pass all heads of a layer
([..., H, T, D]), which is what lets the codec pack across them.
"""

from __future__ import annotations

import math
import re

import torch

from kvstrata.codecs._calibrated import IDENTIFY_RANK, CalibratedCodec, check_finite
from kvstrata.codecs.base import Codec
from kvstrata.codecs.calibration import RANKINGS, Calibration
from kvstrata.core.errors import CodecError, ConfigError
from kvstrata.core.layout import BlockLayout, FieldSpec

PATTERN = re.compile(r"heads(\d+)-(.+)")
HEADER = 2  # bytes of the int16 layer index


class HeadsCodec(CalibratedCodec):
    """Per layer, the top `pct` % KV heads by importance in `kept`, the rest in `other`."""

    family = "heads"

    def __init__(
        self,
        pct: int,
        kept: Codec,
        other: Codec,
        calibration: Calibration | None,
        *,
        ranking: str = RANKINGS[0],
        scores: torch.Tensor | None = None,
    ) -> None:
        super().__init__(f"heads{pct}-{kept.name}-{other.name}", calibration)
        if not 0 <= pct <= 100:
            raise ConfigError.field("codec", self.base, "heads<PCT> with PCT in 0..100")
        self.pct, self.kept, self.other = pct, kept, other
        self.ranking, self.scores = ranking, scores  # scores: [L, H] override (measured)

    def num_kept(self, heads: int) -> int:
        return min(heads, math.floor(self.pct * heads / 100 + 0.5))

    def validate(self, layout: BlockLayout) -> None:
        super().validate(layout)
        self.kept.validate(layout)
        self.other.validate(layout)

    def derive(self, key: str) -> torch.Tensor:
        cal = self.cal()
        if key == "order":  # [L, H]: kept heads first (ascending), then the others
            scores = self.scores if self.scores is not None else cal.ranking(self.ranking)
            k, h = self.num_kept(cal.num_kv_heads), cal.num_kv_heads
            top = torch.argsort(-scores.float(), dim=1, stable=True)
            kept = top[:, :k].sort(dim=1).values
            rest = top[:, k:].sort(dim=1).values
            return torch.cat([kept, rest], dim=1).reshape(-1, h)
        if key.endswith("_ibasis"):
            return cal.tensors[key.replace("_ibasis", "_basis")][..., :IDENTIFY_RANK].contiguous()
        return cal.tensors[key]

    # -- byte layout -------------------------------------------------------------------------
    @staticmethod
    def _specs(codec: Codec, kind: str, dim: int, bs: int) -> list[tuple[str, FieldSpec]]:
        layout = BlockLayout(1, 1, dim, bs, v_head_dim=dim)
        return sorted(codec.fields(kind, layout).items())

    def _sizes(self, kind: str, dim: int, bs: int, heads: int) -> tuple[int, int, int]:
        """(kept bytes per head, other bytes per head, data cols) per block."""
        hi = sum(s.nbytes for _, s in self._specs(self.kept, kind, dim, bs))
        lo = sum(s.nbytes for _, s in self._specs(self.other, kind, dim, bs))
        k = self.num_kept(heads)
        total = HEADER + k * hi + (heads - k) * lo
        return hi, lo, -(-total // heads)

    def fields(self, kind: str, layout: BlockLayout) -> dict[str, FieldSpec]:
        dim = layout.head_dim if kind == "k" else layout.dim_v
        cols = self._sizes(kind, dim, layout.block_size, layout.num_kv_heads)[2]
        return {"data": FieldSpec(1, cols, torch.uint8)}

    def _to_bytes(self, codec: Codec, kind: str, y: torch.Tensor) -> torch.Tensor:
        """Encode y [M, n, bs, D] with `codec` and flatten its fields to [M, bytes]."""
        m, n, bs, d = y.shape
        if n == 0:
            return torch.empty(m, 0, dtype=torch.uint8, device=y.device)
        parts = []
        fields = {}
        for f, s in self._specs(codec, kind, d, bs):
            fields[f] = torch.empty(m, n, s.rows, s.cols, dtype=s.dtype, device=y.device)
        codec.encode(kind, y.contiguous(), fields)
        for f, _ in self._specs(codec, kind, d, bs):
            parts.append(fields[f].reshape(m, -1).view(torch.uint8))
        return torch.cat(parts, dim=1)

    def _from_bytes(self, codec: Codec, kind: str, raw: torch.Tensor, out: torch.Tensor) -> None:
        """Inverse of `_to_bytes` into out [M, n, bs, D]."""
        m, n, bs, d = out.shape
        if n == 0:
            return
        enc, at = {}, 0
        for f, s in self._specs(codec, kind, d, bs):
            size = n * s.nbytes
            chunk = _aligned(raw[:, at : at + size]).view(s.dtype)
            enc[f] = chunk.reshape(m, n, s.rows, s.cols)
            at += size
        codec.decode(kind, enc, out)

    # -- encode / decode -----------------------------------------------------------------
    def _layers(self, kind: str, x: torch.Tensor, whole: bool, bs: int) -> torch.Tensor:
        g, _, t, _ = x.shape
        if self.hint is not None:
            return torch.full((g, t // bs), self.hint, dtype=torch.long, device=x.device)
        if whole:
            return torch.arange(g, device=x.device)[:, None].expand(g, t // bs)
        mean = self.tensor(f"{kind}_mean", x.device)
        basis = self.tensor(f"{kind}_ibasis", x.device)
        return self.residuals(x, mean, basis, bs).sum(1).argmin(-1)  # [G, nb]

    def encode(self, kind: str, x: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
        xg, whole = self.runs(kind, x)
        check_finite(xg)
        g, h, t, d = xg.shape
        data = out["data"]
        nb, cols = data.shape[-2], data.shape[-1]
        bs = self.blocks_of(t, nb, self.name)
        layers = self._layers(kind, xg.float(), whole, bs)
        order = self.tensor("order", torch.device("cpu"))
        k = self.num_kept(h)
        xb = xg.reshape(g, h, nb, bs, d).transpose(1, 2)  # [G, nb, H, bs, D]
        packed = torch.zeros(g, nb, h * cols, dtype=torch.uint8, device=x.device)
        for layer in layers.unique().tolist():
            sel = layers == layer
            blocks = xb[sel]  # [M, H, bs, D]
            heads = order[layer].to(x.device)
            header = torch.full((blocks.shape[0], 1), layer, dtype=torch.int16, device=x.device)
            payload = torch.cat(
                [
                    header.view(torch.uint8),
                    self._to_bytes(self.kept, kind, blocks[:, heads[:k]]),
                    self._to_bytes(self.other, kind, blocks[:, heads[k:]]),
                ],
                dim=1,
            )
            row = torch.zeros(blocks.shape[0], h * cols, dtype=torch.uint8, device=x.device)
            row[:, : payload.shape[1]] = payload
            packed[sel] = row
        data.copy_(packed.reshape(g, nb, h, cols).transpose(1, 2).reshape(data.shape))

    def decode(self, kind: str, enc: dict[str, torch.Tensor], out: torch.Tensor) -> None:
        og, _ = self.runs(kind, out)
        g, h, t, d = og.shape
        data = enc["data"].to(out.device)
        nb, cols = data.shape[-2], data.shape[-1]
        bs = self.blocks_of(t, nb, self.name)
        packed = data.reshape(g, h, nb, cols).transpose(1, 2).reshape(g, nb, h * cols)
        layers = _aligned(packed[..., :HEADER]).view(torch.int16).squeeze(-1).long()
        if bool(((layers < 0) | (layers >= self.cal().num_layers)).any()):
            raise CodecError(f"codec {self.name!r}: a block names a layer outside the model")
        order = self.tensor("order", torch.device("cpu"))
        k = self.num_kept(h)
        hi, _, _ = self._sizes(kind, d, bs, h)
        result = torch.empty(g, nb, h, bs, d, dtype=out.dtype, device=out.device)
        for layer in layers.unique().tolist():
            sel = layers == layer
            rows = packed[sel]
            heads = order[layer].to(out.device)
            m = rows.shape[0]
            top = torch.empty(m, k, bs, d, dtype=out.dtype, device=out.device)
            rest = torch.empty(m, h - k, bs, d, dtype=out.dtype, device=out.device)
            self._from_bytes(self.kept, kind, rows[:, HEADER : HEADER + k * hi], top)
            self._from_bytes(self.other, kind, rows[:, HEADER + k * hi :], rest)
            full = torch.empty(m, h, bs, d, dtype=out.dtype, device=out.device)
            full[:, heads[:k]] = top
            full[:, heads[k:]] = rest
            result[sel] = full
        out.copy_(result.transpose(1, 2).reshape(out.shape))


def _aligned(raw: torch.Tensor) -> torch.Tensor:
    """A fresh contiguous copy of a byte slice (a view as a wider dtype needs one)."""
    return torch.empty(raw.shape, dtype=raw.dtype, device=raw.device).copy_(raw)
