"""Key summaries shared between sequences with a common prefix (attention/selection/selector.py).

A prefix-cache hit gives a new sequence blocks that another one computed: the same
keys, so the same page summaries. Without sharing, the new sequence's first selecting
decode step reads every stored key of its prompt back from the tiers and summarises
it again: at long contexts that step takes several times as long as an ordinary one
(docs/MEASUREMENTS.md).

So each sequence's summaries record the content hashes of its table's leading full
blocks as the block manager hashes them (`table_hashes`, from `KeySelector.forget`
once a step); a new sequence's summaries start from the pages that lie inside the
leading blocks whose hashes it shares with a live or recently finished sequence of
the same layer group — the longest such prefix (`KeySelector._start`): a live one's
are copied (`copy_prefix`), a finished one's taken over whole. Content hashes chain
every earlier block's tokens, so equal hashes at block i mean equal keys in blocks
0 .. i. The summaries of the RETAINED most recently finished sequences are kept for
this (with 4-key pages about 1/8 of their fp32 K/V bytes each).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

RETAINED = 2  # finished sequences whose summaries wait for a prefix hit

HashOf = Callable[[int], "bytes | None"]  # block id -> its content hash (None: not hashed)


@dataclass
class BlockHashes:
    """How the selector reads a table's blocks' content hashes."""

    hash_of: HashOf
    block_size: int


def scope(key: Hashable) -> Hashable:
    """The layer group of a summaries key (sequence, group): only keys of one group
    share summaries (its blocks hold that group's layers)."""
    return key[1] if isinstance(key, tuple) and len(key) == 2 else None


def table_hashes(table: Any, hash_of: HashOf, known: list[bytes]) -> list[bytes]:
    """`known` (hashes of the table's first blocks) extended by its next blocks' hashes,
    up to the first block not hashed yet; [] for a table that dropped blocks (a
    sliding window: selection does not apply)."""
    if getattr(table, "first_block", 0):
        return []
    ids = table.block_ids
    out = known
    for i in range(len(known), len(ids)):
        h = hash_of(ids[i])
        if h is None:
            break
        if out is known:
            out = list(known)
        out.append(h)
    return out


def common(a: list[bytes], b: list[bytes]) -> int:
    """Length of the common leading run of two hash lists."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def best_donor(key: Hashable, hashes: list[bytes], candidates: list[tuple[Hashable, Any]]):
    """(summaries, shared blocks) of the candidate of `key`'s group sharing the most
    leading blocks with `hashes`, or (None, 0)."""
    best, most = None, 0
    group = scope(key)
    for other, entry in candidates:
        if other == key or scope(other) != group:
            continue
        n = common(hashes, entry.hashes)
        if n > most:
            best, most = entry, n
    return best, most


def copy_prefix(dst: Any, src: Any, pages: int, coarse: int) -> int:
    """Copy, per layer, src's summaries of pages [0, min(pages, src's filled)) into dst
    (the same layout), with the groups those pages complete; returns the (page,
    layer) summaries copied."""
    copied = 0
    for local, filled in enumerate(src.filled):
        n = min(pages, filled, dst.data.shape[3])
        if n <= dst.filled[local]:
            continue
        dst.data[local, ..., :n] = src.data[local, ..., :n]
        if coarse and dst.groups is not None and src.groups is not None:
            g = n // coarse
            dst.groups[local, ..., :g] = src.groups[local, ..., :g]
        copied += n - dst.filled[local]
        dst.filled[local] = n
    return copied
