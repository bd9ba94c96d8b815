"""`kvstrata bench vllm`'s set-ups that need no vLLM: the sliding-window copy of a model,
the KV cache groups vLLM makes of it, the host tier sized to one prompt, the CPUs of
tensor-parallel workers, and its flags' errors. (The bench itself runs in .venv-vllm.)"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from kvstrata.bench import vllm as bench
from kvstrata.core.errors import ConfigError


def _model(path: Path, **config) -> Path:
    path.mkdir()
    base = {"model_type": "llama", "num_hidden_layers": 4, "num_key_value_heads": 2,
            "hidden_size": 64, "num_attention_heads": 4}  # fmt: skip
    (path / "config.json").write_text(json.dumps({**base, **config}))
    (path / "model.safetensors").write_bytes(b"weights")
    (path / "tokenizer.json").write_text("{}")
    return path


def test_a_windowed_copy_slides_every_other_layer_and_links_the_weights(tmp_path):
    src = _model(tmp_path / "m")
    out = bench.windowed_model(src, 128, tmp_path / "w")
    config = json.loads((out / "config.json").read_text())
    assert config["sliding_window"] == 128
    assert config["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert (out / "model.safetensors").is_symlink()
    assert (out / "model.safetensors").read_bytes() == b"weights"
    assert json.loads((src / "config.json").read_text()).get("layer_types") is None
    assert bench._groups(out) == {"layers": [2, 2], "sliding": [True, False], "window": 128}


def test_only_a_llama_without_layer_types_is_rewritten(tmp_path):
    with pytest.raises(ConfigError, match=r"sliding_window=64 .*Llama.*this one is 'gemma2'"):
        bench.windowed_model(_model(tmp_path / "g", model_type="gemma2"), 64, tmp_path / "x")
    kinds = ["full_attention"] * 4
    with pytest.raises(ConfigError, match="with layer_types"):
        bench.windowed_model(_model(tmp_path / "l", layer_types=kinds), 64, tmp_path / "y")
    with pytest.raises(ConfigError, match="2 layers or more"):
        bench.windowed_model(_model(tmp_path / "one", num_hidden_layers=1), 64, tmp_path / "z")


def test_groups_follow_vllms_hybrid_allocator(tmp_path):
    # Gemma-2-style, 3 sliding + 2 full layers: groups of 2 (a sliding one padded)
    kinds = ["sliding_attention", "full_attention"] * 2 + ["sliding_attention"]
    model = _model(tmp_path / "g", layer_types=kinds, sliding_window=96, num_hidden_layers=5)
    groups = bench._groups(model)
    assert groups["layers"] == [2, 1, 2] and groups["sliding"] == [True, True, False]
    # 2048 tokens in 32-token blocks: 64 blocks of the full group, the window's 3 + 1
    # of each sliding group
    assert bench._blocks_per_prompt(model, 64, 32) == 4 + 4 + 64
    # Mistral v0.1: a window and no layer_types — every layer slides (one group)
    mistral = _model(tmp_path / "mi", model_type="mistral", sliding_window=64)
    assert bench._groups(mistral) == {"layers": [4], "sliding": [True], "window": 64}
    assert bench._blocks_per_prompt(mistral, 64, 32) == 3
    plain = _model(tmp_path / "p")
    assert bench._groups(plain) == {"layers": [4], "sliding": [False], "window": None}
    assert bench._blocks_per_prompt(plain, 64, 32) == 64


def test_tensor_parallel_workers_get_the_cpus_split_evenly(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 1, 2, 0})
    assert bench._threads_bind(2) == "0,1|2,3"
    assert bench._threads_bind(4) == "0|1|2|3"


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_flags_settle_and_bad_ones_are_one_line_errors(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert bench._settle(_args()).repeats == 5
    assert bench._settle(_args("--docqa")).repeats == 3
    quick = bench._settle(_args("--quick"))
    assert (quick.prompt_tokens, quick.repeats) == (512, 2)
    with pytest.raises(ConfigError, match=r"tp=3 .*one worker per CPU: at most 2"):
        bench._settle(_args("--tp", "3"))
    with pytest.raises(ConfigError, match="tp=0"):
        bench._settle(_args("--tp", "0"))
    with pytest.raises(ConfigError, match="sliding_window=0"):
        bench._settle(_args("--sliding-window", "0"))
    with pytest.raises(ConfigError, match=r"docqa=True .*--tp, --json"):
        bench._settle(_args("--docqa", "--tp", "2", "--json"))
    for error in ("tp=3", "docqa"):
        argv = ("--tp", "3") if error == "tp=3" else ("--docqa", "--sliding-window", "64")
        with pytest.raises(ConfigError) as info:
            bench._settle(_args(*argv))
        assert "\n" not in str(info.value)
