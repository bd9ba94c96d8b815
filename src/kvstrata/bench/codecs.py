"""`kvstrata bench codecs`: codec speed vs `copy_`, error, and lossless ratio.

For every codec: encode and decode GB/s (of model-dtype bytes) on one large run of
blocks with preallocated outputs, next to `copy_` of the same tensor, the three
interleaved and repeated (medians); bits per element; and the relative error of the
attention output on synthetic K/V with realistic outliers (newest `residual`
tokens kept exact, as the cache does). Then the lossless compressor's ratio and
GB/s on K/V from a tiny random-init Llama forward pass (or `--model-dir`).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

import torch

from kvstrata.bench._timing import check_positive, median_seconds
from kvstrata.codecs.registry import get_codec
from kvstrata.core.layout import BlockLayout

NAME = "codecs"
HELP = "codec encode/decode GB/s vs copy_, attention error, lossless ratio"
DEFAULT_CODECS = "fp8,int8,int4,int4-g32,int4-g128"
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def synthetic_kv(
    heads: int,
    tokens: int,
    dim: int,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    outlier_scale: tuple[float, float] = (10.0, 50.0),
) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V [heads, tokens, dim] shaped like real LLM caches.

    Keys have a per-channel offset and a few outlier channels scaled by
    `outlier_scale` (default x10-x50; the
    reason KIVI quantizes keys per channel); values have a few outlier tokens x10.

    Returns:
        (k, v) in `dtype`.
    """
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(heads, tokens, dim, generator=gen)
    k += torch.randn(heads, 1, dim, generator=gen) * 2
    outlier_ch = torch.randperm(dim, generator=gen)[: max(2, dim // 32)]
    k[..., outlier_ch] *= torch.linspace(*outlier_scale, len(outlier_ch))
    v = torch.randn(heads, tokens, dim, generator=gen)
    outlier_tok = torch.randperm(tokens, generator=gen)[: max(1, tokens // 64)]
    v[:, outlier_tok] *= 10
    return k.to(dtype), v.to(dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v in fp32; q [H, Q, D], k/v [H, T, D]."""
    scores = q.float() @ k.float().transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.softmax(scores, dim=-1) @ v.float()


def roundtrip(codec_name: str, kind: str, x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Encode then decode x [H, T, D] (T a multiple of block_size) with a codec."""
    codec = get_codec(codec_name)
    heads, tokens, dim = x.shape
    layout = BlockLayout(1, heads, dim, block_size, x.dtype)
    blocks = tokens // block_size
    enc = {
        name: torch.empty(heads, blocks * spec.rows, spec.cols, dtype=spec.dtype)
        for name, spec in codec.fields(kind, layout).items()
    }
    codec.encode(kind, x, enc)
    out = torch.empty_like(x)
    codec.decode(kind, enc, out)
    return out


def attention_rel_error(
    codec_name: str,
    *,
    heads: int = 2,
    tokens: int = 1024,
    dim: int = 128,
    block_size: int | None = None,
    residual: int = 128,
    queries: int = 16,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    logit_std: float = 2.0,
    outlier_scale: tuple[float, float] = (10.0, 50.0),
) -> float:
    """Relative L2 error of the attention output when the older tokens pass through a codec.

    The newest `residual` tokens stay exact (the full-precision residual window);
    queries are random, scaled so that the exact logits have std `logit_std`.

    Returns:
        ||o_codec - o_exact|| / ||o_exact||.
    """
    block_size = block_size or block_size_for(codec_name, dim)
    k, v = synthetic_kv(heads, tokens, dim, seed=seed, dtype=dtype, outlier_scale=outlier_scale)
    q = torch.randn(heads, queries, dim, generator=torch.Generator().manual_seed(seed + 1))
    # Scale the random queries so the exact logits have std `logit_std` (trained heads
    # sit around 1-3); unscaled random queries against x50 outlier channels give
    # near one-hot softmaxes that no real head has.
    logits = q @ k.float().transpose(-1, -2) / math.sqrt(dim)
    q = q * (logit_std / logits.std())
    old = tokens - residual
    k2, v2 = k.clone(), v.clone()
    k2[:, :old] = roundtrip(codec_name, "k", k[:, :old].contiguous(), block_size)
    v2[:, :old] = roundtrip(codec_name, "v", v[:, :old].contiguous(), block_size)
    exact = attention(q, k, v)
    return float((attention(q, k2, v2) - exact).norm() / exact.norm())


def block_size_for(codec_name: str, head_dim: int = 128) -> int:
    """The smallest of 64/128/256 tokens per block that the codec accepts."""
    codec = get_codec(codec_name)
    for block_size in (64, 128, 256):
        try:
            codec.validate(BlockLayout(1, 1, head_dim, block_size))
        except ValueError:
            continue
        return block_size
    return 64


def bench_codec(name: str, dtype: torch.dtype, size_mib: int, repeats: int) -> dict:
    """Encode/decode/copy_ GB/s of one codec on ~size_mib MiB of K (and V) blocks."""
    codec = get_codec(name)
    layout = BlockLayout(32, 8, 128, block_size_for(name), dtype)
    per_block = layout.raw_block_bytes // 2  # one kind
    blocks = max(1, size_mib * 2**20 // per_block)
    row = {"codec": name, "bits": codec.bits_per_element(layout)}
    for kind in ("k", "v"):
        k, v = synthetic_kv(32 * 8, blocks * layout.block_size, 128, dtype=dtype)
        x = (k if kind == "k" else v).view(*layout.raw_shape(kind, blocks))
        enc = {
            f: torch.empty(32, 8, blocks * s.rows, s.cols, dtype=s.dtype)
            for f, s in codec.fields(kind, layout).items()
        }
        y = torch.empty_like(x)
        codec.encode(kind, x, enc)  # warm-up: builds/loads the kernels once
        codec.decode(kind, enc, y)
        t = median_seconds(
            {
                "copy": lambda x=x, y=y: y.copy_(x),
                "enc": lambda x=x, enc=enc, kind=kind: codec.encode(kind, x, enc),
                "dec": lambda y=y, enc=enc, kind=kind: codec.decode(kind, enc, y),
            },
            repeats,
        )
        for key, sec in t.items():
            row.setdefault(key, []).append(x.nbytes / sec / 1e9)
    for key in ("copy", "enc", "dec"):
        row[key] = statistics.mean(row[key])
    row["enc_ratio"] = row["enc"] / row["copy"]
    row["dec_ratio"] = row["dec"] / row["copy"]
    row["attn_rel_err"] = attention_rel_error(name, dtype=dtype)
    return row


def model_kv(model_dir: str | None, tokens: int = 512) -> torch.Tensor:
    """fp16 K/V bytes from one forward pass of a model ([layers*2, B, H, T, D] stacked).

    Without `model_dir`, a tiny random-init LlamaForCausalLM (4 layers, hidden 256)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if model_dir:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    else:
        cfg = LlamaConfig(
            vocab_size=1000,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            initializer_range=0.3,
        )
        model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens))
    with torch.no_grad():
        cache = model(ids, use_cache=True).cache
    parts = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    return torch.stack(parts).to(torch.float16)


def bench_lossless(model_dir: str | None, repeats: int) -> dict:
    """Ratio and GB/s of `compress`/`decompress` on a model's fp16 K/V."""
    import numpy as np

    from kvstrata.codecs import compress as lossless

    raw = model_kv(model_dir).numpy()
    out = np.empty_like(raw)
    frame = lossless.compress(raw, 2)
    t = median_seconds(
        {
            "compress": lambda: lossless.compress(raw, 2),
            "decompress": lambda: lossless.decompress(frame, out),
        },
        repeats,
    )
    assert np.array_equal(out.view(np.uint16), raw.view(np.uint16))
    import zstandard

    plain = len(zstandard.ZstdCompressor(level=lossless.DEFAULT_LEVEL).compress(raw.tobytes()))
    return {
        "nbytes": raw.nbytes,
        "ratio": lossless.ratio(raw.nbytes, frame),
        "ratio_zstd_only": raw.nbytes / plain,
        "compress_gbs": raw.nbytes / t["compress"] / 1e9,
        "decompress_gbs": raw.nbytes / t["decompress"] / 1e9,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--codecs", default=DEFAULT_CODECS, help="comma-separated codec names")
    parser.add_argument("--dtype", default="fp16", choices=sorted(_DTYPES), help="dtype of the K/V")
    parser.add_argument("--size-mib", type=int, default=64, help="model-dtype MiB per kind")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (median)")
    parser.add_argument("--model-dir", default=None, help="HF model for the lossless K/V")
    parser.add_argument("--no-lossless", action="store_true", help="skip the zstd part")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


def run(args: argparse.Namespace) -> int:
    """Run the codec benchmark and print a table (or JSON)."""

    check_positive(args, "size_mib", "repeats")
    dtype = _DTYPES[args.dtype]
    rows = [
        bench_codec(n.strip(), dtype, args.size_mib, args.repeats)
        for n in args.codecs.split(",")
        if n.strip()
    ]
    lossless = None if args.no_lossless else bench_lossless(args.model_dir, args.repeats)
    if args.json:
        print(json.dumps({"dtype": args.dtype, "codecs": rows, "lossless": lossless}, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"codecs, {args.dtype}, {args.size_mib} MiB per kind (medians)")
    for col in (
        "codec",
        "enc GB/s",
        "dec GB/s",
        "copy GB/s",
        "enc/copy",
        "dec/copy",
        "bits/elem",
        "attn rel err",
    ):
        table.add_column(col, justify="left" if col == "codec" else "right")
    for r in rows:
        table.add_row(
            r["codec"],
            f"{r['enc']:.2f}",
            f"{r['dec']:.2f}",
            f"{r['copy']:.2f}",
            f"{r['enc_ratio']:.2f}x",
            f"{r['dec_ratio']:.2f}x",
            f"{r['bits']:.3f}",
            f"{100 * r['attn_rel_err']:.2f} %",
        )
    console = Console()
    console.print(table)
    if lossless:
        console.print(
            f"lossless (byte planes + zstd) on {lossless['nbytes'] / 2**20:.1f} MiB fp16 K/V: "
            f"ratio {lossless['ratio']:.3f} (zstd alone {lossless['ratio_zstd_only']:.3f}), "
            f"compress {lossless['compress_gbs']:.2f} GB/s, "
            f"decompress {lossless['decompress_gbs']:.2f} GB/s"
        )
    return 0
