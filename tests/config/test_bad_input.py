"""Bad input, by class: refused at construction (API) or before any work (CLI) with one
line naming the field, the value and what is accepted; the CLI exits 2, no traceback.

Classes (issue #11, item 7): non-finite numbers, wrong types, misspelled keywords, a
device that is not there, silently accepted nonsense (empty paths, fractions where
bytes are meant, more tokens than the model has positions, a reserve larger than the
GPU) and messages that named the wrong field.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig

import kvstrata.workload.zoo
from kvstrata.cli import main
from kvstrata.config import CacheConfig
from kvstrata.core.errors import ConfigError
from kvstrata.integrations.hf.cache import TieredCache

INF, NAN = float("inf"), float("nan")
DISK = {"disk_dir": "/tmp/kvstrata-bad-input-never-created", "disk_budget": "1MiB"}
HOST = {"host_budget": "1MiB"}


def _one_line_naming(exc: BaseException, field: str, value: str) -> str:
    message = str(exc)
    assert isinstance(exc, ConfigError), f"{type(exc).__name__}: {message}"
    assert "\n" not in message, message
    assert field in message, message
    assert value in message, message
    return message


def _refused(build, field: str, value: str) -> str:
    with pytest.raises(ConfigError) as info:
        build()
    return _one_line_naming(info.value, field, value)


# -- API: CacheConfig ---------------------------------------------------------------------
NUMERIC = {  # field -> extra fields it needs to be meaningful
    "block_size": {},
    "max_tokens": {},
    "device_budget": HOST,
    "resident_fraction": HOST,
    "host_budget": {},
    "disk_budget": {"disk_dir": DISK["disk_dir"]},
    "residual_tokens": {},
    "sink_tokens": {},
    "staging_tokens": {},
}
NON_FINITE = [INF, -INF, NAN, -1, "1e999", "inf", "nan"]


@pytest.mark.parametrize("field", NUMERIC)
@pytest.mark.parametrize("value", NON_FINITE, ids=repr)
def test_non_finite_and_negative_numbers(field, value):
    kwargs = {**NUMERIC[field], field: value}
    _refused(lambda: CacheConfig(**kwargs), field, repr(value))


WRONG_TYPES = [
    ("disk_dir", 123, {"disk_budget": "1MiB"}),
    ("disk_dir", b"/tmp/x", {"disk_budget": "1MiB"}),
    ("disk_dir", ["/tmp"], {"disk_budget": "1MiB"}),
    ("block_size", True, {}),
    ("max_tokens", [1024], {}),
    ("max_tokens", None, {}),
    ("host_budget", True, {}),
    ("host_budget", None, {}),
    ("device_budget", {"bytes": 1}, HOST),
    ("resident_fraction", "lots", HOST),
    ("resident_fraction", True, HOST),
    ("sink_tokens", False, {}),
    ("residual_tokens", 1.5, {}),
    ("policy", None, {}),
    ("cold_attention", ["local"], {}),
    ("device", 0, {}),
    ("host_codec", 3, {}),
    ("disk_compress", "yes", DISK),
]


@pytest.mark.parametrize(("field", "value", "extra"), WRONG_TYPES, ids=lambda v: repr(v)[:20])
def test_wrong_types(field, value, extra):
    _refused(lambda: CacheConfig(**{**extra, field: value}), field, repr(value))


NONSENSE = [
    # bytes fields are bytes: a number below 1 is refused, never read as a fraction
    ("host_budget", 0.4, {}, "not a fraction"),
    ("device_budget", 0.5, HOST, "resident_fraction"),
    ("disk_budget", 0.25, {"disk_dir": DISK["disk_dir"]}, "not a fraction"),
    ("host_budget", 1.5, {}, "whole number of bytes"),
    ("host_budget", "0.4", {}, "not a fraction"),
    ("host_budget", "2EB", {}, "byte size"),
    ("host_budget", "10q", {}, "byte size"),
    ("host_budget", "100TiB", {}, "RAM"),
    ("device_budget", "100TiB", {**HOST, "device": "cpu"}, "RAM"),
    ("max_tokens", 10**12, {}, "at most"),
    ("disk_dir", "", {"disk_budget": "1MiB"}, "current directory"),
    ("disk_dir", "   ", {"disk_budget": "1MiB"}, "directory path"),
    ("block_size", 0, {}, ">= 1"),
    ("block_size", 5000, {}, "4,096"),
    ("resident_fraction", 0.25, {}, "host or disk tier"),
    ("resident_fraction", "150%", HOST, "(0, 1]"),
    ("device_codec", "int8", {}, "full precision"),
    ("host_codec", "zip", {}, "valid codecs"),
    ("device", "tpu", {}, "'cuda:N'"),
    ("device", "cuda:x", {}, "'cuda:N'"),
    ("device", "cuda:99", {}, "cuda"),
    ("disk_o_direct", True, {}, "disk_dir"),
]


@pytest.mark.parametrize(("field", "value", "extra", "says"), NONSENSE, ids=lambda v: repr(v)[:20])
def test_nonsense_is_refused_with_the_fix(field, value, extra, says):
    message = _refused(lambda: CacheConfig(**{**extra, field: value}), field, repr(value))
    assert says in message


def test_block_size_limits_stated_as_checked():
    for size in (1, 3, 4096):
        assert CacheConfig(block_size=size).block_size == size
    message = _refused(lambda: CacheConfig(block_size=4097), "block_size", "4097")
    assert "4,096" in message and "16-512" not in message


def test_disk_dir_that_is_a_file(tmp_path):
    path = tmp_path / "a-file"
    path.write_text("x")
    _refused(lambda: CacheConfig(disk_dir=str(path), disk_budget="1MiB"), "disk_dir", "a-file")


def test_cuda_without_cuda_is_refused_at_construction():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    message = _refused(lambda: CacheConfig(device="cuda"), "device", "'cuda'")
    assert "is_available" in message


@pytest.mark.parametrize(
    ("build", "field", "close"),
    [
        (lambda: CacheConfig(blocksize=16), "blocksize", "block_size"),
        (lambda: CacheConfig(hostbudget="1GiB"), "hostbudget", "host_budget"),
        (lambda: CacheConfig.from_dict({"sinks": 4}), "sinks", "sink_tokens"),
        (lambda: CacheConfig().replace(polcy="lru"), "polcy", "policy"),
    ],
    ids=["keyword", "keyword2", "from_dict", "replace"],
)
def test_misspelled_field_is_a_config_error_with_the_closest_name(build, field, close):
    message = _refused(build, field, field)
    assert f"did you mean {close!r}" in message


# -- API: TieredCache ---------------------------------------------------------------------
def _llama() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=256,
    )


PROMPT = torch.arange(40)[None] % 64  # 40 tokens; one block of 16 tokens is 4 KiB (fp32)


@pytest.mark.parametrize(
    ("kwargs", "field", "value"),
    [
        ({"blok_size": 16}, "blok_size", "did you mean 'block_size'"),
        ({"promt_ids": PROMPT}, "promt_ids", "did you mean 'prompt_ids'"),
        ({"cache_config": "x"}, "cache_config", "'x'"),
        ({"cache_config": {"block_size": 16}}, "cache_config", "from_dict"),
        ({"dtype": "float16"}, "dtype", "'float16'"),
        ({"store": 5}, "store", "5"),
        ({"device_budget": INF}, "device_budget", "inf"),
        ({"disk_dir": 123, "disk_budget": "1MiB"}, "disk_dir", "123"),
        ({"salt": 5}, "salt", "5"),
        ({"prefix_caching": "yes"}, "prefix_caching", "'yes'"),
        ({"prompt_ids": "abc"}, "prompt_ids", "'abc'"),
        ({"prompt_ids": [[1, 2], [3]]}, "prompt_ids", "[[1, 2], [3]]"),
        ({"prompt_ids": [[1.5, 2.0]]}, "prompt_ids", "1.5"),
        ({"prompt_ids": [[-1, 2]]}, "prompt_ids", "-1"),
        ({"prompt_ids": [[64]]}, "prompt_ids", "0 to 63"),
        ({"prompt_ids": torch.zeros(1, 300, dtype=torch.long)}, "prompt_ids", "300 tokens"),
    ],
    ids=lambda v: repr(v)[:20],
)
def test_tiered_cache_arguments(kwargs, field, value):
    _refused(lambda: TieredCache(_llama(), **kwargs), field, value)


def test_tiered_cache_config_must_be_a_model_config():
    _refused(lambda: TieredCache("llama"), "config", "'llama'")


@pytest.mark.parametrize(
    ("kwargs", "field", "says"),
    [
        # device-only and too small for max_tokens: name the device budget, not host/disk
        ({"device_budget": "16KiB", "max_tokens": 256}, "device_budget", "no host or disk"),
        # smaller than one open block per layer group
        ({"device_budget": 100, "max_tokens": 64}, "device_budget", "open 16-token block"),
        # a device tier sized for max_tokens that the machine cannot hold
        ({"max_tokens": 2**31 - 1}, "max_tokens", "more than"),
        # lossy lower tiers: the sinks must fit on the device: name sink_tokens too
        (
            {
                "device_budget": "8KiB",
                "sink_tokens": 256,
                "max_tokens": 256,
                **HOST,
                "host_codec": "int8",
            },
            "device_budget",
            "sink_tokens=256",
        ),  # fmt: skip
        # sinks that cannot stay on the device: name sink_tokens, not device_budget
        ({"sink_tokens": 10**9, "max_tokens": 256}, "sink_tokens", "stay on the device"),
        (
            {"sink_tokens": 10**9, "resident_fraction": 0.5, **HOST, "host_codec": "int8"},
            "sink_tokens",
            "stay on the device",
        ),
        # a host budget smaller than one block would silently be no host tier
        ({"resident_fraction": 0.5, "host_budget": 100, "max_tokens": 64}, "host_budget", "one"),
    ],
    ids=["device-only", "tiny-device", "huge-max-tokens", "lossy", "sinks", "sinks-lossy", "host"],
)
def test_budgets_name_the_field_at_construction(kwargs, field, says):
    def build():
        return TieredCache(
            _llama(), block_size=16, prompt_ids=PROMPT, dtype=torch.float32, **kwargs
        )

    message = _refused(build, field, "")
    assert says in message


# -- CLI -----------------------------------------------------------------------------------
def _cli(capsys, argv: list[str], *names: str) -> str:
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert out == ""
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for name in names:
        assert name in err, err
    return err


PLAN = ["plan", "--model", "llama-2-7b", "--host-memory", "128GiB"]

CLI_NO_MODEL = [
    # non-finite numbers
    ([*PLAN, "--gpu-bandwidth", "inf"], ["gpu_bandwidth='inf'"]),
    ([*PLAN, "--link-bandwidth", "1e999"], ["link_bandwidth='1e999'"]),
    ([*PLAN, "--params", "inf"], ["params='inf'"]),
    ([*PLAN, "--params", "nan"], ["params='nan'"]),
    ([*PLAN, "--reserve", "nan%"], ["reserve='nan%'"]),
    ([*PLAN, "--context", "1e999"], ["context='1e999'"]),
    (["generate", "--temperature", "inf"], ["temperature='inf'"]),
    (["generate", "--temperature", "nan"], ["temperature='nan'"]),
    (["generate", "--top-k", "inf"], ["top_k='inf'"]),
    (["generate", "--no-repeat-ngram", "1e999"], ["no_repeat_ngram='1e999'"]),
    (["generate", "--residual", "inf"], ["residual_tokens='inf'"]),
    (["generate", "--device-budget", "1e999"], ["device_budget='1e999'"]),
    # wrong types / not whole
    ([*PLAN, "--concurrency", "1.5"], ["concurrency='1.5'"]),
    ([*PLAN, "--params", "1.5"], ["params='1.5'"]),
    (["generate", "--sinks", "1.5"], ["sink_tokens='1.5'"]),
    (["generate", "--seed", "x"], ["seed='x'"]),
    (["generate", "--seed", "-1"], ["seed='-1'"]),
    (["generate", "--seed", "1e30"], ["seed='1e30'"]),
    (["generate", "--threads", "99999999999"], ["threads='99999999999'"]),
    (["eval", "ppl", "--threads", "99999999999"], ["threads='99999999999'"]),
    (["eval", "ppl", "--residual", "1.5"], ["residual='1.5'"]),
    (["bench", "decode", "--steps", "x"], ["--steps", "'x'"]),
    (["bench", "decode", "--threads", "99999999999"], ["threads=99999999999"]),
    (["bench", "quantized", "--init-range", "nan"], ["init_range=nan"]),
    (["bench", "decode", "--seed", "-1"], ["seed=-1"]),
    (["bench", "tiers", "--size-mib", "99999999999"], ["size_mib=99999999999"]),
    # empty values and flags that do nothing
    ([*PLAN, "--gpu", ""], ["gpu=''"]),
    ([*PLAN, "--disk-capacity", ""], ["disk_capacity=''"]),
    ([*PLAN, "--disk-bandwidth", "5GB/s"], ["disk_bandwidth='5GB/s'", "--disk-link"]),
    (["generate", "--disk-dir", ""], ["disk_dir=''"]),
    (["generate", "--prompt", ""], ["prompt=''"]),
    (["eval", "ppl", "--codec", ","], ["codec=','"]),
    # fractions where bytes are meant
    ([*PLAN, "--reserve", "0.4"], ["reserve='0.4'", "10%"]),
    ([*PLAN, "--host-memory", "0.4"], ["host_memory='0.4'"]),
    (["generate", "--host-budget", "0.4"], ["host_budget='0.4'", "not a fraction"]),
    # out of range
    ([*PLAN, "--reserve", "30GiB"], ["reserve=", "24.00 GiB"]),
    ([*PLAN, "--reserve", "150%"], ["reserve='150%'"]),
    ([*PLAN, "--block-size", "8"], ["block_size=8", "16-512"]),
    (["generate", "--block-size", "5000"], ["block_size='5000'", "4,096"]),
    # a misspelled flag: one line with the closest one
    ([*PLAN, "--gpuu", "h100"], ["--gpuu", "did you mean --gpu?"]),
    (["bench", "decode", "--stpes", "4"], ["--stpes", "did you mean --steps?"]),
]


@pytest.mark.parametrize(("argv", "names"), CLI_NO_MODEL, ids=lambda v: " ".join(v)[-36:])
def test_cli_refuses_before_any_work(capsys, argv, names):
    _cli(capsys, argv, *names)


def test_plan_reserve_beyond_the_gpu_is_refused(capsys):
    err = _cli(capsys, [*PLAN, "--gpu", "rtx4090", "--reserve", "30GiB"], "reserve=")
    assert "rtx4090" in err and "-" not in err.split("reserve=")[1].split()[0]


CLI_WITH_MODEL = [
    # more tokens than the model has positions: names both
    (["generate", "--max-new-tokens", "10m"], ["max_new_tokens=10485760", "4096"]),
    (["eval", "ppl", "--context", "99999999"], ["context='99999999'", "4096"]),
    # a cache that cannot hold what the command asks for
    (["generate", "--max-new-tokens", "8", "--max-tokens", "5"], ["max_tokens='5'"]),
    (
        ["generate", "--max-new-tokens", "8", "--resident-fraction", "0.25", "--host-budget", "0"],
        ["resident_fraction=0.25", "host"],
    ),
    (["generate", "--max-new-tokens", "8", "--cold-attention", "gpu"], ["cold_attention='gpu'"]),
]


@pytest.mark.parametrize(("argv", "names"), CLI_WITH_MODEL, ids=lambda v: " ".join(v)[-36:])
def test_cli_refuses_after_reading_the_model(capsys, tiny_dir, argv, names):
    err = _cli(capsys, [*argv, "--model", str(tiny_dir)], *names)
    assert "windows" not in err


def test_demo_refuses_a_missing_model_and_too_many_tokens(capsys, tiny_dir, monkeypatch):
    _cli(capsys, ["demo", "--model", str(tiny_dir / "nope")], "model=")
    monkeypatch.setattr(kvstrata.workload.zoo, "default_model_dir", lambda: tiny_dir)
    code = main(["demo", "--model", "tiny", "--max-new-tokens", "10m"])
    out, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1 and "max_new_tokens=10485760" in err


@pytest.mark.parametrize(
    "argv",
    [
        [*PLAN, "--reserve", "30GiB"],
        ["generate", "--temperature", "inf"],
        ["bench", "tiers", "--size-mib", "x"],
    ],
    ids=["plan", "generate", "bench"],
)
def test_console_one_line_no_traceback(argv):
    proc = subprocess.run(
        [sys.executable, "-m", "kvstrata.cli", *argv], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "Traceback" not in proc.stderr


def test_nan_is_not_inf():  # the parametrised ids above rely on repr(nan) == 'nan'
    assert repr(NAN) == "nan" and math.isnan(NAN)
