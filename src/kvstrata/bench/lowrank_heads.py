"""Issue #27's advanced compression, measured: low-rank keys and important heads.

:func:`measure` sweeps, on one model and its calibration file, at one context:

- ``uniform``: the plain codecs (none, int8, fp8, int4, int4-g32) on K and V — the
  baselines, measured in the same run;
- ``lowrank-post``: `lowrank-r<R>[-int8]` keys (post-RoPE, per layer and KV head, the
  registered codec), values exact, and `+int8` values for the practical combination;
- ``lowrank-pre``: `lowrank-pre-r<R>[-int8]`, the registered codec on *pre*-RoPE keys
  (ShadowKV), each block's start found from its keys (codecs/_rope.py), values exact;
- ``lowrank-pre-true``: the same projection given the true positions (through the model's
  k_proj and its rotary): what the found starts are measured against;
- ``lowrank-layer``: one basis per layer shared by its heads (same bytes as per head);
- ``lowrank-concat-post`` / ``-pre``: one basis per layer over the heads' keys
  concatenated ([H*D], ShadowKV's layout), rank R*H in all (the same bytes as R per
  head);
- ``lowrank-search``: the registered codec, the layer found by fitting (see
  codecs/_calibrated.py) instead of given;
- ``heads``: `heads<PCT>-int8-int4` under each importance ranking, and the same bytes
  with the heads chosen in reverse and at random (the control at equal bytes).

ΔPPL and top-1 agreement come from quality/kvsim.py's one-forward simulation of the
tiered cache (every block but the sinks and the residual window decoded), not from
timings, so a loaded machine does not change them. Bytes per token are stored bytes of
all layers and KV heads (scales and the per-block layer index included) in the model's
dtype (SmolLM2 runs in fp32 here: `none` is 4 bytes per element).

    python -m kvstrata.bench.lowrank_heads --model smollm2 --calibration FILE --context 2048
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvstrata.codecs import _reference as ref
from kvstrata.codecs.base import Codec
from kvstrata.codecs.calibration import Calibration
from kvstrata.codecs.heads import HeadsCodec
from kvstrata.codecs.lowrank import LowRankCodec
from kvstrata.codecs.registry import get_codec
from kvstrata.core.layout import BlockLayout
from kvstrata.quality import kvsim

RANKS = (8, 16, 24, 32, 48)
UNIFORM = ("none", "int8", "fp8", "int4", "int4-g32")
Lossy = kvsim.Lossy


def _bytes_per_token(codec: Codec, kind: str, layout: BlockLayout) -> float:
    per = sum(s.nbytes for s in codec.fields(kind, layout).values())
    return per * layout.num_layers * layout.num_kv_heads / layout.block_size


def _exact(layer: int, kind: str, x: torch.Tensor) -> torch.Tensor:
    return x


def _project(
    x: torch.Tensor, mean: torch.Tensor, basis: torch.Tensor, int8: bool = False
) -> torch.Tensor:
    """x [..., D] onto mean + span(basis [..., D, R]) (basis broadcast over tokens); with
    `int8` the coefficients go through the int8 codec's per-token quantization."""
    c = (x - mean[..., None, :]) @ basis
    if int8:
        data = torch.empty(c.shape, dtype=torch.uint8)
        scale = torch.empty((*c.shape[:-1], 1), dtype=torch.float16)
        zero = torch.empty_like(scale)
        ref.int8_encode(c, data, scale, zero)
        ref.int8_decode(data, scale, zero, c)
    return c @ basis.transpose(-1, -2) + mean[..., None, :]


def _pre_rope(cal: Calibration, rank: int, concat: bool, int8: bool = False) -> Lossy:
    """ShadowKV: pre-RoPE keys projected, then rotated with the tokens' own positions."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    def lossy(layer: int, kind: str, x: torch.Tensor) -> torch.Tensor:
        if kind == "v":
            return x
        pre = kvsim.pre_rope_keys(layer)[0].float()  # [H, T, D]
        if concat:
            h, t, d = pre.shape
            flat = pre.transpose(0, 1).reshape(t, h * d)
            basis = cal.tensors["kpre_cat_basis"][layer, :, : rank * h]
            rec = _project(flat, cal.tensors["kpre_cat_mean"][layer], basis, int8)
            rec = rec.reshape(t, h, d).transpose(0, 1)
        else:
            basis = cal.tensors["kpre_basis"][layer, :, :, :rank]
            rec = _project(pre, cal.tensors["kpre_mean"][layer], basis, int8)
        cos, sin = kvsim.rotary(layer)
        rotated, _ = apply_rotary_pos_emb(rec[None], rec[None], cos.float(), sin.float())
        return rotated[0].to(x.dtype)

    return lossy


def _concat_post(cal: Calibration, rank: int, int8: bool = False) -> Lossy:
    def lossy(layer: int, kind: str, x: torch.Tensor) -> torch.Tensor:
        if kind == "v":
            return x
        h, t, d = x.shape
        flat = x.float().transpose(0, 1).reshape(t, h * d)
        basis = cal.tensors["k_cat_basis"][layer, :, : rank * h]
        rec = _project(flat, cal.tensors["k_cat_mean"][layer], basis, int8)
        return rec.reshape(t, h, d).transpose(0, 1).to(x.dtype)

    return lossy


def _grid(
    cal: Calibration, layout: BlockLayout, ranks: tuple[int, ...], heads: bool
) -> list[tuple[str, str, Lossy, float, float]]:
    """(mode, setting, lossy, key bytes/token, value bytes/token) of every setting."""
    bs = layout.block_size
    none = get_codec("none")
    v_none = _bytes_per_token(none, "v", layout)
    rows: list[tuple[str, str, Lossy, float, float]] = []

    def add(mode: str, setting: str, codec: Codec) -> None:
        kb, vb = _bytes_per_token(codec, "k", layout), _bytes_per_token(codec, "v", layout)
        rows.append((mode, setting, kvsim.codec_lossy(codec, bs), kb, vb))

    for name in UNIFORM:
        add("uniform", name, get_codec(name))
    for i, row in enumerate(rows):  # the int8 / int4 baselines run first
        if row[1] in ("int8", "int4"):
            rows[i] = ("first", *row[1:])
    int8 = get_codec("int8")
    for r in ranks:
        add("lowrank-post", f"lowrank-r{r}", LowRankCodec(r, False, none, cal))
    for r in (16, 24, 32):
        add("lowrank-post", f"lowrank-r{r}-int8", LowRankCodec(r, True, none, cal))
    for r in (24, 32):
        add("lowrank-post", f"lowrank-r{r}-int8+int8", LowRankCodec(r, True, int8, cal))
    add("lowrank-search", "lowrank-r32", LowRankCodec(32, False, none, cal, search=True))
    add("lowrank-layer", "lowrank-r32", LowRankCodec(32, False, none, cal, shared=True))
    h = layout.num_kv_heads
    if "rope_freq" in cal.tensors:
        for r in ranks:
            add("lowrank-pre", f"lowrank-pre-r{r}", LowRankCodec(r, False, none, cal, pre=True))
        for r in (24, 28, 29, 32):
            add("lowrank-pre", f"lowrank-pre-r{r}-int8", LowRankCodec(r, True, none, cal, pre=True))
        for r in (28, 29):
            add(
                "lowrank-pre",
                f"lowrank-pre-r{r}-int8+int8",
                LowRankCodec(r, True, int8, cal, pre=True),
            )
    for r in ranks:  # bytes of the registered codec's format (its start field included)
        kb = _bytes_per_token(LowRankCodec(r, False, none, cal, pre=True), "k", layout)
        rows.append(("lowrank-pre-true", f"lowrank-pre-r{r}", _pre_rope(cal, r, False), kb, v_none))
    for r in (8, 16, 32):
        if "k_cat_basis" not in cal.tensors:
            break
        concat = 2.0 * r * h * layout.num_layers  # fp16 coefficients, no index
        setting = f"rank {r * h} of {h}x{layout.head_dim}"
        rows.append(("lowrank-concat-post", setting, _concat_post(cal, r), concat, v_none))
        rows.append(("lowrank-concat-pre", setting, _pre_rope(cal, r, True), concat, v_none))
    for r in (28, 29):  # per-head pre-RoPE, int8 coefficients: near 2x below int8 keys
        kb = _bytes_per_token(LowRankCodec(r, True, none, cal, pre=True), "k", layout)
        rows.append(
            (
                "lowrank-pre-true",
                f"lowrank-pre-r{r}-int8",
                _pre_rope(cal, r, False, True),
                kb,
                v_none,
            )
        )
    for total in (84, 96):  # concatenated heads, int8 coefficients + fp16 scale, zero
        if "k_cat_basis" not in cal.tensors or total % h:
            continue
        kb = (total + 4.0) * layout.num_layers
        setting = f"rank {total} of {h}x{layout.head_dim}, int8"
        rows.append(
            ("lowrank-concat-pre", setting, _pre_rope(cal, total // h, True, True), kb, v_none)
        )
        rows.append(
            ("lowrank-concat-post", setting, _concat_post(cal, total // h, True), kb, v_none)
        )
    if heads:
        int4 = get_codec("int4")
        gen = torch.Generator().manual_seed(0)
        random = torch.rand(cal.num_layers, cal.num_kv_heads, generator=gen)
        reverse = -cal.ranking("damage")
        for pct, rankings in ((33, ("damage", "mass", "entropy")), (67, ("damage",))):
            for ranking in rankings:
                codec = HeadsCodec(pct, int8, int4, cal, ranking=ranking)
                add("heads", f"heads{pct}-int8-int4 by {ranking}", codec)
            for label, scores in (("reversed", reverse), ("random", random)):
                codec = HeadsCodec(pct, int8, int4, cal, scores=scores)
                add("heads", f"heads{pct}-int8-int4 {label}", codec)
    rows.sort(key=lambda r: PRIORITY.index(r[0]) if r[0] in PRIORITY else len(PRIORITY))
    return rows


# The order the sweep runs in (a long run interrupted still has the main comparisons).
PRIORITY = ("first", "lowrank-pre", "lowrank-post", "lowrank-pre-true", "heads")


def measure(
    model: Any,
    windows: list[list[int]],
    calibration: Calibration,
    *,
    context: int,
    block_size: int = 64,
    residual: int = 128,
    ranks: tuple[int, ...] = RANKS,
    heads: bool = True,
    only: Callable[[str, str], bool] | None = None,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Rows {"mode", "setting", "key_bytes_per_token", "value_bytes_per_token",
    "delta_ppl_pct", "top1_agreement", "context"} (+ "kl_nats_per_token": mean
    KL(exact || setting) of the next-token distributions, "windows", "method") for every
    setting of the sweep (`only(mode, setting)` filters it), the windows cut at
    `context` tokens of held-out text the calibration did not see."""
    cfg = model.config
    layout = BlockLayout(
        cfg.num_hidden_layers,
        cfg.num_key_value_heads,
        calibration.head_dim,
        block_size,
        dtype=next(model.parameters()).dtype,
    )
    grid = [g for g in _grid(calibration, layout, ranks, heads) if only is None or only(*g[:2])]
    rows = []
    exact = [
        kvsim.simulated_ppl(model, w, None, block_size=block_size, keep_logprobs=True)
        for w in windows
    ]
    ex_tok = sum(r.num_tokens for r in exact)
    ex_ppl = math.exp(sum(r.nll for r in exact) / ex_tok)
    ex_ids = [i for r in exact for i in r.argmax_ids]
    for mode, setting, lossy, kb, vb in grid:
        runs, kl = [], 0.0
        for w, ex in zip(windows, exact, strict=True):
            run = kvsim.simulated_ppl(
                model, w, lossy, block_size=block_size, residual=residual, keep_logprobs=True
            )
            kl += run.kl_from(ex)
            run.logprobs = None
            runs.append(run)
        ppl = math.exp(sum(r.nll for r in runs) / ex_tok)
        ids = [i for r in runs for i in r.argmax_ids]
        row = {
            "mode": "uniform" if mode == "first" else mode,
            "setting": setting,
            "key_bytes_per_token": kb,
            "value_bytes_per_token": vb,
            "delta_ppl_pct": 100.0 * (ppl / ex_ppl - 1.0),
            "top1_agreement": sum(a == b for a, b in zip(ex_ids, ids, strict=True)) / len(ids),
            "context": context,
            "kl_nats_per_token": kl / ex_tok,
            "windows": len(windows),
            "method": f"kvsim (one forward; sinks + residual {residual} exact, bs {block_size})",
        }
        rows.append(row)
        if progress is not None:
            progress(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    """Measure on a named model and write the rows as JSON."""
    from kvstrata.quality.calibrate import check_calibration
    from kvstrata.quality.evaluate import heldout_windows
    from kvstrata.workload.zoo import load_model, quiet_transformers

    p = argparse.ArgumentParser(prog="python -m kvstrata.bench.lowrank_heads")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--calibration", required=True)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--modes", default="", help="comma-separated modes to run (default all)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    quiet_transformers()
    model, tokenizer = load_model(args.model)
    cal = check_calibration(model, args.calibration)
    windows = heldout_windows(args.model, args.context, args.windows, tokenizer=tokenizer)
    modes = {m for m in args.modes.split(",") if m}

    def show(row: dict[str, Any]) -> None:
        print(json.dumps(row), flush=True)

    rows = measure(
        model,
        windows,
        cal,
        context=args.context,
        only=(lambda mode, _s: mode in modes) if modes else None,
        progress=show,
    )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
