"""Chained block hashes: process-independent, prefix-sharing, sensitive to extra keys."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvstrata.core.errors import ConfigError
from kvstrata.core.hashing import HASH_BYTES, block_hash, sequence_block_hashes

EXTRA = {"model": "tiny-llama", "dtype": "float16", "codec": "int8", "layout": 1, "shard": "0/1"}


def test_identical_in_another_process():
    tokens = list(range(1000, 1050))
    here = [h.hex() for h in sequence_block_hashes(tokens, 16, EXTRA)]
    code = (
        "from kvstrata.core.hashing import sequence_block_hashes\n"
        f"print(' '.join(h.hex() for h in sequence_block_hashes({tokens!r}, 16, {EXTRA!r})))"
    )
    # A different PYTHONHASHSEED would change any use of Python's hash().
    env = dict(os.environ, PYTHONHASHSEED="4242")
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env
    )
    assert out.stdout.split() == here
    assert len(here) == 3  # 50 tokens: three full blocks of 16, the tail has no key


def test_known_value_is_stable():
    # Pins the byte encoding: a change here orphans every block on every disk.
    digest = block_hash(None, [1, 2, 3, 4], {"model": "m"})
    assert digest.hex() == "2407915a150e21f0e811f9cd6f90b76a"


def test_prefix_property():
    a = list(range(64))
    b = a[:32] + [7] * 32
    ha, hb = sequence_block_hashes(a, 8, EXTRA), sequence_block_hashes(b, 8, EXTRA)
    assert len(ha) == len(hb) == 8
    assert ha[:4] == hb[:4]
    assert all(x != y for x, y in zip(ha[4:], hb[4:], strict=True))
    # a change in an early block changes every later key (chaining), even for equal tokens
    c = [5] + a[1:]
    hc = sequence_block_hashes(c, 8, EXTRA)
    assert all(x != y for x, y in zip(ha, hc, strict=True))


def test_chain_matches_block_by_block():
    tokens = list(range(24))
    parent = None
    expected = []
    for i in range(3):
        parent = block_hash(parent, tokens[8 * i : 8 * i + 8], EXTRA)
        expected.append(parent)
    assert sequence_block_hashes(tokens, 8, EXTRA) == expected
    # continuing from a parent gives the tail of the full chain
    assert sequence_block_hashes(tokens[8:], 8, EXTRA, parent=expected[0]) == expected[1:]
    assert all(len(h) == HASH_BYTES for h in expected)


@pytest.mark.parametrize(
    "change",
    [
        {"model": "other"},
        {"dtype": "bfloat16"},
        {"codec": "int4"},
        {"layout": 2},
        {"shard": "1/2"},
        {"extra_key": "x"},
    ],
)
def test_extra_keys_change_the_hash(change):
    tokens = list(range(16))
    assert block_hash(None, tokens, {**EXTRA, **change}) != block_hash(None, tokens, EXTRA)


def test_extra_key_order_and_int_vs_str():
    tokens = [3, 1, 4, 1]
    reordered = dict(reversed(list(EXTRA.items())))
    assert block_hash(None, tokens, reordered) == block_hash(None, tokens, EXTRA)
    assert block_hash(None, tokens, {"layout": 1}) != block_hash(None, tokens, {"layout": "1"})


def test_token_width_is_fixed():
    # ids beyond 32 bits and negative ids are encoded, not truncated
    assert block_hash(None, [2**33]) != block_hash(None, [0])
    assert block_hash(None, [-1]) != block_hash(None, [2**64 - 1 - 2**63])
    assert block_hash(None, [1, 2]) != block_hash(None, [1, 2, 0])


def test_bad_inputs():
    with pytest.raises(ConfigError, match="block_size"):
        sequence_block_hashes([1, 2], 0)
    with pytest.raises(ConfigError, match="parent"):
        block_hash(b"short", [1])
    with pytest.raises(ConfigError, match="str or int"):
        block_hash(None, [1], {"flag": True})
