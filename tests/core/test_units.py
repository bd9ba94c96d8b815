"""kvstrata.core.units: sizes and token counts as people write them."""

from __future__ import annotations

import pytest

from kvstrata.core.errors import ConfigError
from kvstrata.core.units import format_bytes, parse_size, parse_tokens


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("24GB", 24 * 10**9),
        ("24 GiB", 24 * 2**30),
        ("24G", 24 * 2**30),
        ("1.5T", int(1.5 * 2**40)),
        ("512MiB", 512 * 2**20),
        ("1kB", 1000),
        ("1048576", 1048576),
        (4096, 4096),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["banana", "-1", "0", "", "1.5iB", True])
def test_parse_size_rejects_and_names_the_field(bad):
    with pytest.raises(ConfigError, match=r"^host_budget="):
        parse_size(bad, "host_budget")


def test_parse_size_allows_zero_when_asked():
    assert parse_size("0", "disk_budget", allow_zero=True) == 0


@pytest.mark.parametrize(
    ("text", "expected"),
    [("8k", 8192), ("128K", 131072), ("2048", 2048), (7, 7), ("1m", 2**20), ("0.5k", 512)],
)
def test_parse_tokens(text, expected):
    assert parse_tokens(text) == expected


@pytest.mark.parametrize("bad", ["banana", "-1", "0", "1.5", "2x", False])
def test_parse_tokens_rejects_and_names_the_field(bad):
    with pytest.raises(ConfigError, match=r"^context="):
        parse_tokens(bad, "context")


def test_format_bytes():
    assert format_bytes(4 * 2**30) == "4.00 GiB"
    assert format_bytes(512) == "512 B"


def test_parse_fraction():
    from kvstrata.core.units import parse_fraction

    assert parse_fraction("10%", "resident") == 0.1
    assert parse_fraction(0.25) == 0.25
    for bad in ("0", "1.5", "banana", "-5%"):
        with pytest.raises(ConfigError, match="resident="):
            parse_fraction(bad, "resident")
