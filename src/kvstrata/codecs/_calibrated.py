"""What the calibrated codecs share: the bound calibration and the layer of a block.

The Codec protocol hands a codec K or V as [..., H, n*bs, D] without saying which model
layers the leading dims are: a whole-model run is [L, H, ...] (demotion, remote), a
`write_layer` / `read_layer` call is one layer [H, ...], and a layer group's run covers
only its layers. Per-layer bases and head rankings need the layer, so every encoded block
stores it (an int16 per block), and `encode` finds it: from the shape when the run is
[L, H, ...] with L the calibrated model's layer count, else by fitting the block against
every layer's calibrated subspace and taking the best fit (`identify`). Decoding only
reads what was stored.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from kvstrata.codecs import _reference as ref
from kvstrata.codecs.base import Codec
from kvstrata.codecs.calibration import FIELD, FIX, Calibration
from kvstrata.core.errors import CodecError, ConfigError
from kvstrata.core.layout import KINDS, BlockLayout

IDENTIFY_RANK = 8  # subspace rank used to recognise a block's layer (heads codec)
ROWS_PER_CHUNK = 1 << 15  # tokens per identification pass (bounds temporary memory)


class CalibratedCodec(Codec):
    """A codec that needs per-model calibration; unbound ones size blocks but cannot code."""

    lossless = False
    family = "?"

    def __init__(self, base: str, calibration: Calibration | None) -> None:
        self.base = base
        self.calibration = calibration
        self.name = base if calibration is None else f"{base}@{calibration.digest}"
        self._dev: dict[tuple[str, torch.device], torch.Tensor] = {}
        self.hint: int | None = None

    @contextlib.contextmanager
    def at_layer(self, layer: int) -> Iterator[None]:
        """Code one layer's [H, T, D] as model layer `layer` (no identification): for a
        caller that knows the layer (the quality harness's layer-by-layer simulation)."""
        self.hint = layer
        try:
            yield
        finally:
            self.hint = None

    # -- calibration -------------------------------------------------------------------------
    def cal(self) -> Calibration:
        if self.calibration is None:
            raise ConfigError.field(
                FIELD,
                None,
                f"codec {self.base!r} needs a calibration file of the model: set "
                f"{FIELD} (CacheConfig) / --calibration (CLI); {FIX}",
            )
        return self.calibration

    def check_calibration(self) -> None:  # noqa: B027 - optional hook
        """ConfigError when the bound calibration lacks what this codec needs (checked
        when a config names the codec, before any layout is known)."""

    def validate(self, layout: BlockLayout) -> None:
        self.check_calibration()
        cal = self.cal()
        cal.check_layout(self.base, layout.num_kv_heads, layout.head_dim, layout.dim_v)
        if layout.num_layers > cal.num_layers:
            raise ConfigError.field(
                FIELD,
                cal.path,
                f"codec {self.base!r}: the file calibrates {cal.num_layers} layers, the "
                f"cache has {layout.num_layers}: calibrate this model ({FIX})",
            )

    def tensor(self, key: str, device: torch.device) -> torch.Tensor:
        """A calibration tensor (or one derived by `derive`) on `device`, cached."""
        hit = self._dev.get((key, device))
        if hit is None:
            hit = self.derive(key).to(device)
            self._dev[(key, device)] = hit
        return hit

    def derive(self, key: str) -> torch.Tensor:
        return self.cal().tensors[key]

    # -- shapes ------------------------------------------------------------------------------
    def runs(self, kind: str, x: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """x [..., H, T, D] as [G, H, T, D] fp32, and whether G is the whole model."""
        if kind not in KINDS:
            raise CodecError(f"kind={kind!r} is invalid: expected 'k' or 'v'")
        cal = self.cal()
        dim = cal.head_dim if kind == "k" else cal.dim_v
        if x.dim() < 3 or x.shape[-3] != cal.num_kv_heads or x.shape[-1] != dim:
            raise CodecError(
                f"codec {self.name!r}: {kind.upper()} of shape {tuple(x.shape)} is not "
                f"[..., {cal.num_kv_heads} kv heads, tokens, {dim}] as calibrated"
            )
        whole = x.dim() == 4 and x.shape[0] == cal.num_layers
        return x.reshape(-1, *x.shape[-3:]), whole

    @staticmethod
    def blocks_of(tokens: int, nb: int, name: str) -> int:
        if nb == 0 or tokens % nb:
            raise CodecError(f"codec {name!r}: {tokens} tokens do not split into {nb} blocks")
        return tokens // nb

    # -- layer identification ----------------------------------------------------------------
    def residuals(
        self, x: torch.Tensor, mean: torch.Tensor, basis: torch.Tensor, bs: int
    ) -> torch.Tensor:
        """Residual energy of every block of x [G, H, T, D] off every layer's subspace:
        [G, H, nb, L] for mean [L, H, D] and basis [L, H, D, r]."""
        g, h, t, _ = x.shape
        out = torch.empty(g, h, t // bs, mean.shape[0], device=x.device)
        step = max(bs, ROWS_PER_CHUNK // max(1, g * h) // bs * bs)
        for t0 in range(0, t, step):
            xs = x[:, :, t0 : t0 + step]
            for layer in range(mean.shape[0]):
                c = xs - mean[layer][None, :, None]
                proj = torch.einsum("ghtd,hdr->ghtr", c, basis[layer])
                e = c.square().sum(-1) - proj.square().sum(-1)
                out[:, :, t0 // bs : (t0 + xs.shape[2]) // bs, layer] = e.reshape(g, h, -1, bs).sum(
                    -1
                )
        return out


def check_finite(x: torch.Tensor) -> None:
    ref.check_finite(x)
