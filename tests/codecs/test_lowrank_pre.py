"""`lowrank-pre-*` (issue #27): low-rank keys in the pre-RoPE frame, each block's start
found from its keys (codecs/_rope.py) since no caller gives a codec positions."""

from __future__ import annotations

import math

import pytest
import torch

from hf_models import seeded_ids, tiny_model
from kvstrata.codecs._rope import RopeFrame, frame_from_rotary
from kvstrata.codecs.calibration import Calibration, load_calibration, save_calibration
from kvstrata.codecs.lowrank import LowRankCodec
from kvstrata.codecs.registry import get_codec
from kvstrata.config import CacheConfig
from kvstrata.core.errors import CodecError, ConfigError
from kvstrata.core.layout import BlockLayout
from kvstrata.quality import kvsim
from kvstrata.quality.calibrate import calibrate

BS, D, H, R = 16, 16, 2, 4


def _code(codec, x, layout):
    fields = {
        f: torch.empty((*x.shape[:-2], x.shape[-2] // BS * s.rows, s.cols), dtype=s.dtype)
        for f, s in codec.fields("k", layout).items()
    }
    codec.encode("k", x, fields)
    out = torch.empty_like(x)
    codec.decode("k", fields, out)
    return fields, out


def _rotate(pre: torch.Tensor, pos: torch.Tensor, freq: torch.Tensor, scale: float):
    """HF rotate-half RoPE of pre [..., T, D] at positions pos [T] (fp64 reference)."""
    ang = pos.double()[:, None] * freq.double()
    cos = torch.cat([ang.cos(), ang.cos()], -1) * scale
    sin = torch.cat([ang.sin(), ang.sin()], -1) * scale
    x = pre.double()
    half = torch.cat([-x[..., D // 2 :], x[..., : D // 2]], -1)
    return (x * cos + half * sin).float()


@pytest.fixture(scope="module")
def synthetic():
    """A model whose pre-RoPE keys lie exactly in mean + a rank-R subspace per head, and
    a calibration file that knows that subspace and the rope frame."""
    g = torch.Generator().manual_seed(0)
    layers = 2
    freq = 10000.0 ** (-torch.arange(0, D, 2).double() / D)
    basis = torch.linalg.qr(torch.randn(layers, H, D, D, generator=g))[0]
    mean = torch.randn(layers, H, D, generator=g) * 3  # a strong mean, as real models have
    tensors = {}
    for what in ("k", "v", "kpre"):
        tensors[f"{what}_mean"] = mean if what == "kpre" else torch.zeros(layers, H, D)
        tensors[f"{what}_basis"] = basis if what == "kpre" else torch.eye(D).expand(layers, H, D, D)
        tensors[f"{what}_sv"] = torch.ones(layers, H, D)
    tensors["rope_freq"] = freq[None].expand(layers, -1).float()
    tensors["rope_scale"] = torch.tensor([1.0, 1.25])  # a rotary with attention scaling
    cal = Calibration("synthetic", "synthetic0001", tensors, {"max_positions": "4096"})

    def keys(starts: list[int]) -> torch.Tensor:
        """Post-RoPE keys [L, H, len(starts) * BS, D]: block i holds positions
        starts[i] .. starts[i] + BS - 1."""
        n = len(starts) * BS
        coef = torch.randn(layers, H, n, R, generator=g) * 2
        pre = coef @ basis[..., :R].transpose(-1, -2) + mean[:, :, None]
        pos = torch.cat([torch.arange(s, s + BS) for s in starts])
        return torch.stack(
            [_rotate(pre[i], pos, freq, float(tensors["rope_scale"][i])) for i in range(layers)]
        )

    return cal, keys


def test_the_frame_is_read_off_the_models_rotary():
    model = tiny_model("llama", num_hidden_layers=1)
    x = torch.zeros(1, 40, model.config.hidden_size)
    pos = torch.arange(40)[None]
    cos, sin = model.model.rotary_emb(x, pos)
    found = frame_from_rotary(cos[0], sin[0])
    assert found is not None
    freq, scale = found
    inv = model.model.rotary_emb.inv_freq.double()
    assert scale == pytest.approx(model.model.rotary_emb.attention_scaling)
    assert torch.allclose(freq, inv, rtol=1e-5, atol=1e-7)
    # tables in bf16 (a bf16 model's): the frequencies still to ~1e-5 over 2k positions
    x16 = torch.zeros(1, 2048, model.config.hidden_size, dtype=torch.bfloat16)
    cos16, sin16 = model.model.rotary_emb(x16, torch.arange(2048)[None])
    assert cos16.dtype == torch.bfloat16
    found16 = frame_from_rotary(cos16[0], sin16[0])
    assert found16 is not None
    assert torch.allclose(found16[0], inv, atol=2e-5)
    # not rotate-half (interleaved pairs), or a single position: no frame
    inter = cos[0].reshape(40, 2, -1).transpose(1, 2).reshape(40, -1)
    assert frame_from_rotary(inter, inter) is None
    assert frame_from_rotary(cos[0, :1], sin[0, :1]) is None


def test_a_turn_and_its_inverse_are_exact_and_match_hf_rope():
    g = torch.Generator().manual_seed(1)
    freq = 10000.0 ** (-torch.arange(0, D, 2).double() / D)
    frame = RopeFrame(freq[None].expand(2, -1).float(), torch.tensor([1.0, 0.5]), 64)
    x = torch.randn(3, BS, D, generator=g)
    start = torch.tensor([0, 7, 30000])
    layer = torch.tensor([0, 1, 1])
    post = frame.turn(x, start, layer, inverse=False)
    for i in range(3):
        pos = torch.arange(int(start[i]), int(start[i]) + BS)
        ref = _rotate(x[i], pos, freq.float(), float(frame.scale[layer[i]]))
        assert torch.allclose(post[i], ref, atol=2e-4)
    back = frame.turn(post, start, layer, inverse=True)
    assert torch.allclose(back, x, atol=1e-5)


@pytest.mark.parametrize("int8", [False, True])
def test_keys_of_a_pre_rope_subspace_come_back_exact_wherever_their_blocks_lie(synthetic, int8):
    """Blocks at starts that are not multiples of the block size, not in order, past the
    context (left padding, a shifted prompt): every start is found, the keys come back
    to the coefficients' precision; post-RoPE low rank at the same rank cannot."""
    cal, keys = synthetic
    starts = [0, 16, 37, 1000, 3, 4000, 2500, 999]
    k = keys(starts)
    layout = BlockLayout(2, H, D, BS)
    pre = LowRankCodec(R, int8, get_codec("none"), cal, pre=True)
    fields, out = _code(pre, k, layout)
    assert fields["start"].shape == (2, H, len(starts), 1)
    assert fields["start"][..., 0].tolist() == [[starts] * H] * 2
    tol = 0.01 if int8 else 2e-3
    assert float((out - k).norm() / k.norm()) < tol
    post = LowRankCodec(R, int8, get_codec("none"), cal)
    _, out_post = _code(post, k, layout)
    assert float((out_post - k).norm() / k.norm()) > 0.2
    one = BlockLayout(1, H, D, BS)  # one layer's call, the layer given: the same
    with pre.at_layer(1):
        f1, o1 = _code(pre, k[1], one)
    assert f1["start"][..., 0].tolist() == [starts] * H
    assert torch.allclose(o1, out[1], atol=1e-5)


def test_on_real_keys_each_block_keeps_the_frame_that_fits_it(cal, kv):
    """The pre codec's error per block is never above the post codec's (it stores a
    block in the post-RoPE frame, start -1, when that fits better); decoding is the
    projection in the stored frame."""
    k, _ = kv
    layout = BlockLayout(*k.shape[:2], k.shape[-1], BS)
    pre = LowRankCodec(6, False, get_codec("none"), cal, pre=True)
    post = LowRankCodec(6, False, get_codec("none"), cal)
    fields, out = _code(pre, k, layout)
    _, out_post = _code(post, k, layout)
    blocks = (*k.shape[:2], -1, BS, k.shape[-1])
    e_pre = (out - k).reshape(blocks).square().sum((-1, -2))
    e_post = (out_post - k).reshape(blocks).square().sum((-1, -2))
    assert bool((e_pre <= e_post * 1.001 + 1e-6).all())
    assert float(e_pre.sum()) < float(e_post.sum())  # the pre-RoPE frame pays here
    start = fields["start"][..., 0]
    assert bool((start >= -1).all())
    used = start >= 0
    assert bool(used.any())
    assert torch.equal(out.reshape(blocks)[~used], out_post.reshape(blocks)[~used])


def test_a_damaged_start_is_an_error_not_keys(cal, kv):
    k, _ = kv
    layout = BlockLayout(*k.shape[:2], k.shape[-1], BS)
    codec = LowRankCodec(6, False, get_codec("none"), cal, pre=True)
    fields, _ = _code(codec, k, layout)
    fields["start"][0, 0, 0, 0] = -7
    with pytest.raises(CodecError, match="negative start"):
        codec.decode("k", fields, torch.empty_like(k))


def test_a_calibration_without_a_rope_frame_is_a_one_line_error(cal, tmp_path):
    tensors = {n: t for n, t in cal.tensors.items() if not n.startswith("rope_")}
    meta = {n: v for n, v in cal.meta.items() if n not in ("format", "max_positions")}
    path = tmp_path / "old.safetensors"
    save_calibration(path, tensors, meta)
    with pytest.raises(ConfigError) as err:
        CacheConfig(host_codec="lowrank-pre-r8", host_budget="1MiB", codec_calibration=str(path))
    msg = str(err.value)
    assert msg.startswith("codec_calibration=") and "\n" not in msg
    assert "RoPE frame" in msg and "kvstrata calibrate" in msg and "lowrank-r8" in msg
    # the post-RoPE codec takes the same file
    CacheConfig(host_codec="lowrank-r8", host_budget="1MiB", codec_calibration=str(path))
    # a frame without its positions (a file not written by `kvstrata calibrate`)
    half = tmp_path / "half.safetensors"
    save_calibration(half, {**tensors, "rope_freq": cal.tensors["rope_freq"]}, meta)
    with pytest.raises(ConfigError, match=r"^codec_calibration=.*max_positions") as err:
        CacheConfig(host_codec="lowrank-pre-r8", host_budget="1MiB", codec_calibration=str(half))
    assert "\n" not in str(err.value)


def test_the_name_and_its_fields():
    codec = get_codec("lowrank-pre-r12-int8+int8")
    assert isinstance(codec, LowRankCodec) and codec.pre and codec.rank == 12
    assert codec.int8 and codec.values.name == "int8"
    layout = BlockLayout(1, 1, 64, 64)
    plain = sum(s.nbytes for s in get_codec("lowrank-r12-int8").fields("k", layout).values())
    with_start = sum(s.nbytes for s in codec.fields("k", layout).values())
    assert with_start == plain + 4  # one int32 start per block and head
    with pytest.raises(ConfigError, match=r"lowrank\[-pre\]-r<R>"):
        get_codec("lowrank-pre-x8")


# -- fixtures of a real (tiny) model -------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", num_hidden_layers=3)


@pytest.fixture(scope="module")
def cal(model, tmp_path_factory):
    ids = torch.cat([seeded_ids(s, 256)[0] for s in range(4)]).tolist()
    tensors, meta = calibrate(model, None, ids=ids, context=256, block_size=BS, residual=32)
    assert "rope_freq" in tensors and meta["max_positions"] == 4096
    path = tmp_path_factory.mktemp("cal") / "tiny.safetensors"
    save_calibration(path, tensors, meta)
    return load_calibration(path)


@pytest.fixture(scope="module")
def kv(model):
    seen: dict[int, torch.Tensor] = {}

    def hook(module, query, key, value, scaling):
        seen[module.layer_idx] = key[0].clone()
        return kvsim.attend(query, key, value, scaling)

    with torch.inference_mode(), kvsim.hooked(model, hook):
        model(input_ids=seeded_ids(99, 128), use_cache=False)
    return torch.stack([seen[i] for i in sorted(seen)]), None


def test_the_calibrated_pre_rope_keys_are_k_proj_output_turned_back(model, cal):
    """The file's pre-RoPE frame is the model's: its mean is k_proj's output's mean."""
    ids = torch.cat([seeded_ids(s, 256)[0] for s in range(4)])
    means = []

    def hook(module, query, key, value, scaling):
        means.append(kvsim.pre_rope_keys(module.layer_idx)[0].float().mean(1))
        return kvsim.attend(query, key, value, scaling)

    with torch.inference_mode(), kvsim.hooked(model, hook):
        for w in ids.reshape(4, 256):
            model(input_ids=w[None], use_cache=False)
    got = torch.stack(means).reshape(4, 3, H, D).mean(0)
    assert torch.allclose(cal.tensors["kpre_mean"], got, atol=1e-4)
    inv = model.model.rotary_emb.inv_freq
    assert torch.allclose(cal.tensors["rope_freq"], inv.expand(3, -1), rtol=1e-5, atol=1e-7)
    assert math.isclose(float(cal.tensors["rope_scale"][0]), 1.0, rel_tol=1e-6)


def test_a_key_norm_before_the_rotary_is_inside_the_pre_rope_frame():
    """Qwen3 normalises keys between k_proj and RoPE: the calibrated pre-RoPE keys are
    the normalised ones (the rotary's input), not k_proj's output."""
    model = tiny_model("qwen3", num_hidden_layers=2)
    normed: dict[int, list[torch.Tensor]] = {}
    raw: dict[int, list[torch.Tensor]] = {}

    def keep(i, inp, out):  # k_norm's input and output [1, T, H, D]
        normed.setdefault(i, []).append(out[0].transpose(0, 1))
        raw.setdefault(i, []).append(inp[0][0].transpose(0, 1))

    handles = [
        layer.self_attn.k_norm.register_forward_hook(lambda _m, inp, out, i=i: keep(i, inp, out))
        for i, layer in enumerate(model.model.layers)
    ]
    ids = torch.cat([seeded_ids(s, 128)[0] for s in range(2)]).tolist()
    try:
        tensors, meta = calibrate(model, None, ids=ids, context=128, block_size=BS, residual=32)
    finally:
        for h in handles:
            h.remove()
    assert "rope_freq" in tensors
    for i in range(2):
        want = torch.cat(normed[i], dim=1).float().mean(1)  # [H, D]
        assert torch.allclose(tensors["kpre_mean"][i], want, atol=1e-4)
        k_proj = torch.cat(raw[i], dim=1).float().mean(1)
        assert not torch.allclose(tensors["kpre_mean"][i], k_proj, atol=1e-2)
