"""`kvstrata plan`: verdicts with reasons, JSON output, one-line errors (exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvstrata.cli import main

GIB = 2**30
BASE = ["plan", "--host-memory", "128GiB"]


def test_rtx4090_8k_x4_recommends_offload(capsys):
    argv = [*BASE, "--model", "llama-2-7b", "--gpu", "rtx4090", "--context", "8k"]
    assert main([*argv, "--concurrency", "4"]) == 0
    out = capsys.readouterr().out
    assert "Offloading: RECOMMEND" in out
    assert "+ KV needs 16.00 GiB but only 9.05 GiB is free" in out
    assert "+ 4 concurrent requests >= 4" in out
    assert "newest 1024 tokens/request (12.5%)" in out
    assert "device KV saved: 87.5%" in out
    assert "524,288 B/token" in out


def test_h200_2k_advises_against(capsys):
    assert main([*BASE, "--model", "llama-2-7b", "--gpu", "h200", "--context", "2k"]) == 0
    out = capsys.readouterr().out
    assert "Offloading: ADVISE AGAINST" in out
    assert "- GPU memory 141 GiB >= 80 GiB" in out
    assert "- context 2048 tokens <= 2k" in out


def test_json_output_parses(capsys):
    argv = [*BASE, "--model", "llama-2-7b", "--context", "8k", "--concurrency", "4", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["verdict"] == "recommend"
    assert data["bytes_per_token"] == 524_288
    assert data["kv_per_request_bytes"] == 4 * GIB
    assert data["tiers"]["resident_tokens"] == 1024
    assert data["tiers"]["device_bytes"] == 2 * GIB
    assert data["memory_saved"] == 0.875
    assert data["hardware"]["link"]["bandwidth"] == 25e9
    assert data["table"][3]["context_tokens"] == 8192
    assert data["reasons_for"] and data["reasons_against"] == []


def test_overrides_and_config_dir(tmp_path, capsys):
    config = {
        "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "torch_dtype": "float16",
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    argv = ["plan", "--model", str(tmp_path), "--params", "1M", "--gpu", "custom",
            "--gpu-memory", "1GiB", "--gpu-bandwidth", "100GB/s", "--link", "pcie5",
            "--link-bandwidth", "40e9", "--disk-link", "nvme-gen4", "--host-memory", "0",
            "--context", "1k", "--block-size", "64", "--reserve", "0", "--json"]  # fmt: skip
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["bytes_per_token"] == 2 * 2 * 2 * 16 * 2
    assert data["weights_bytes"] == 2 * 10**6
    assert data["hardware"]["gpu"] == {"name": "custom", "memory_bytes": GIB, "bandwidth": 1e11}
    assert data["hardware"]["link"]["bandwidth"] == 40e9
    assert data["block_size"] == 64 and data["reserve_bytes"] == 0
    assert data["fits_on_gpu"] is True


def test_host_too_small_prints_what_to_raise(capsys):
    argv = ["plan", "--model", "llama-2-7b", "--context", "32k", "--concurrency", "4",
            "--host-memory", "16GiB"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Does not fit:" in out and "--host-memory" in out


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["--model", "banana"], "model='banana'"),
        (["--model", "llama-2-7b", "--gpu", "v100"], "gpu='v100'"),
        (["--model", "llama-2-7b", "--link", "usb"], "link='usb'"),
        (["--model", "llama-2-7b", "--context", "lots"], "context='lots'"),
        (["--model", "llama-2-7b", "--concurrency", "0"], "concurrency='0'"),
        (["--model", "llama-2-7b", "--priority", "fast"], "priority='fast'"),
        (["--model", "llama-2-7b", "--kv-dtype", "int3"], "kv_dtype='int3'"),
        (["--model", "llama-2-7b", "--codec", "zip"], "codec='zip'"),
        (["--model", "llama-2-7b", "--gpu-memory", "-1"], "gpu_memory='-1'"),
        (["--model", "llama-2-7b", "--reserve", "x%"], "reserve='x%'"),
    ],
)
def test_bad_inputs_exit_2_with_one_line(capsys, args, field):
    assert main(["plan", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvstrata plan: error: ")
    assert field in lines[0]


def test_console_script_bad_model_one_line_no_traceback():
    script = Path(sys.executable).parent / "kvstrata"
    if not script.exists():
        pytest.skip("kvstrata console script not installed in this environment")
    proc = subprocess.run(
        [str(script), "plan", "--model", "banana"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "Traceback" not in proc.stderr and "llama-2-7b" in proc.stderr
