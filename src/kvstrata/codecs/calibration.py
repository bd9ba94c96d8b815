"""Per-model calibration data of the calibrated codecs (`lowrank-*`, `heads*`).

One safetensors file per model, written by ``kvstrata calibrate`` (the pass itself is
kvstrata/quality/calibrate.py): per layer and KV head, the mean and the principal
directions (SVD, columns by decreasing singular value) of the post-RoPE keys and of the
values, and per layer a ranking of the KV heads by importance. Its metadata names the
model geometry and a fingerprint of the model; a codec checks the geometry against the
block layout, the quality harness checks the fingerprint against the loaded model.

A codec name stays a plain string everywhere (tier equality, prefix hashes, remote
namespaces), so a calibrated codec's name carries the calibration's digest:
``CacheConfig(host_codec="lowrank-r32", codec_calibration=FILE)`` stores
``host_codec="lowrank-r32@<digest>"``; blocks encoded with another file's bases then
never pass for this one's.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from kvstrata.core.errors import ConfigError

FORMAT = "kvstrata-calibration/1"
FIELD = "codec_calibration"
FIX = "write one with `kvstrata calibrate --model MODEL --out FILE.safetensors`"
RANKINGS = ("damage", "mass", "entropy")  # importance measures; the first is the default
TENSORS = ("k_mean", "k_basis", "k_sv", "v_mean", "v_basis", "v_sv")


@dataclass(frozen=True)
class Calibration:
    """Loaded calibration: tensors by name (fp32, CPU) and the model it describes."""

    path: str
    digest: str
    tensors: dict[str, torch.Tensor]
    meta: dict[str, str]

    @property
    def num_layers(self) -> int:
        return int(self.tensors["k_mean"].shape[0])

    @property
    def num_kv_heads(self) -> int:
        return int(self.tensors["k_mean"].shape[1])

    @property
    def head_dim(self) -> int:
        return int(self.tensors["k_mean"].shape[2])

    @property
    def dim_v(self) -> int:
        return int(self.tensors["v_mean"].shape[2])

    @property
    def fingerprint(self) -> str:
        return self.meta.get("fingerprint", "")

    def ranking(self, measure: str = RANKINGS[0]) -> torch.Tensor:
        """Importance score [L, H] under `measure` (higher = keep at full precision)."""
        key = f"rank_{measure}"
        if key not in self.tensors:
            raise ConfigError.field("ranking", measure, f"one of {', '.join(RANKINGS)}")
        return self.tensors[key]

    def check_layout(self, codec: str, num_kv_heads: int, head_dim: int, dim_v: int) -> None:
        """ConfigError unless blocks of this geometry are what the file was made from."""
        want = (self.num_kv_heads, self.head_dim, self.dim_v)
        got = (num_kv_heads, head_dim, dim_v)
        if want != got:
            raise ConfigError.field(
                FIELD,
                self.path,
                f"codec {codec!r}: the file calibrates (kv heads, head dim, v dim) = {want} "
                f"({self.meta.get('model', '?')}), the cache has {got}: calibrate this "
                f"model ({FIX})",
            )


_LOADED: dict[str, Calibration] = {}  # digest -> calibration loaded in this process


def save_calibration(path: str | Path, tensors: dict[str, torch.Tensor], meta: dict) -> str:
    """Write a calibration file; returns its digest."""
    from safetensors.torch import save_file

    missing = [t for t in TENSORS if t not in tensors]
    if missing:
        raise ValueError(f"calibration tensors missing: {missing}")
    text = {k: v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()}
    text["format"] = FORMAT
    out = {k: v.detach().float().contiguous().cpu() for k, v in tensors.items()}
    save_file(out, str(path), metadata=text)
    return file_digest(path)


def file_digest(path: str | Path) -> str:
    """First 12 hex digits of the file's SHA-256."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:12]


def load_calibration(path: str | Path, field: str = FIELD) -> Calibration:
    """Load (once per content) and register a calibration file.

    Raises:
        ConfigError: missing, unreadable or not a kvstrata calibration file.
    """
    from safetensors import safe_open

    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError.field(field, str(path), f"no such file; {FIX}")
    digest = file_digest(p)
    if digest in _LOADED:
        return _LOADED[digest]
    try:
        with safe_open(str(p), framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k).float() for k in f.keys()}  # noqa: SIM118
    except Exception as exc:  # safetensors raises its own types for a damaged header
        raise ConfigError.field(
            field, str(path), f"not a safetensors file ({exc}); {FIX}"
        ) from None
    if meta.get("format") != FORMAT or any(t not in tensors for t in TENSORS):
        raise ConfigError.field(field, str(path), f"not a {FORMAT} file; {FIX}")
    cal = Calibration(str(p), digest, tensors, meta)
    _LOADED[digest] = cal
    return cal


def loaded(digest: str, codec: str, field: str) -> Calibration:
    """The calibration with this digest, loaded earlier in this process."""
    cal = _LOADED.get(digest)
    if cal is None:
        raise ConfigError.field(
            field,
            codec,
            f"calibration {digest} is not loaded in this process: give its file as "
            f"{FIELD} (the codec name without '@{digest}')",
        )
    return cal


def split_name(name: str) -> tuple[str, str | None]:
    """'lowrank-r32@abc' -> ('lowrank-r32', 'abc'); no '@' -> (name, None)."""
    base, _, digest = name.partition("@")
    return base, digest or None
