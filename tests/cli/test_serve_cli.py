"""`kvstrata serve`: its flags (vLLM's vocabulary as aliases), refusals before any work
(one line, exit 2), the engine the flags build, and a real server process that Ctrl-C
stops cleanly — its disk tier keeps the prefix cache for the next start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvstrata.cli import build_parser, main
from kvstrata.cli.serve import weight_bytes
from kvstrata.platform.hardware import machine_ram
from kvstrata.workload.zoo import load_model
from serve_harness import ServeProcess


def test_help_names_the_vllm_aliases(capsys):
    with pytest.raises(SystemExit) as info:
        main(["serve", "--help"])
    assert info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for flag in (
        "--gpu-memory-utilization",
        "--swap-space",
        "--block-size",
        "--enable-prefix-caching, --no-enable-prefix-caching",
        "--kv-cache-dtype",
        "--max-batched-tokens MAX_BATCHED_TOKENS, --max-num-batched-tokens",
        "--max-num-seqs",
        "--served-model-name",
        "--preemption {demote,off}",
    ):
        assert flag in out, flag
    assert "The device tier always holds exact KV (it is the residual window)" in out


REFUSED = [  # argv, words of the one-line message
    (["--swap-space", "4", "--host-budget", "1GiB"], ["swap_space", "--host-budget"]),
    (["--gpu-memory-utilization", "0.5", "--device-budget", "1MiB"], ["--device-budget"]),
    (["--gpu-memory-utilization", "0.5", "--resident-fraction", "0.5"], ["--resident-fraction"]),
    (["--kv-cache-dtype", "int8", "--host-codec", "fp8"], ["kv_cache_dtype", "--host-codec"]),
    (["--kv-cache-dtype", "int8", "--disk-codec", "fp8"], ["--disk-codec"]),
    (["--kv-cache-dtype", "fp8_e5m2"], ["fp8_e5m2", "e4m3"]),
    (["--remote-url", "http://h:6379"], ["remote_url='http://h:6379'", "redis or rediss"]),
    (["--remote-url", "redis://:pw@h:x"], ["remote_url='redis://:***@h:x'"]),
    (["--remote-codec", "int8"], ["remote_codec", "set remote_url"]),
    (["--remote-url", "redis://h", "--remote-ttl", "0"], ["remote_ttl='0'"]),
    (["--gpu-memory-utilization", "1.5"], ["gpu_memory_utilization", "(0, 1]"]),
    (["--gpu-memory-utilization", "nan"], ["gpu_memory_utilization"]),
    (["--swap-space", "-1"], ["swap_space", "'-1'"]),
    (["--port", "70000"], ["port", "70000"]),
    (["--max-num-seqs", "0"], ["max_num_seqs"]),
    (["--max-num-batched-tokens", "0"], ["max_batched_tokens"]),
    (["--preemption", "recompute"], ["--preemption", "recompute"]),
    (["--blend-recompute", "1.5"], ["blend_recompute=1.5", "0 to 1"]),
    (["--blend-recompute", "x"], ["blend_recompute='x'"]),
    (["--host-codec", "zip"], ["host_codec", "zip"]),
    (["--uvicorn-log-level", "loud"], ["uvicorn_log_level", "loud"]),
    (["--disk-budget", "1GiB"], ["disk_budget", "--disk-dir"]),
    (["--model", "/nonexistent/model"], ["/nonexistent/model"]),
    (["--gpu-memory-utilization", "0.000001"], ["does not cover the model's weights"]),
    (["--swap-space-gb", "4"], ["--swap-space"]),
    (["--host", ""], ["host"]),
    (["--kv-events-config", "{not json"], ["kv_events_config='{not json'", "a JSON object"]),
    (["--kv-events-config", "[1]"], ["kv_events_config='[1]'", "a JSON object"]),
    (["--kv-events-config", '{"buffer_step": 3}'], ["buffer_step=3", "'buffer_steps'"]),
    (["--kv-events-config", '{"publisher": "kafka"}'], ["publisher='kafka'", '"zmq" or "null"']),
    (["--kv-events-config", '{"hwm": -1}'], ["kv_events_config.hwm=-1", ">= 0"]),
    (["--kv-events-config", '{"endpoint": "5557"}'], ["endpoint='5557'", "tcp://*:5557"]),
    (["--kv-events-config", '{"enable_kv_cache_events": "yes"}'], ["'yes'", "true or false"]),
]


@pytest.mark.parametrize("argv, words", REFUSED, ids=lambda v: " ".join(v) if v[0] else "")
def test_bad_flags_exit_2_with_one_line(capsys, argv, words):
    # the embedded model (a fresh clone has no smollm2 wheel); an explicit --model wins
    assert main(["serve", "--port", "0", "--model", "tiny", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("kvstrata serve: error: "), err
    for word in words:
        assert word in err, err


def _engine(*argv: str):
    from kvstrata.cli.serve import build_engine

    args = build_parser().parse_args(["serve", "--model", "tiny", *argv])
    return build_engine(args)


def test_vllm_flags_set_the_same_fields_as_kvstrata_flags():
    engine = _engine(
        "--swap-space", "0.01", "--kv-cache-dtype", "fp8_e4m3", "--device-budget", "2MiB",
        "--block-size", "16", "--no-enable-prefix-caching", "--max-num-seqs", "3",
        "--max-num-batched-tokens", "100", "--served-model-name", "tiny",
    )  # fmt: skip
    try:
        config = engine.store.config
        assert config.host_budget == int(0.01 * 2**30)
        assert (config.host_codec, config.disk_codec, config.device_codec) == ("fp8", "fp8", "none")
        assert config.block_size == 16 and config.device_budget == 2 * 2**20
        assert engine.store.prefix_caching is False
        assert (engine.config.max_num_seqs, engine.config.max_batched_tokens) == (3, 100)
        assert engine.model_name == "tiny"
    finally:
        engine.shutdown()


def test_remote_flags_set_the_remote_fields():
    with pytest.warns(RuntimeWarning, match="unreachable at start"):  # nothing on port 1
        engine = _engine(
            "--remote-url", "redis://127.0.0.1:1/0", "--remote-codec", "int8",
            "--remote-ttl", "60", "--remote-timeout", "0.05",
        )  # fmt: skip
    try:
        config = engine.store.config
        assert (config.remote_url, config.remote_codec) == ("redis://127.0.0.1:1/0", "int8")
        assert (config.remote_ttl, config.remote_timeout) == (60, 0.05)
    finally:
        engine.shutdown()


def test_gpu_memory_utilization_is_device_memory_minus_the_weights():
    model, _ = load_model("default")
    ram, weights = machine_ram(), weight_bytes(model)
    fraction = (weights + 2 * 2**20) / ram  # leaves about 2 MiB for KV
    engine = _engine("--gpu-memory-utilization", repr(fraction), "--block-size", "16")
    try:
        assert engine.store.config.device_budget == int(fraction * ram) - weights
        assert engine.store.config.host_codec == "none"
        assert engine.model_name == "kvstrata-code-tiny"
    finally:
        engine.shutdown()


# -- a real server process ---------------------------------------------------------------


def test_sigint_and_sigterm_close_the_store_and_the_disk_tier_keeps_the_prefix_cache(
    tmp_path: Path,
):
    disk = str(tmp_path / "kv")
    flags = ("--block-size", "16", "--device-budget", "1MiB", "--disk-dir", disk,
             "--disk-budget", "4MiB", "--no-status")  # fmt: skip
    prompt = "def read_config(path):\n    with open(path) as f:\n        return json.load(f)\n"
    first = ServeProcess(*flags)
    try:
        usage = first.complete(prompt)["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        code = first.stop(signal.SIGINT)  # Ctrl-C
    assert code == 0, "".join(first.stderr)
    # what NUMA placement did, one line at start-up (on one node: that it is a no-op)
    assert sum(line.startswith("kvstrata serve: NUMA: ") for line in first.stderr) == 1

    second = ServeProcess(*flags)  # a new process: only the disk tier remembers
    try:
        usage = second.complete(prompt)["usage"]
    finally:
        assert second.stop(signal.SIGTERM) == 0, "".join(second.stderr)  # kill, docker stop
    full_blocks = (usage["prompt_tokens"] - 1) // 16
    assert usage["prompt_tokens_details"]["cached_tokens"] == full_blocks * 16 > 0


_SPIN_PROBE = """
import os, sys
from kvstrata.cli import main
code = main(sys.argv[1:])
print(code, os.environ.get("GOMP_SPINCOUNT"), "torch" in sys.modules)
"""


@pytest.mark.parametrize(
    ("env", "argv", "want"),
    [
        ({}, ["serve", "--port", "-5"], "2 200000"),  # a server: workers spin briefly
        ({"OMP_WAIT_POLICY": "PASSIVE"}, ["serve", "--port", "-5"], "2 None"),  # the user's
        ({"GOMP_SPINCOUNT": "7"}, ["serve", "--port", "-5"], "2 7"),
        ({}, ["plan", "--model", "nope"], "2 None"),  # not a server: sleep at once
    ],
)
def test_a_server_lets_its_openmp_workers_spin_unless_told_otherwise(env, argv, want):
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in ("OMP_WAIT_POLICY", "KVSTRATA_OMP_DEFAULTED", "GOMP_SPINCOUNT")
    }
    out = subprocess.run(
        [sys.executable, "-c", _SPIN_PROBE, *argv],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.stdout.split()[:2] == want.split(), out.stdout + out.stderr
