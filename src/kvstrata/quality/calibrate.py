"""The calibration pass of the calibrated codecs (``kvstrata calibrate``).

Runs the model over calibration text — standard-library modules that are *not* among the
held-out files the quality harness evaluates on (:func:`calibration_ids`) — and writes,
per layer and KV head:

- the mean and the principal directions (``torch.linalg.svd`` of the centred vectors)
  of the post-RoPE keys (``k_*``), the values (``v_*``), the pre-RoPE keys (``kpre_*``,
  ShadowKV's frame, for `lowrank-pre-*`) and, per layer across its heads, of the
  post-RoPE keys (``k_layer_*``);
- the model's RoPE frame when its rotary is rotate-half RoPE (``rope_freq`` [L, D/2],
  ``rope_scale`` [L], read off the forward's cos/sin tables; metadata ``max_positions``):
  the pre-RoPE keys are then the post-RoPE keys turned back with it (so a key norm
  between k_proj and the rotary, as in Qwen3, is inside the frame), else k_proj's output;
- three importance scores of every KV head ([L, H], higher = keep at full precision),
  all over the part of the history a tiered cache would hold in a lower tier (see
  quality/kvsim.py: not the sinks, not the residual window):

  ``mass``    attention weight on that history (the seed's topk(attn.mean(0)) idea),
  ``entropy`` minus the attention entropy over that history (sharp heads first),
  ``damage``  how far the layer's output (after o_proj) moves when only this head's
              history is int4-coded: the error itself, measured.

The scores are averaged over the KV head's query group and the calibration tokens.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Any

import torch

from kvstrata.codecs._rope import RopeFrame, frame_from_rotary
from kvstrata.codecs.calibration import Calibration, load_calibration, save_calibration
from kvstrata.codecs.int4 import Int4Codec
from kvstrata.core.errors import ConfigError
from kvstrata.core.fingerprint import weights_digest
from kvstrata.quality import kvsim
from kvstrata.workload.zoo import heldout_files

DEFAULT_TOKENS = 8192
DEFAULT_CONTEXT = 2048


def calibration_files(model_name: str = "default") -> list[Path]:
    """Top-level standard-library modules, sorted, none of them a held-out file."""
    held = {p.resolve() for p in heldout_files(model_name)}
    root = Path(sysconfig.get_paths()["stdlib"])
    return [p for p in sorted(root.glob("*.py")) if p.resolve() not in held]


def calibration_ids(tokenizer: Any, tokens: int, model_name: str = "default") -> list[int]:
    """`tokens` token ids of calibration text (files joined with <eos>)."""
    ids: list[int] = []
    eos = getattr(tokenizer, "eos_token_id", None)
    for path in calibration_files(model_name):
        text = path.read_text("utf-8", "replace")
        ids.extend(tokenizer.encode(text, add_special_tokens=False))
        if eos is not None:
            ids.append(eos)
        if len(ids) >= tokens:
            return ids[:tokens]
    raise ConfigError.field("tokens", tokens, f"at most {len(ids)} calibration tokens here")


def damage_codec(block_size: int, head_dim: int) -> Any:
    """int4 (KIVI) with the largest group <= 64 that the block and head sizes allow."""
    for group in (64, 32, 16, 8, 4, 2):
        if block_size % group == 0 and head_dim % group == 0:
            return Int4Codec(group)
    raise ConfigError.field("block_size", block_size, "an even block size for int4")


class _Collector:
    """Per-layer sums of what the calibration pass sees."""

    def __init__(self, block_size: int, residual: int) -> None:
        self.block_size, self.residual = block_size, residual
        self.rows: dict[tuple[str, int], list[torch.Tensor]] = {}
        self.scores: dict[tuple[str, int], torch.Tensor] = {}
        self.rope: dict[int, RopeFrame | None] = {}  # layer -> its rope frame (one layer)

    def add(self, what: str, layer: int, x: torch.Tensor) -> None:
        self.rows.setdefault((what, layer), []).append(x.detach().float().cpu())

    def score(self, what: str, layer: int, value: torch.Tensor) -> None:
        key = (what, layer)
        self.scores[key] = self.scores.get(key, 0) + value.detach().float().cpu()

    def _pre_rope(self, layer: int, key: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE keys [H, T, D]: `key` turned back by the layer's rope frame (read off
        the rotary tables once), or k_proj's output when the rotary is not rotate-half
        over the whole head."""
        if layer not in self.rope:
            cos, sin = kvsim.rotary(layer)
            found = frame_from_rotary(cos[0], sin[0])
            if found is not None and 2 * found[0].numel() != key.shape[-1]:
                found = None  # a partial rotary (rotary dim < head dim): no frame
            self.rope[layer] = (
                None if found is None else RopeFrame(found[0][None], torch.tensor([found[1]]), 1)
            )
        frame = self.rope[layer]
        if frame is None:
            return kvsim.pre_rope_keys(layer)[0]
        zero = torch.zeros(key.shape[0], dtype=torch.long, device=key.device)
        return frame.turn(key.float(), zero, zero, inverse=True)

    def hook(self, module, query, key, value, scaling):
        layer = module.layer_idx
        _, hq, t, d = query.shape
        hkv = key.shape[1]
        self.add("k", layer, key[0])
        self.add("v", layer, value[0])
        self.add("kpre", layer, self._pre_rope(layer, key[0]))
        out = kvsim.attend(query, key, value, scaling)
        lossy = kvsim.lossy_mask(t, self.block_size, self.residual, query.device)
        g = hq // hkv
        scale = scaling if scaling is not None else d**-0.5
        causal = torch.ones(t, t, dtype=torch.bool).tril_()
        mass, ent = torch.zeros(hkv), torch.zeros(hkv)
        for h in range(hkv):
            s = query[0, h * g : (h + 1) * g].float() @ key[0, h].float().T * scale
            p = s.masked_fill_(~causal, float("-inf")).softmax(-1).masked_fill_(~lossy, 0)
            mass[h] = p.sum(-1).mean()
            ent[h] = (p * p.clamp_min(1e-30).log()).sum(-1).mean()  # = -entropy
        self.score("mass", layer, mass)
        self.score("entropy", layer, ent)
        codec = damage_codec(self.block_size, d)
        kl = kvsim.roundtrip(codec, "k", key[0], layer, self.block_size)[None]
        vl = kvsim.roundtrip(codec, "v", value[0], layer, self.block_size)[None]
        damage = torch.zeros(hkv)
        w = module.o_proj.weight.float()
        keep = -(-self.residual // self.block_size)
        for h in range(hkv):  # only head h's query group changes: attend it alone
            grp = slice(h * g, (h + 1) * g)
            o = kvsim.attend_blocks(
                query[:, grp],
                key[:, h : h + 1],
                value[:, h : h + 1],
                scaling,
                self.block_size,
                keep,
                kl[:, h : h + 1],
                vl[:, h : h + 1],
            )
            cols = slice(h * g * d, (h + 1) * g * d)
            diff = (o - out[:, :, grp]).reshape(t, -1).float() @ w[:, cols].T
            damage[h] = diff.square().sum() / t
        self.score("damage", layer, damage)
        return out


def _pca(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mean [D], basis [D, D] (columns by decreasing singular value), singular values."""
    mean = x.mean(0)
    _, sv, vh = torch.linalg.svd(x - mean, full_matrices=False)
    return mean, vh.T.contiguous(), sv


def calibrate(
    model: Any,
    tokenizer: Any,
    *,
    model_name: str = "default",
    tokens: int = DEFAULT_TOKENS,
    context: int = DEFAULT_CONTEXT,
    block_size: int = 64,
    residual: int = 128,
    ids: list[int] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Run the calibration pass; returns (tensors, metadata) for `save_calibration`.
    `ids`: the calibration token ids (default: `calibration_ids` of the tokenizer)."""
    if ids is None:
        ids = calibration_ids(tokenizer, tokens, model_name)
    if len(ids) < context:
        raise ConfigError.field("tokens", len(ids), f"at least one window of {context} tokens")
    col = _Collector(block_size, residual)
    with torch.inference_mode(), kvsim.hooked(model, col.hook):
        for start in range(0, len(ids) - context + 1, context):
            window = torch.tensor(ids[start : start + context])[None]
            model(input_ids=window, use_cache=False)
    layers = len(model.model.layers)
    out: dict[str, list] = {}
    for what in ("k", "v", "kpre"):
        for layer in range(layers):
            x = torch.cat(col.rows[(what, layer)], dim=1)  # [H, N, D]
            parts = [_pca(x[h]) for h in range(x.shape[0])]
            for name, i in (("mean", 0), ("basis", 1), ("sv", 2)):
                out.setdefault(f"{what}_{name}", []).append(torch.stack([p[i] for p in parts]))
            if what == "k":
                shared = _pca(x.reshape(-1, x.shape[-1]))
                for name, t in zip(("mean", "basis", "sv"), shared, strict=True):
                    out.setdefault(f"k_layer_{name}", []).append(t)
            if what in ("k", "kpre"):  # heads concatenated per token: [N, H*D]
                cat = _pca(x.transpose(0, 1).reshape(x.shape[1], -1))
                for name, t in zip(("mean", "basis", "sv"), cat, strict=True):
                    out.setdefault(f"{what}_cat_{name}", []).append(t)
    tensors = {k: torch.stack(v) for k, v in out.items()}
    for what in ("mass", "entropy", "damage"):
        tensors[f"rank_{what}"] = torch.stack([col.scores[(what, i)] for i in range(layers)])
    frames = [col.rope.get(i) for i in range(layers)]
    rope_meta = {}
    if all(f is not None for f in frames):
        tensors["rope_freq"] = torch.cat([f.freq for f in frames])  # type: ignore[union-attr]
        tensors["rope_scale"] = torch.cat([f.scale for f in frames])  # type: ignore[union-attr]
        positions = getattr(model.config, "max_position_embeddings", None) or context
        rope_meta["max_positions"] = int(positions)
    meta = {
        "model": model_name,
        "fingerprint": weights_digest(model),
        "tokens": len(ids) // context * context,
        "context": context,
        "block_size": block_size,
        "residual": residual,
        "text": "stdlib top-level modules, sorted, minus the held-out files",
        **rope_meta,
    }
    return tensors, meta


def write_calibration(model: Any, tokenizer: Any, out: str | Path, **kwargs: Any) -> str:
    """Calibrate and write `out`; returns the file's digest."""
    tensors, meta = calibrate(model, tokenizer, **kwargs)
    Path(out).expanduser().parent.mkdir(parents=True, exist_ok=True)
    return save_calibration(Path(out).expanduser(), tensors, meta)


def check_calibration(
    model: Any, path: str | Path, field: str = "codec_calibration"
) -> Calibration:
    """Load `path` and check that it was made from `model` (its fingerprint)."""
    cal = load_calibration(path, field)
    mine = weights_digest(model)
    if cal.fingerprint != mine:
        raise ConfigError.field(
            field,
            str(path),
            f"made from model {cal.meta.get('model', '?')} (fingerprint {cal.fingerprint}), "
            f"not this one ({mine}): run `kvstrata calibrate --model MODEL --out FILE`",
        )
    return cal
