"""Content-addressed block keys: a chained hash over a sequence's full blocks.

    h_0 = H(None, tokens[0:bs],    extra)
    h_1 = H(h_0,  tokens[bs:2bs],  extra)
    ...

so two sequences that share their first k full blocks share their first k keys, and
a key names its whole prefix, not just its own tokens (DESIGN.md decision 6).

The digest is a pure function of bytes: the parent digest, the token ids as
little-endian int64, and the extra keys as canonical JSON (sorted keys, no spaces).
No Python `hash()` (salted per process) and no pickling, so a key is identical
across processes, restarts and machines, and a durable tier can find its blocks
again. The extra keys name everything that changes the stored bytes: model, dtype,
codec, layout version, shard.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence

import numpy as np

from kvstrata.core.errors import ConfigError

HASH_BYTES = 16
"""Digest size: 128 bits makes an accidental collision between blocks negligible
(and hits are verified against the stored token ids anyway)."""

_DOMAIN = b"kvstrata.block.v1"  # bump when the byte encoding below changes
_NO_PARENT = b"\x00" * HASH_BYTES


def _canonical_extra(extra: Mapping[str, str | int]) -> bytes:
    for key, value in extra.items():
        if not isinstance(key, str):
            raise ConfigError.field("extra key", key, "extra keys must be strings")
        # bool is an int subclass, but True and 1 would hash alike: refuse it.
        if isinstance(value, bool) or not isinstance(value, str | int):
            raise ConfigError.field(f"extra[{key!r}]", value, "values must be str or int")
    return json.dumps(dict(extra), sort_keys=True, separators=(",", ":")).encode()


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    arr = np.asarray(token_ids, dtype=np.int64)
    if arr.ndim != 1:
        raise ConfigError.field("token_ids", f"shape {arr.shape}", "a flat sequence of ints")
    return arr.astype("<i8", copy=False).tobytes()


def block_hash(
    parent: bytes | None,
    token_ids: Sequence[int],
    extra: Mapping[str, str | int] | None = None,
) -> bytes:
    """The key of one block, chained on its parent's key.

    Args:
        parent: the previous block's key, or None for the first block of a sequence.
        token_ids: the block's token ids (any length; full blocks in practice).
        extra: what else determines the stored bytes, e.g.
            {"model": "llama-7b", "dtype": "float16", "codec": "int8",
             "layout": 1, "shard": "0/1"}. Values are str or int.

    Returns:
        A HASH_BYTES-long digest, identical in every process.
    """
    if parent is not None and len(parent) != HASH_BYTES:
        raise ConfigError.field("parent", parent.hex(), f"a {HASH_BYTES}-byte block hash or None")
    h = hashlib.blake2b(digest_size=HASH_BYTES, person=b"kvstrata")
    extra_bytes = _canonical_extra(extra or {})
    tokens = _token_bytes(token_ids)
    # Length-prefix every variable-size part so no two inputs share a byte stream.
    h.update(_DOMAIN)
    h.update(parent if parent is not None else _NO_PARENT)
    h.update(len(extra_bytes).to_bytes(8, "little"))
    h.update(extra_bytes)
    h.update(len(tokens).to_bytes(8, "little"))
    h.update(tokens)
    return h.digest()


def sequence_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    extra: Mapping[str, str | int] | None = None,
    parent: bytes | None = None,
) -> list[bytes]:
    """Keys of the full blocks of a sequence (a trailing partial block has none).

    Args:
        token_ids: the sequence's token ids.
        block_size: tokens per block.
        extra: see `block_hash`.
        parent: key of the block before `token_ids[0]`, when continuing a sequence.

    Returns:
        One key per full block, in order.
    """
    if block_size <= 0:
        raise ConfigError.field("block_size", block_size, "a positive number of tokens")
    tokens = np.asarray(token_ids, dtype=np.int64)
    hashes: list[bytes] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[start : start + block_size], extra)
        hashes.append(parent)
    return hashes


def block_namespace(
    model_key: str,
    names: Mapping[str, str],
    layout_version: int,
    group: str,
    salt: str,
) -> dict[str, str | int]:
    """The extra keys every block hash of one store, layer group and tenant carries:
    the one place the key rules live (the prefix index hashes with them, so the disk
    tier's durable index and the remote tier's keys follow them too).

    Args:
        model_key: names the model and its weights (KVStore.model_key).
        names: what else changes the stored bytes, e.g. {"dtype": ..., "codecs": ...}.
        layout_version: bumped when stored bytes change meaning.
        group: the layer group ("index:window:groups").
        salt: the tenant salt ("" for none).
    """
    return {"model": model_key, **names, "layout": layout_version, "group": group, "salt": salt}


def namespace_digest(extra: Mapping[str, str | int], **more: str | int) -> str:
    """A short hex digest of a namespace (`block_namespace`) plus what a store outside
    this process must also agree on (`more`: e.g. the remote codec, the block shape):
    keys under different digests never meet."""
    h = hashlib.blake2b(digest_size=HASH_BYTES, person=b"kvstrata.ns")
    h.update(_canonical_extra({**extra, **{f"+{k}": v for k, v in more.items()}}))
    return h.hexdigest()
