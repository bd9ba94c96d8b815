"""Delta coding along tokens before byte planes + zstd, measured on a model's real K/V.

`measure(model, context)` runs the model (fp32, exact) over `context` tokens of
held-out text, takes every layer's keys and values from the DynamicCache, stores them
as the disk tier would (per block and layer, each codec's fields 16-byte aligned, one
frame per (block, layer, kind), the raw bytes kept when a frame would not be smaller)
and compares, for every dtype/codec and delta variant, the bytes per token of
today's byte-plane zstd (`disk_compress`, KVZ1 frames) with delta coding first:

    sub     each token's row minus the previous one as unsigned integers of the
            field's element size (kvstrata.codecs.delta): what `disk_delta` applies,
            to keys only
    xor     XOR with the previous row's bit pattern
    planes  `sub` byte by byte (no carries between the bytes of a word: the delta of
            each byte plane along tokens) (raw floats)
    ord     `sub` after an order-preserving map of float bit patterns (raw floats)
    nibble  `sub` per 4-bit code (int4: two codes per byte) instead of per byte

Every variant is decoded again and checked bit-exact. The variants other than `sub`
exist only here: each is headed by the same region table as `sub` (the bytes a frame
would need to say so) and timed with its numpy transform. Timings are medians of
interleaved rounds on whatever machine runs this: compare them with the zstd columns
of the same row, not across machines.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvstrata.codecs import compress as lossless
from kvstrata.codecs import delta
from kvstrata.codecs.delta import DeltaRegion
from kvstrata.codecs.registry import get_codec
from kvstrata.core.errors import ConfigError
from kvstrata.core.layout import BlockLayout

RAW_DTYPES = ("fp32", "bf16", "fp16")
CODECS = ("int8", "int4", "int4-g32", "fp8")  # quantized from the fp32 K/V
VARIANTS = ("sub", "xor", "planes", "ord", "nibble")
KEPT = "sub"  # the variant the disk tier applies (disk_delta), to keys
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_ALIGN = 16


def capture_kv(model: str | Path, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [layers, kv heads, context, head dim] (fp32, post-RoPE, as the
    cache stores them) of one exact forward pass over held-out text."""
    from transformers import DynamicCache

    from kvstrata.quality.evaluate import heldout_stream
    from kvstrata.workload.zoo import EMBEDDED_NAMES, load_model

    lm, tokenizer = load_model(model)
    stream = heldout_stream(model, None if str(model) in EMBEDDED_NAMES else tokenizer)
    if len(stream) < context:
        raise ConfigError.field(
            "context", context, f"the held-out text has {len(stream)} tokens; use fewer"
        )
    cache = DynamicCache(config=lm.config)
    with torch.no_grad():
        lm(torch.tensor([stream[:context]]), cache=cache)
    k = torch.stack([layer.keys[0] for layer in cache.layers])
    v = torch.stack([layer.values[0] for layer in cache.layers])
    return k.float(), v.float()


def _frames(
    x: torch.Tensor, kind: str, label: str, block_size: int
) -> tuple[np.ndarray, tuple[DeltaRegion, ...], int]:
    """x [L, Hkv, T, D] stored as `label` ("fp32" ... or a codec name): per (block,
    layer) buffers [n, L, nbytes] of the kind's fields (16-byte aligned, the disk
    tier's order), their delta regions, and the compressor's element size."""
    L, hkv, t, d = x.shape
    n = t // block_size
    dtype = _DTYPES.get(label, torch.float32)
    codec = get_codec("none" if label in _DTYPES else label)
    layout = BlockLayout(1, hkv, d, block_size, dtype)
    specs = codec.fields(kind, layout)
    encs = {
        name: torch.empty((L, hkv, n * spec.rows, spec.cols), dtype=spec.dtype)
        for name, spec in specs.items()
    }
    codec.encode(kind, x[:, :, : n * block_size].to(dtype), encs)
    parts, regions, off = [], [], 0
    for name, spec in specs.items():
        parts.append((spec, encs[name], off))
        if spec.rows > 1:
            word = encs[name].element_size()
            regions.append(DeltaRegion(off, hkv, spec.rows, spec.nbytes // spec.rows, word))
        off += -(-hkv * spec.nbytes // _ALIGN) * _ALIGN
    buf = np.zeros((n, L, off), dtype=np.uint8)
    for spec, enc, at in parts:
        rb = spec.nbytes // spec.rows
        b = enc.view(torch.uint8).numpy().reshape(L, hkv, n, spec.rows * rb)
        buf[:, :, at : at + hkv * spec.nbytes] = b.transpose(2, 0, 1, 3).reshape(n, L, -1)
    biggest = max(specs.values(), key=lambda s: s.nbytes)
    elem = torch.empty((), dtype=biggest.dtype).element_size()
    return buf, tuple(regions), elem


# -- the variants only measured here --------------------------------------------------
def _sign_flip(w: np.ndarray) -> np.ndarray:
    """Order-preserving map of float bit patterns to unsigned integers: negative
    values have every bit flipped, non-negative ones only the sign bit. Its own
    inverse up to which bit is tested: see `_unflip`."""
    top = w.dtype.type(1) << w.dtype.type(8 * w.itemsize - 1)
    return np.where(w & top, ~w, w | top)


def _unflip(w: np.ndarray) -> np.ndarray:
    top = w.dtype.type(1) << w.dtype.type(8 * w.itemsize - 1)
    return np.where(w & top, w & ~top, ~w)


def _transform(buf: np.ndarray, regions: Sequence[DeltaRegion], mode: str) -> np.ndarray:
    out = buf.copy()
    for r in regions:
        src, dst = delta._words(buf, r), delta._words(out, r)
        if mode == "sub" or (mode == "nibble" and r.word != 1):  # nibbles: the codes only
            np.subtract(src[:, 1:], src[:, :-1], out=dst[:, 1:])
        elif mode == "xor":
            np.bitwise_xor(src[:, 1:], src[:, :-1], out=dst[:, 1:])
        elif mode == "ord":
            m = _sign_flip(src)
            dst[:, :1] = m[:, :1]
            np.subtract(m[:, 1:], m[:, :-1], out=dst[:, 1:])
        elif mode == "nibble":
            lo = ((src[:, 1:] & 15) - (src[:, :-1] & 15)) & 15
            hi = ((src[:, 1:] >> 4) - (src[:, :-1] >> 4)) & 15
            dst[:, 1:] = lo | (hi << 4)
    return out


def _untransform(buf: np.ndarray, regions: Sequence[DeltaRegion], mode: str) -> None:
    for r in regions:
        w = delta._words(buf, r)
        if mode == "sub" or (mode == "nibble" and r.word != 1):
            np.cumsum(w, axis=1, dtype=w.dtype, out=w)
        elif mode == "xor":
            np.bitwise_xor.accumulate(w, axis=1, out=w)
        elif mode == "ord":
            np.cumsum(w, axis=1, dtype=w.dtype, out=w)
            w[:] = _unflip(w)
        elif mode == "nibble":
            lo = np.cumsum(w & 15, axis=1, dtype=w.dtype) & 15
            hi = np.cumsum(w >> 4, axis=1, dtype=w.dtype) & 15
            w[:] = lo | (hi << 4)


def _codec_pair(
    mode: str, regions: tuple[DeltaRegion, ...], elem: int, level: int
) -> tuple[Callable[[np.ndarray], bytes], Callable[[bytes, np.ndarray], None], int]:
    """(encode, decode, extra header bytes) of one frame for `mode`."""
    if mode == "zstd":
        return (lambda b: lossless.compress(b, elem, level)), lossless.decompress, 0
    if mode in (KEPT, "planes"):  # real KVZ2 frames; planes: every word a byte
        coded = regions if mode == KEPT else tuple(r._replace(word=1) for r in regions)
        enc = lambda b: lossless.compress(b, elem, level, delta=coded)  # noqa: E731
        return enc, lossless.decompress, 0

    def dec(frame: bytes, out: np.ndarray) -> None:
        lossless.decompress(frame, out)
        _untransform(out, regions, mode)

    enc = lambda b: lossless.compress(_transform(b, regions, mode), elem, level)  # noqa: E731
    return enc, dec, len(delta.pack(regions))


def _applies(mode: str, label: str) -> bool:
    if mode in ("ord", "planes"):
        return label in _DTYPES
    if mode == "nibble":
        return label.startswith("int4")
    return mode in ("zstd", KEPT, "xor")


def _one(
    buf: np.ndarray,
    regions: tuple[DeltaRegion, ...],
    elem: int,
    modes: list[str],
    level: int,
    repeats: int,
) -> dict[str, tuple[int, float, float]]:
    """mode -> (stored bytes of all frames, encode s, decode s per pass over them)."""
    n, L, nbytes = buf.shape
    pairs = {m: _codec_pair(m, regions, elem, level) for m in modes}
    frames: dict[str, list[bytes]] = {}
    size: dict[str, int] = {}
    enc_t: dict[str, list[float]] = {m: [] for m in modes}
    dec_t: dict[str, list[float]] = {m: [] for m in modes}
    out = np.empty(nbytes, dtype=np.uint8)
    for rep in range(repeats):
        for m in modes[rep % len(modes) :] + modes[: rep % len(modes)]:  # rotate
            enc, dec, extra = pairs[m]
            t0 = time.perf_counter()
            fr = [enc(buf[i, j]) for i in range(n) for j in range(L)]
            enc_t[m].append(time.perf_counter() - t0)
            frames[m] = fr
            size[m] = sum(min(len(f) + extra, nbytes) for f in fr)
            t0 = time.perf_counter()
            for f in fr:
                dec(f, out)
            dec_t[m].append(time.perf_counter() - t0)
    for m in modes:  # every frame decodes to its bytes exactly
        for f, want in zip(frames[m], buf.reshape(-1, nbytes), strict=True):
            pairs[m][1](f, out)
            if not np.array_equal(out, want):
                raise AssertionError(f"delta variant {m!r} is not lossless")
    return {m: (size[m], statistics.median(enc_t[m]), statistics.median(dec_t[m])) for m in modes}


def measure(
    model: str | Path = "smollm2",
    context: int = 2048,
    *,
    block_size: int = 64,
    dtypes: Sequence[str] = RAW_DTYPES,
    codecs: Sequence[str] = CODECS,
    variants: Sequence[str] = VARIANTS,
    level: int = lossless.DEFAULT_LEVEL,
    repeats: int = 3,
    kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> list[dict[str, Any]]:
    """Bytes per token and cost of delta coding vs today's byte-plane zstd.

    Args:
        model: a model name or directory (kvstrata.workload.zoo), run in fp32.
        context: tokens of held-out text (whole blocks of them are measured).
        block_size: tokens per block (the frames are per block and layer).
        dtypes: raw storage dtypes ("fp32", "bf16", "fp16"), K/V cast from fp32.
        codecs: quantizing codecs (registry names), encoding the fp32 K/V.
        variants: delta variants (see the module docstring; `sub` is the kept one).
        level: zstd level.
        repeats: interleaved timing rounds (medians).
        kv: (k, v) [L, Hkv, T, D] to use instead of running the model.

    Returns:
        One row per (dtype/codec, kind, variant that applies): "mode", "kind" ("k"
        or "v"), "dtype/codec", "bytes_per_token_raw" / "_zstd" / "_delta" (all
        layers and kv heads of that kind), "ratio" (zstd bytes / delta bytes: above
        1 the delta variant is smaller), "pays" (ratio > 1), "kept" (the variant
        `disk_delta` applies to this kind), "encode_ms_per_block" /
        "decode_ms_per_block" (delta + planes + zstd, one block = every layer of
        that kind) and "zstd_encode_ms_per_block" / "zstd_decode_ms_per_block"
        (today's), plus "model", "context", "block_size", "tokens".
    """
    if isinstance(context, bool) or not isinstance(context, int) or context < block_size:
        raise ConfigError.field("context", context, f"at least one block ({block_size} tokens)")
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise ConfigError.field("variants", bad[0], f"one of {', '.join(VARIANTS)}")
    k, v = kv if kv is not None else capture_kv(model, context)
    k, v = k[:, :, :context], v[:, :, :context]
    tokens = k.shape[2] // block_size * block_size
    rows: list[dict[str, Any]] = []
    for label in [*dtypes, *codecs]:
        for kind, x in (("k", k), ("v", v)):
            buf, regions, elem = _frames(x, kind, label, block_size)
            modes = ["zstd"] + [m for m in variants if _applies(m, label)]
            got = _one(buf, regions, elem, modes, level, repeats)
            n = buf.shape[0]
            base, base_enc, base_dec = got["zstd"]
            name = label if label in _DTYPES else f"fp32/{label}"
            for m in modes[1:]:
                size, enc, dec = got[m]
                rows.append(
                    {
                        "model": str(model),
                        "context": context,
                        "block_size": block_size,
                        "tokens": tokens,
                        "mode": m,
                        "kind": kind,
                        "dtype/codec": name if "/" in name else f"{name}/none",
                        "bytes_per_token_raw": buf.size / tokens,
                        "bytes_per_token_zstd": base / tokens,
                        "bytes_per_token_delta": size / tokens,
                        "ratio": base / size,
                        "pays": base > size,
                        "kept": m == KEPT and kind == "k",
                        "encode_ms_per_block": 1e3 * enc / n,
                        "decode_ms_per_block": 1e3 * dec / n,
                        "zstd_encode_ms_per_block": 1e3 * base_enc / n,
                        "zstd_decode_ms_per_block": 1e3 * base_dec / n,
                    }
                )
    return rows
