"""Calibrated codecs (issue #27): lowrank-* keys, heads* mixed precision, calibration."""

from __future__ import annotations

import math

import pytest
import torch

from hf_models import make_tiny_model_dir, seeded_ids, tiny_model
from kvstrata.cli import main
from kvstrata.codecs.calibration import load_calibration, save_calibration
from kvstrata.codecs.heads import HeadsCodec
from kvstrata.codecs.int4 import Int4Codec
from kvstrata.codecs.lowrank import LowRankCodec
from kvstrata.codecs.registry import get_codec
from kvstrata.config import CacheConfig
from kvstrata.core.errors import CodecError, ConfigError
from kvstrata.core.fingerprint import weights_digest
from kvstrata.core.layout import BlockLayout
from kvstrata.integrations.hf import TieredCache, enable
from kvstrata.quality import kvsim
from kvstrata.quality.calibrate import (
    calibrate,
    calibration_files,
    check_calibration,
)
from kvstrata.workload.zoo import heldout_files

BS = 16


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", num_hidden_layers=3)  # 3 layers, 2 kv heads, head dim 16


@pytest.fixture(scope="module")
def cal_file(model, tmp_path_factory):
    ids = torch.cat([seeded_ids(s, 256)[0] for s in range(4)]).tolist()
    tensors, meta = calibrate(model, None, ids=ids, context=256, block_size=BS, residual=32)
    path = tmp_path_factory.mktemp("cal") / "tiny.safetensors"
    save_calibration(path, tensors, meta)
    return str(path)


@pytest.fixture(scope="module")
def cal(cal_file):
    return load_calibration(cal_file)


@pytest.fixture(scope="module")
def kv(model):
    """Real K/V of the tiny model on unseen ids: [L, H, T, D] post-RoPE keys, values."""
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(module, query, key, value, scaling):
        seen[module.layer_idx] = (key[0].clone(), value[0].clone())
        return kvsim.attend(query, key, value, scaling)

    with torch.inference_mode(), kvsim.hooked(model, hook):
        model(input_ids=seeded_ids(99, 128), use_cache=False)
    k = torch.stack([seen[i][0] for i in sorted(seen)])
    v = torch.stack([seen[i][1] for i in sorted(seen)])
    return k, v


def _code(codec, kind, x, layout):
    fields = {
        f: torch.empty((*x.shape[:-2], x.shape[-2] // BS * s.rows, s.cols), dtype=s.dtype)
        for f, s in codec.fields(kind, layout).items()
    }
    codec.encode(kind, x, fields)
    out = torch.empty_like(x)
    codec.decode(kind, fields, out)
    return fields, out


def _layout(x):
    return BlockLayout(x.shape[0], x.shape[1], x.shape[-1], BS, dtype=x.dtype)


# -- calibration ------------------------------------------------------------------------------
def test_calibration_text_is_not_the_evaluation_text(tmp_path):
    model_dir = make_tiny_model_dir(tmp_path / "m")
    held = {p.resolve() for p in heldout_files(model_dir)}
    files = calibration_files(str(model_dir))
    assert held and files
    assert not held & {p.resolve() for p in files}


def test_calibration_round_trip(model, cal_file, cal):
    assert cal.num_layers == 3 and cal.num_kv_heads == 2 and cal.head_dim == 16
    basis = cal.tensors["k_basis"]
    eye = torch.eye(16).expand(3, 2, 16, 16)
    assert torch.allclose(basis.transpose(-1, -2) @ basis, eye, atol=1e-4)  # orthonormal
    sv = cal.tensors["k_sv"]
    assert bool((sv[..., :-1] >= sv[..., 1:] - 1e-5).all())  # by decreasing energy
    for name in ("damage", "mass", "entropy"):
        assert cal.ranking(name).shape == (3, 2)
    assert bool((cal.ranking("mass") > 0).all())
    assert load_calibration(cal_file) is cal  # one load per content
    assert check_calibration(model, cal_file) is cal
    other = tiny_model("llama", num_hidden_layers=3, seed=1)
    assert weights_digest(other) != weights_digest(model)
    with pytest.raises(ConfigError, match=r"^codec_calibration=.*not this one"):
        check_calibration(other, cal_file)


# -- lowrank ------------------------------------------------------------------------------------
def _projection(x, cal, rank):
    """mu + U U^T (x - mu) per (layer, head): the exact answer of a rank-R codec."""
    mu = cal.tensors["k_mean"][:, :, None]
    u = cal.tensors["k_basis"][..., :rank]
    return (x - mu) @ u @ u.transpose(-1, -2) + mu


def test_lowrank_is_the_projection_and_the_error_falls_with_the_rank(cal, kv):
    k, _ = kv
    errors = []
    for rank in (2, 4, 8, 15):
        codec = LowRankCodec(rank, False, get_codec("none"), cal)
        fields, out = _code(codec, "k", k, _layout(k))
        assert fields["coef"].shape == (3, 2, 128, rank)
        assert fields["layer"].shape == (3, 2, 128 // BS, 1)
        assert fields["layer"][:, 0, 0, 0].tolist() == [0, 1, 2]
        assert torch.allclose(out, _projection(k, cal, rank), atol=2e-3 * k.abs().max())
        errors.append(float((out - k).norm() / k.norm()))
    assert errors == sorted(errors, reverse=True)
    assert errors[-1] < 0.2 < errors[0]  # 15 of 16 dims: small; 2 of 16: large
    codec8 = LowRankCodec(8, True, get_codec("none"), cal)
    _, out8 = _code(codec8, "k", k, _layout(k))
    assert float((out8 - _projection(k, cal, 8)).norm() / k.norm()) < 0.01  # int8 coefs


def test_lowrank_values_use_the_value_codec(cal, kv):
    _, v = kv
    codec = get_codec("lowrank-r8+int8")
    assert isinstance(codec, LowRankCodec) and codec.values.name == "int8"
    bound = LowRankCodec(8, False, get_codec("int8"), cal)
    _, out = _code(bound, "v", v, _layout(v))
    _, ref = _code(get_codec("int8"), "v", v, _layout(v))
    assert torch.equal(out, ref)


def test_one_layer_calls_find_their_layer(cal, kv):
    """write_layer / read_layer hand a codec [H, T, D]: the layer is found by fit and
    stored; decoding a layer alone gives what the whole-model call gave."""
    k, _ = kv
    codec = LowRankCodec(8, False, get_codec("none"), cal)
    whole_fields, whole = _code(codec, "k", k, _layout(k))
    for layer in range(3):
        one = BlockLayout(1, 2, 16, BS)
        fields, out = _code(codec, "k", k[layer], one)
        own = float((whole[layer] - k[layer]).norm())
        assert float((out - k[layer]).norm()) <= own + 1e-4  # the best fit: never worse
        # decoding the whole-model fields of one layer alone (read_layer)
        single = {f: t[layer] for f, t in whole_fields.items()}
        back = torch.empty_like(k[layer])
        codec.decode("k", single, back)
        assert torch.equal(back, whole[layer])


# -- heads -----------------------------------------------------------------------------------
def test_heads_codec_keeps_the_top_heads_in_the_kept_codec(cal, kv):
    k, v = kv
    int8, int4 = get_codec("int8"), Int4Codec(16)
    codec = HeadsCodec(50, int8, int4, cal)
    top = cal.ranking("damage").argmax(1)  # 1 of 2 heads kept per layer
    for kind, x in (("k", k), ("v", v)):
        fields, out = _code(codec, kind, x, _layout(x))
        _, hi = _code(int8, kind, x, _layout(x))
        _, lo = _code(int4, kind, x, _layout(x))
        for layer in range(3):
            kept = int(top[layer])
            assert torch.equal(out[layer, kept], hi[layer, kept])
            assert torch.equal(out[layer, 1 - kept], lo[layer, 1 - kept])
        hi_b = sum(s.nbytes for s in int8.fields(kind, _layout(x)).values())
        lo_b = sum(s.nbytes for s in int4.fields(kind, _layout(x)).values())
        assert fields["data"].shape[-1] == math.ceil((2 + hi_b + lo_b) / 2)
        one = {f: t[2] for f, t in fields.items()}  # one layer alone decodes the same
        back = torch.empty_like(x[2])
        codec.decode(kind, one, back)
        assert torch.equal(back, out[2])
    assert get_codec("heads50-int8-int4-g32").other.name == "int4-g32"


# -- errors ----------------------------------------------------------------------------------
def test_calibrated_codecs_without_a_calibration_say_so(tmp_path):
    with pytest.raises(ConfigError, match=r"^host_codec='lowrank-r8'.*codec_calibration"):
        CacheConfig(host_codec="lowrank-r8", host_budget="1MiB")
    with pytest.raises(ConfigError, match=r"^codec_calibration=.*no such file.*calibrate"):
        CacheConfig(
            host_codec="heads50-int8-int4",
            host_budget="1MiB",
            codec_calibration=str(tmp_path / "missing.safetensors"),
        )
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a file")
    with pytest.raises(ConfigError, match=r"^codec_calibration=.*calibrate"):
        CacheConfig(host_codec="lowrank-r8", host_budget="1MiB", codec_calibration=str(bad))
    with pytest.raises(ConfigError, match=r"^host_codec='lowrank-r8@0123456789ab'.*not loaded"):
        CacheConfig(host_codec="lowrank-r8@0123456789ab", host_budget="1MiB")
    with pytest.raises(ConfigError, match=r"^codec=.*lowrank\[-pre\]-r<R>"):
        get_codec("lowrank-x8")
    with pytest.raises(ConfigError, match=r"^codec='heads50-int8-foo'.*kept codec"):
        get_codec("heads50-int8-foo")
    unbound = get_codec("lowrank-r8")
    with pytest.raises(ConfigError, match="codec_calibration"):
        unbound.encode("k", torch.zeros(2, 16, 16), {})


def test_a_calibration_of_another_geometry_is_refused(cal, cal_file):
    with pytest.raises(ConfigError, match=r"^codec_calibration=.*\(2, 16, 16\).*calibrate"):
        LowRankCodec(8, False, get_codec("none"), cal).validate(BlockLayout(3, 4, 16, BS))
    with pytest.raises(ConfigError, match=r"^codec_calibration=.*3 layers"):
        HeadsCodec(50, get_codec("int8"), get_codec("int4"), cal).validate(
            BlockLayout(5, 2, 16, BS)
        )
    with pytest.raises(ConfigError, match="below the head dim"):
        LowRankCodec(16, False, get_codec("none"), cal)
    with pytest.raises(CodecError, match="kv heads"):
        _code(
            LowRankCodec(8, False, get_codec("none"), cal),
            "k",
            torch.zeros(3, 16, 16),
            BlockLayout(1, 3, 16, BS),
        )
    config = CacheConfig(host_codec="lowrank-r8", host_budget="1MiB", codec_calibration=cal_file)
    assert config.host_codec == f"lowrank-r8@{cal.digest}"
    assert config.replace(host_budget="2MiB").host_codec == config.host_codec


# -- end to end ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "codec", ["lowrank-r12-int8+int8", "lowrank-pre-r12-int8+int8", "heads50-int8-fp8"]
)
def test_tiered_generate_with_a_calibrated_host_codec(model, cal_file, codec):
    ids = seeded_ids(5, 160)
    enable(model)
    try:
        cache = TieredCache(
            model.config,
            block_size=BS,
            max_tokens=512,
            device_budget=None,
            resident_fraction=0.125,
            host_budget="4MiB",
            host_codec=codec,
            residual_tokens=32,
            codec_calibration=cal_file,
        )
        out = model.generate(
            ids, cache=cache, max_new_tokens=24, min_new_tokens=24, do_sample=False
        )
    finally:
        model.set_attn_implementation("sdpa")
    assert out.shape == (1, 184) and torch.equal(out[:, :160], ids)
    assert cache.stats()["tiers"]["host"]["used_blocks"] >= 6
    host = cache.manager.state.tiers["host"]
    assert host.codec.name.startswith(codec + "@") and host.stats.blocks_read > 0


@pytest.mark.parametrize(
    "codec", ["fp8", "lowrank-r12-int8+int8", "lowrank-pre-r8-int8", "heads50-int8-fp8"]
)
def test_the_simulation_matches_the_tiered_cache(model, cal, cal_file, codec):
    """kvsim's one-forward ΔPPL is the token-by-token TieredCache's (same placement), and
    a calibrated codec on the host tier codes exactly what the simulation codes."""
    from kvstrata.codecs.registry import calibrated_codec
    from kvstrata.model.budgets import placement
    from kvstrata.quality.evaluate import compare

    window = seeded_ids(11, 256)[0].tolist()
    kwargs = placement(model, 256, codec=codec, resident=0.1, block_size=BS, residual_tokens=32)
    impl = calibrated_codec(codec, "codec", cal) or get_codec(codec)
    if impl is not get_codec(codec):
        kwargs["codec_calibration"] = cal_file
    real = compare(model, [window], {"lossy": kwargs}, 256).configs["lossy"]
    sim = kvsim.simulated_compare(
        model, [window], {"lossy": kvsim.codec_lossy(impl, BS)}, block_size=BS, residual=32
    )["lossy"]
    assert abs(real.delta_ppl_pct) > 0.01  # the codec matters here: the check can fail
    assert sim["delta_ppl_pct"] == pytest.approx(real.delta_ppl_pct, rel=0.02, abs=2e-3)
    assert sim["top1_agreement"] == pytest.approx(real.top1_agreement, abs=0.01)


def test_eval_cli_runs_a_calibrated_codec(tmp_path, capsys):
    model_dir = make_tiny_model_dir(tmp_path / "m")
    out = tmp_path / "cal.safetensors"
    assert (
        main(
            [
                "calibrate",
                "--model",
                str(model_dir),
                "--out",
                str(out),
                "--tokens",
                "512",
                "--context",
                "256",
            ]
        )
        == 0
    )
    assert "digest" in capsys.readouterr().out
    args = [
        "eval",
        "ppl",
        "--model",
        str(model_dir),
        "--codec",
        "int8,lowrank-r8",
        "--context",
        "128",
        "--windows",
        "1",
        "--block-size",
        "16",
        "--residual",
        "16",
        "--json",
    ]
    assert main(args) == 2
    assert "--calibration" in capsys.readouterr().err
    assert main([*args, "--calibration", str(out)]) == 0
    text = capsys.readouterr().out
    assert "lowrank-r8" in text and "delta_ppl_pct" in text


def test_blockwise_attention_is_the_masked_attention():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, 80, 8, generator=g) for h in (4, 2, 2))
    kl, vl = k + 0.5 * torch.randn(k.shape, generator=g), v * 2
    mask = kvsim.lossy_mask(80, 8, 16)
    assert mask.any() and not mask[:, :8].any()  # the sinks stay exact
    ref = kvsim.attend(q, k, v, 0.3, mask, kl, vl)
    got = kvsim.attend_blocks(q, k, v, 0.3, 8, 2, kl, vl)
    assert torch.allclose(got, ref, atol=1e-5)
    assert not torch.allclose(got, kvsim.attend(q, k, v, 0.3), atol=1e-3)
