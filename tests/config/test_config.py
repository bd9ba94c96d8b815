"""kvstrata.config.CacheConfig: validation at the edge, one-line errors naming the field."""

from __future__ import annotations

import pytest

from kvstrata.config import CacheConfig
from kvstrata.core.errors import ConfigError


def test_defaults_and_parsing():
    cfg = CacheConfig(block_size="128", device_budget="2GiB", host_budget="16GB", max_tokens="32k")
    assert cfg.block_size == 128
    assert cfg.device_budget == 2 * 2**30
    assert cfg.host_budget == 16 * 10**9
    assert cfg.max_tokens == 32768
    assert cfg.disk_dir is None and cfg.disk_budget == 0
    assert cfg.policy == "window"


def test_disk_tier_needs_dir_and_budget(tmp_path):
    cfg = CacheConfig(disk_dir=str(tmp_path), disk_budget="8GiB")
    assert cfg.disk_budget == 8 * 2**30
    with pytest.raises(ConfigError, match=r"^disk_budget=0"):
        CacheConfig(disk_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=r"^disk_dir=None"):
        CacheConfig(disk_budget="1GiB")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"block_size": 0}, "block_size"),
        ({"block_size": 8192}, "block_size"),
        ({"resident_fraction": 0}, "resident_fraction"),
        ({"resident_fraction": 1.5}, "resident_fraction"),
        ({"resident_fraction": 0.1, "device_budget": "1GiB"}, "resident_fraction"),
        ({"host_budget": "banana"}, "host_budget"),
        ({"residual_tokens": -1}, "residual_tokens"),
        ({"policy": "random"}, "policy"),
        ({"cold_attention": "gpu"}, "cold_attention"),
        ({"device": "tpu"}, "device"),
        ({"host_codec": ""}, "host_codec"),
        ({"disk_compress": "yes"}, "disk_compress"),
        ({"disk_compress": True, "disk_o_direct": True}, "disk_o_direct"),
    ],
)
def test_invalid_fields_name_themselves(kwargs, field):
    with pytest.raises(ConfigError) as info:
        CacheConfig(**kwargs)
    message = str(info.value)
    assert message.startswith(f"{field}=")
    assert "\n" not in message


def test_from_dict_rejects_unknown_keys_and_lists_known():
    cfg = CacheConfig.from_dict({"block_size": 64, "host_budget": "1GiB"})
    assert cfg.host_budget == 2**30
    with pytest.raises(ConfigError, match=r"^blocksize=64 .*known: .*block_size"):
        CacheConfig.from_dict({"blocksize": 64})


def test_replace_validates_again():
    cfg = CacheConfig()
    assert cfg.replace(block_size=256).block_size == 256
    with pytest.raises(ConfigError, match="^policy="):
        cfg.replace(policy="nope")


def test_frozen():
    with pytest.raises(AttributeError):
        CacheConfig().block_size = 5  # type: ignore[misc]


def test_disk_dir_that_cannot_be_looked_at_is_a_config_error(tmp_path):
    too_long = tmp_path / ("x" * 300) / "kv"  # ENAMETOOLONG from stat(), not a traceback
    with pytest.raises(ConfigError, match=r"^disk_dir=.*cannot access it"):
        CacheConfig(disk_dir=str(too_long), disk_budget="1MiB")
