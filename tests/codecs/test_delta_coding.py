"""Delta coding along tokens before byte planes + zstd (kvstrata.codecs.delta, disk_delta):
bit-exact for every dtype and codec, old KVZ1 frames still read, corrupt headers refused,
the disk tier's checksums still guard the stored bytes, and generation through a delta
coded disk tier gives DynamicCache's tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from hf_models import tiny_model
from kvstrata.codecs import compress as lossless
from kvstrata.codecs import delta
from kvstrata.codecs.delta import DeltaRegion
from kvstrata.codecs.int4 import Int4Codec
from kvstrata.codecs.registry import get_codec
from kvstrata.config import CacheConfig
from kvstrata.core.errors import BlockCorruptError, CodecError, ConfigError
from kvstrata.core.layout import KINDS, BlockLayout
from kvstrata.integrations.hf import TieredCache, enable
from kvstrata.tiers.disk import DiskTier
from kvstrata.tiers.disk_format import SlotFormat

pytest.importorskip("zstandard")

WORDS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@st.composite
def _buffer_and_regions(draw):
    """Random bytes holding 0-3 non-overlapping regions of random geometry."""
    regions, off = [], draw(st.integers(0, 8))
    for _ in range(draw(st.integers(0, 3))):
        word = draw(st.sampled_from(sorted(WORDS)))
        r = DeltaRegion(
            off,
            draw(st.integers(1, 3)),
            draw(st.integers(1, 9)),
            word * draw(st.integers(1, 5)),
            word,
        )
        regions.append(r)
        off += r.nbytes + draw(st.integers(0, 5))
    elem = draw(st.sampled_from([1, 2, 4]))
    size = -(-off // elem) * elem
    data = draw(st.binary(min_size=size, max_size=size))
    return np.frombuffer(data, dtype=np.uint8).copy(), regions, elem


@settings(max_examples=200, deadline=None)
@given(_buffer_and_regions())
def test_any_bytes_round_trip_exactly(case):
    raw, regions, elem = case
    coded = delta.encode(raw, regions)
    back = coded.copy()
    delta.decode(back, regions)
    assert np.array_equal(back, raw)
    frame = lossless.compress(raw, elem, delta=regions)
    assert frame[:4] == (b"KVZ2" if regions else b"KVZ1")
    out = np.empty_like(raw)
    lossless.decompress(frame, out)
    assert np.array_equal(out, raw)


@pytest.mark.parametrize("word", sorted(WORDS))
@pytest.mark.parametrize("offset", [0, 1])  # aligned words (torch's cumsum) or not (numpy's)
def test_full_range_words_wrap_exactly(word, offset):
    rng = np.random.default_rng(word)
    raw = rng.integers(0, 256, size=offset + 4 * 50 * 6 * word, dtype=np.uint8)
    regions = [DeltaRegion(offset, 4, 50, 6 * word, word)]
    back = delta.encode(raw, regions)
    delta.decode(back, regions)
    assert np.array_equal(back, raw)


def test_encode_is_the_integer_difference_of_neighbouring_rows():
    rows = np.array([[[1, 65535], [3, 0], [2, 5]]], dtype=np.uint16)  # [count, rows, cols]
    raw = rows.reshape(-1).view(np.uint8)
    coded = delta.encode(raw, [DeltaRegion(0, 1, 3, 4, 2)]).view(np.uint16).reshape(3, 2)
    assert coded.tolist() == [[1, 65535], [2, 1], [65535, 5]]  # mod 2^16


def _layer_bytes(fmt: SlotFormat, layout: BlockLayout, codec, seed: int) -> np.ndarray:
    """One layer of one block as the disk tier stages it: every field of K and V (of
    random K/V with outlier channels, NaN-free), 16-byte aligned regions."""
    g = torch.Generator().manual_seed(seed)
    buf = np.zeros(fmt.layer_bytes, dtype=np.uint8)
    for kind in KINDS:
        x = torch.randn(layout.raw_shape(kind, 1)[1:], generator=g) * 3
        x[..., 0] += 40  # an outlier channel, as keys have
        fields = codec.fields(kind, layout)
        enc = {
            f: torch.empty((layout.num_kv_heads, s.rows, s.cols), dtype=s.dtype)
            for f, s in fields.items()
        }
        codec.encode(kind, x.to(layout.dtype), enc)
        for key, _ in fmt.prefixed(kind):
            off, nbytes = fmt.regions[key]
            buf[off : off + nbytes] = enc[key.split(".", 1)[1]].view(torch.uint8).reshape(-1)
    return buf


COMBOS = [
    (dtype, codec)
    for dtype in (torch.float32, torch.float16, torch.bfloat16)
    for codec in ("none", "int8", "int4", "int4-g32", "fp8")
]


@pytest.mark.parametrize(("dtype", "codec_name"), COMBOS, ids=lambda v: str(v).split(".")[-1])
@pytest.mark.parametrize("kinds", [("k",), ("k", "v")])
def test_every_dtype_and_codec_round_trips_exactly(dtype, codec_name, kinds):
    layout = BlockLayout(num_layers=1, num_kv_heads=3, head_dim=64, block_size=64, dtype=dtype)
    codec = get_codec(codec_name)
    fmt = SlotFormat(layout, codec)
    regions = fmt.delta_regions(kinds)
    assert any(r.rows == 64 for r in regions)  # the data field at least
    raw = _layer_bytes(fmt, layout, codec, seed=len(kinds))
    frame = lossless.compress(raw, fmt.elem_size, delta=regions)
    out = np.zeros_like(raw)
    lossless.decompress(frame, out)
    assert np.array_equal(out, raw)
    assert not np.array_equal(delta.encode(raw, regions), raw)  # the transform did something


@pytest.mark.parametrize("word", [2, 4])
def test_special_float_bit_patterns_round_trip(word):
    dtype = {2: np.float16, 4: np.float32}[word]
    vals = np.array([np.nan, -np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-45, -1.5], dtype=dtype)
    raw = np.tile(vals, (2, 1)).T.copy().reshape(-1).view(np.uint8)  # [8 rows, 2 cols]
    regions = [DeltaRegion(0, 1, 8, 2 * word, word)]
    out = np.empty_like(raw)
    lossless.decompress(lossless.compress(raw, word, delta=regions), out)
    assert out.tobytes() == raw.tobytes()


# A KVZ1 frame written by the version before delta coding: compress(bytes(range(40)) * 2, 4).
OLD_FRAME = bytes.fromhex(
    "4b565a3104500000000000000028b52ffd20508d010084020004080c1014181c"
    "20240105090d1115191d212502060a0e12161a1e222603070b0f13171b1f2327"
    "04440a07008096"
)


def test_old_frames_still_decode():
    want = bytes(range(40)) * 2
    assert lossless.compress(want, 4) == OLD_FRAME  # the default writes KVZ1, unchanged
    out = bytearray(len(want))
    lossless.decompress(OLD_FRAME, out)
    assert bytes(out) == want


def test_corrupt_delta_headers_are_refused():
    raw = np.arange(256, dtype=np.uint8)
    frame = lossless.compress(raw, 2, delta=[DeltaRegion(0, 2, 8, 16, 2)])
    regions_at = 4 + 1 + 8 + 1
    cases = {
        "past": frame[:regions_at] + (250).to_bytes(4, "little") + frame[regions_at + 4 :],
        "bad region": frame[: regions_at + 10] + b"\x03" + frame[regions_at + 11 :],
        "shorter": frame[: regions_at + 5],
    }
    for what, bad in cases.items():
        with pytest.raises(CodecError, match="corrupt frame header|shorter than"):
            lossless.decompress(bad, np.empty(256, dtype=np.uint8))
        assert what
    with pytest.raises(CodecError, match="overlaps"):
        lossless.compress(raw, 2, delta=[DeltaRegion(0, 1, 8, 16, 2), DeltaRegion(64, 1, 8, 32, 2)])
    with pytest.raises(CodecError, match="bad region"):
        lossless.compress(raw, 2, delta=[DeltaRegion(0, 1, 8, 3, 2)])


def test_measure_rows_on_given_kv():
    from kvstrata.bench.delta import measure

    g = torch.Generator().manual_seed(0)
    k = torch.randn(2, 2, 256, 64, generator=g) + torch.linspace(-40, 40, 64)
    v = torch.randn(2, 2, 256, 64, generator=g)
    rows = measure("given", 256, dtypes=("fp16",), codecs=("int8", "int4"), repeats=1, kv=(k, v))
    got = {(r["dtype/codec"], r["kind"], r["mode"]) for r in rows}
    assert ("fp16/none", "k", "ord") in got and ("fp32/int4", "v", "nibble") in got
    assert ("fp16/none", "v", "planes") in got and ("fp32/int8", "k", "xor") in got
    assert ("fp32/int8", "k", "ord") not in got and ("fp16/none", "k", "nibble") not in got
    for r in rows:
        assert r["ratio"] == pytest.approx(r["bytes_per_token_zstd"] / r["bytes_per_token_delta"])
        assert r["pays"] == (r["ratio"] > 1)
        assert r["kept"] == (r["mode"] == "sub" and r["kind"] == "k")
        assert r["encode_ms_per_block"] > 0 and r["decode_ms_per_block"] > 0
    raw = {r["dtype/codec"]: r["bytes_per_token_raw"] for r in rows if r["kind"] == "k"}
    assert raw["fp16/none"] == 2 * 2 * 64 * 2  # layers * heads * dim * 2 bytes
    assert raw["fp32/int8"] == 2 * 2 * (64 + 4)  # the codes; fp16 scale and zero per token
    with pytest.raises(ConfigError, match="^variants='zip' is invalid"):
        measure("given", 256, variants=("zip",), kv=(k, v))


# -- the disk tier ------------------------------------------------------------------------
LAYOUT = BlockLayout(num_layers=3, num_kv_heads=2, head_dim=32, block_size=16)


def _kv(layout: BlockLayout, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # few distinct values (so that even int4 codes compress) + per-channel offsets in keys
    k = torch.randn(layout.raw_shape("k", n), generator=g).round()
    k = (k + torch.linspace(-30, 30, layout.head_dim) ** 3 / 900).to(layout.dtype)
    v = torch.randn(layout.raw_shape("v", n), generator=g).round().to(layout.dtype)
    return k, v


def _magic(tier: DiskTier, slot: int) -> bytes:
    with open(tier.path, "rb") as f:
        f.seek(slot * tier.slot_bytes)
        return f.read(4)


@pytest.mark.parametrize("codec_name", ["none", "int8", "int4-g16"])
def test_disk_tier_round_trip_and_mixed_frames(tmp_path, codec_name):
    codec = Int4Codec(16) if codec_name == "int4-g16" else get_codec(codec_name)
    k, v = _kv(LAYOUT, 4)
    with DiskTier(LAYOUT, 6, tmp_path, codec, compress=True) as old:
        old.write_blocks([0, 1], k[:, :, :32], v[:, :, :32])  # KVZ1 frames
        old.put_keys([(0, b"a" * 16, [1] * 16), (1, b"b" * 16, [2] * 16)])  # kept on reopen
        assert _magic(old, 0) == b"KVZ1"
    want_k, want_v = torch.empty_like(k), torch.empty_like(v)
    plain = DiskTier(LAYOUT, 6, tmp_path / "ref", codec)
    plain.write_blocks([0, 1, 2, 3], k, v)
    plain.read_blocks([0, 1, 2, 3], want_k, want_v)  # what the codec gives back
    plain.close()
    tier = DiskTier(LAYOUT, 6, tmp_path, codec, compress=True, delta=True)
    tier.write_blocks([2, 3], k[:, :, 32:], v[:, :, 32:])  # KVZ2 frames next to them
    assert _magic(tier, 2) == b"KVZ2"
    k_out, v_out = torch.zeros_like(k), torch.zeros_like(v)
    tier.read_blocks([0, 1, 2, 3], k_out, v_out)
    assert torch.equal(k_out, want_k) and torch.equal(v_out, want_v)
    kl, vl = torch.zeros_like(k[1]), torch.zeros_like(v[1])
    tier.read_layer(1, [0, 1, 2, 3], kl, vl)
    assert torch.equal(kl, want_k[1]) and torch.equal(vl, want_v[1])
    # a corrupt delta coded layer is caught by the tier's checksum, never decoded
    lens = tier._lens[3]
    pos = 3 * tier.slot_bytes + int(lens[0]) + 20  # inside layer 1's frame
    with open(tier.path, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 0x10]))
    tier.read_layer(0, [3], kl[:, :16], vl[:, :16])
    with pytest.raises(BlockCorruptError) as info:
        tier.read_layer(1, [3], kl[:, :16], vl[:, :16])
    assert info.value.slots == [3]
    tier.close()


def test_bad_option_values_are_one_line_config_errors(tmp_path):
    cases = [
        (lambda: CacheConfig(disk_delta="yes", disk_dir=str(tmp_path), disk_budget="1MiB"),
         "disk_delta='yes' is invalid: True or False"),
        (lambda: CacheConfig(disk_delta=True, disk_dir=str(tmp_path), disk_budget="1MiB"),
         "disk_delta=True is invalid: it codes blocks for disk compression: set disk_compress"),
        (lambda: DiskTier(LAYOUT, 2, tmp_path, delta=True), "delta=True is invalid: "),
        (lambda: DiskTier(LAYOUT, 2, tmp_path, compress=True, delta=1), "delta=1 is invalid"),
    ]  # fmt: skip
    for make, says in cases:
        with pytest.raises(ConfigError) as info:
            make()
        assert str(info.value).startswith(says), str(info.value)
        assert "\n" not in str(info.value)
    cfg = CacheConfig(disk_dir=str(tmp_path), disk_budget="1MiB", disk_compress=True)
    assert cfg.disk_delta is False  # the default stays as before
    assert cfg.replace(disk_delta=True).disk_delta is True


# -- generation through a delta coded disk tier -------------------------------------------
PROMPT_LEN, NEW_TOKENS = 1024, 120


def _greedy(model, ids, cache, n=NEW_TOKENS):
    return model.generate(ids, cache=cache, max_new_tokens=n, min_new_tokens=n, do_sample=False)


def _disk_cache(model, directory, **kw) -> TieredCache:
    """16 KiB blocks: 8 fit on the host, the oldest ~half of the 20 blocks go to disk."""
    return TieredCache(
        model.config,
        block_size=64,
        max_tokens=1536,
        resident_fraction=0.1,
        host_budget="128KiB",
        disk_dir=str(directory),
        disk_budget="4MiB",
        disk_compress=True,
        **kw,
    )


def _frames(cache: TieredCache) -> list[bytes]:
    """The magic of layer 0's frame of every written, compressed disk slot."""
    disk = cache.manager.state.tiers["disk"]
    used = [s for s in range(disk.num_slots) if disk._index.written[s]]
    return [_magic(disk, s) for s in used if disk._lens[s, 0] < disk.layer_bytes]


@pytest.mark.parametrize("disk_codec", ["none", "int8"])
def test_generation_through_delta_disk_matches(tmp_path, disk_codec):
    """Lossless disk codec: DynamicCache's tokens; int8: the tokens of the same cache
    without delta coding (delta coding is lossless on top of any codec)."""
    model = tiny_model("llama", "sdpa")
    ids = torch.randint(3, 97, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
    ref = _greedy(model, ids, DynamicCache(config=model.config))
    flipped = ids.clone()
    flipped[0, :32] = (flipped[0, :32] + 1 - 3) % 94 + 3
    alt = _greedy(model, flipped, DynamicCache(config=model.config), n=40)
    assert not torch.equal(alt[:, PROMPT_LEN:], ref[:, PROMPT_LEN : PROMPT_LEN + 40])
    enable(model)
    try:
        if disk_codec != "none":
            base = _disk_cache(model, tmp_path / "plain", disk_codec=disk_codec, residual_tokens=0)
            ref = _greedy(model, ids, base)
            assert _frames(base) and set(_frames(base)) == {b"KVZ1"}
        cache = _disk_cache(
            model, tmp_path / "delta", disk_codec=disk_codec, disk_delta=True, residual_tokens=0
        )
        out = _greedy(model, ids, cache)
        assert _frames(cache) and set(_frames(cache)) == {b"KVZ2"}
        assert cache.manager.state.tiers["disk"].stats.blocks_read > 0  # tokens came back from disk
    finally:
        model.set_attn_implementation("sdpa")
    assert torch.equal(out, ref), (out != ref).nonzero()[:5].tolist()
