"""kvstrata.model.geometry: exact KV bytes per token for MHA/GQA/MLA, sliding windows, codecs."""

from __future__ import annotations

import json

import pytest
import torch

from kvstrata.codecs.registry import codec_names
from kvstrata.core.errors import ConfigError
from kvstrata.model.geometry import KVGeometry
from kvstrata.model.presets import PRESETS
from kvstrata.workload.zoo import load_geometry

GIB = 2**30


@pytest.mark.parametrize(
    ("name", "bytes_per_token"),
    [
        ("llama-2-7b", 524_288),  # 2 * 32 * 32 * 128 * 2: the seed's "512KB/token"
        ("llama-2-13b", 819_200),
        ("llama-2-70b", 327_680),
        ("llama-3-8b", 131_072),
        ("llama-3-70b", 327_680),
        ("mistral-7b", 131_072),
        ("qwen2.5-7b", 57_344),
        ("qwen2.5-72b", 327_680),
        ("deepseek-v2-lite", 27 * 576 * 2),  # MLA latent: 31,104, not 2 * heads * dim
        ("opt-175b", 4_718_592),
        ("kvstrata-code-tiny", 4_096),  # 2 * 4 * 2 * 64 * 4 (fp32)
    ],
)
def test_preset_bytes_per_token(name, bytes_per_token):
    assert load_geometry(name).bytes_per_token() == bytes_per_token


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("llama-2-7b", 6_738_415_616),
        ("llama-2-13b", 13_015_864_320),
        ("llama-2-70b", 68_976_648_192),
        ("llama-3-8b", 8_030_261_248),
        ("llama-3-70b", 70_553_706_496),
        ("mistral-7b", 7_241_732_096),
        ("qwen2.5-7b", 7_615_616_512),
        ("qwen2.5-72b", 72_706_203_648),
        ("opt-175b", 175_000_000_000),
    ],
)
def test_preset_parameter_counts_match_published(name, params):
    assert load_geometry(name).num_params == params


def test_seed_numbers_llama_2_7b():
    g = load_geometry("llama-2-7b")
    assert g.bytes_for_context(8192) == 4 * GIB  # seed: 8k context = 4 GB
    # The other seed's "21.47 GB" is wrong: batch 4 x 2048 tokens in fp32 is 8 GiB.
    assert 4 * g.bytes_for_context(2048, "fp32") == 8_589_934_592
    assert g.bytes_per_token("bf16") == 524_288


def test_int4_g64_on_llama_3_8b():
    if "int4" not in codec_names():
        pytest.skip("int4 codec not registered yet")
    # 4 bits + an fp16 scale and zero per 64 elements = 4.5 bits per element.
    assert load_geometry("llama-3-8b").bytes_per_token("int4", "fp16") == 131072 * 4.5 / 16 == 36864


def test_codec_bytes_come_from_the_registry():
    from kvstrata.codecs.registry import get_codec

    g = load_geometry("llama-3-8b")
    for name in codec_names():
        layout = g.to_layout(128, "fp16")
        expected = get_codec(name).block_nbytes(layout) / 128
        assert g.bytes_per_token(name, "fp16", block_size=128) == expected
    assert g.bytes_per_token("none") == 131_072


def test_unknown_codec_lists_valid_names():
    with pytest.raises(ConfigError, match=r"^codec='zip'.*none"):
        load_geometry("llama-3-8b").bytes_per_token("zip")


def test_to_layout_matches_bytes_per_token():
    g = load_geometry("llama-3-8b")
    layout = g.to_layout(64, "fp16")
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (32, 8, 128)
    assert layout.dtype == torch.float16 and layout.block_size == 64
    assert layout.raw_block_bytes == 64 * 131_072
    assert g.to_layout(16).dtype == torch.bfloat16  # the model's dtype by default


def test_mla_layout_is_the_latent():
    g = load_geometry("deepseek-v2-lite")
    assert g.is_mla and (g.kv_lora_rank, g.qk_rope_head_dim) == (512, 64)
    layout = g.to_layout(64)
    assert (layout.num_kv_heads, layout.head_dim, layout.dim_v) == (1, 512, 64)
    assert layout.raw_block_bytes == 64 * 31_104
    assert g.bytes_for_context(8192) == 8192 * 31_104


def test_sliding_window_mistral():
    g = load_geometry("mistral-7b")
    assert g.sliding_window == 4096 and g.sliding_layers == tuple(range(32))
    assert g.kv_tokens_for_layer(0, 1000) == 1000
    assert g.kv_tokens_for_layer(31, 32768) == 4096
    assert g.bytes_for_context(32768) == 4096 * 131_072
    assert g.bytes_for_context(2048) == 2048 * 131_072


def test_qwen2_without_use_sliding_window_is_full():
    g = load_geometry("qwen2.5-7b")
    assert g.sliding_window is None and g.sliding_layers == ()
    assert g.bytes_for_context(32768) == 32768 * 57_344


def test_qwen2_max_window_layers_and_layer_types():
    base = {
        "model_type": "qwen2", "num_hidden_layers": 4, "hidden_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "torch_dtype": "float16",
        "sliding_window": 100, "use_sliding_window": True, "max_window_layers": 2,
    }  # fmt: skip
    g = KVGeometry.from_hf_config(base)
    assert g.sliding_layers == (2, 3)
    per_layer_token = 2 * 2 * 16 * 2
    assert g.bytes_for_context(1000) == per_layer_token * (1000 + 1000 + 100 + 100)
    typed = dict(base, layer_types=["sliding_attention", "full_attention"] * 2)
    assert KVGeometry.from_hf_config(typed).sliding_layers == (0, 2)


def test_from_transformers_config_objects():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    llama = KVGeometry.from_hf_config(
        LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                    num_key_value_heads=1, intermediate_size=128, vocab_size=100)
    )  # fmt: skip
    assert (llama.num_layers, llama.num_kv_heads, llama.head_dim) == (2, 1, 16)
    assert llama.bytes_per_token() == 2 * 2 * 1 * 16 * 4  # no dtype: fp32 like HF
    mistral = KVGeometry.from_hf_config(
        MistralConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                      num_key_value_heads=2, sliding_window=32, dtype="bfloat16")
    )  # fmt: skip
    assert mistral.sliding_layers == (0, 1) and mistral.dtype == "bf16"
    qwen = KVGeometry.from_hf_config(
        Qwen2Config(num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
                    num_key_value_heads=2, use_sliding_window=True, sliding_window=8,
                    max_window_layers=3)
    )  # fmt: skip
    assert qwen.sliding_layers == (3,) and qwen.sliding_window == 8


def test_tiny_geometry_matches_the_real_model():
    from transformers import LlamaForCausalLM

    from kvstrata.workload.zoo import tiny_code_config

    config = tiny_code_config()
    preset = load_geometry("kvstrata-code-tiny")
    assert KVGeometry.from_hf_config(config, name="kvstrata-code-tiny") == preset
    assert (preset.num_layers, preset.num_kv_heads, preset.head_dim) == (4, 2, 64)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    assert preset.num_params == sum(p.numel() for p in model.parameters())


def test_from_json_file_and_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["llama-3-8b"]))
    from_dir = load_geometry(str(tmp_path))
    from_file = load_geometry(str(tmp_path / "config.json"))
    assert from_dir.bytes_per_token() == from_file.bytes_per_token() == 131_072
    assert from_dir.num_params == 8_030_261_248


def test_unknown_preset_lists_presets():
    with pytest.raises(ConfigError) as info:
        load_geometry("banana")
    message = str(info.value)
    assert message.startswith("model='banana' is invalid")
    assert "llama-2-7b" in message and "deepseek-v2-lite" in message


@pytest.mark.parametrize(
    ("content", "pattern"),
    [
        ("{not json", "not a readable JSON"),
        ("[1, 2]", "JSON object"),
        ('{"model_type": "llama", "hidden_size": 64}', "num_hidden_layers.*missing"),
        ('{"num_hidden_layers": 2, "num_attention_heads": "x", "hidden_size": 8}',
         "num_attention_heads='x'"),
        ('{"num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 8,'
         ' "torch_dtype": "int3"}', "torch_dtype='int3'"),
        ('{"num_hidden_layers": 2, "num_attention_heads": 2}', "head_dim.*missing"),
    ],
)  # fmt: skip
def test_malformed_config_names_file_and_field(tmp_path, content, pattern):
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=pattern) as info:
        load_geometry(str(path))
    assert str(path) in str(info.value)
    assert "\n" not in str(info.value)


def test_multi_query_configs_have_one_kv_head():
    """A StarCoder or Falcon-7B config.json names no KV heads, only multi_query: one K/V
    head (the planner sized them for every query head); Falcon-40B's new decoder
    architecture names its KV heads (num_kv_heads)."""
    data = {"model_type": "gpt_bigcode", "n_layer": 2, "n_head": 12, "n_embd": 768,
            "multi_query": True, "vocab_size": 100}  # fmt: skip
    assert KVGeometry.from_hf_config(data).num_kv_heads == 1
    assert KVGeometry.from_hf_config({**data, "multi_query": False}).num_kv_heads == 12
    falcon = {"model_type": "falcon", "num_hidden_layers": 2, "num_attention_heads": 71,
              "hidden_size": 4544, "multi_query": True, "vocab_size": 100}  # fmt: skip
    assert KVGeometry.from_hf_config(falcon).num_kv_heads == 1
    big = {**falcon, "num_attention_heads": 128, "hidden_size": 8192,
           "new_decoder_architecture": True, "num_kv_heads": 8}  # fmt: skip
    assert KVGeometry.from_hf_config(big).num_kv_heads == 8
