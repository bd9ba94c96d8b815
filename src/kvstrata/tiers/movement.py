"""Moving blocks between tiers: the copies the store (blocks/apply.py, the prefix index)
and the vLLM backend (its write-through and its batched disk reads) both make.

- `copy_blocks`: tier to tier, at most COPY_CHUNK_BYTES of raw blocks staged at a time
  (demoting a long sequence off a GPU must not need a raw copy of all of it there);
  encoded bytes as they are between tiers of one codec (a block is quantized once),
  otherwise decoded and encoded again — on the GPU when blocks leave it.
- `read_into`: disk to a memory tier, straight into the arena's rows when the codecs
  match (one read per run of consecutive slots, no staging tensor).
- `read_verified`: a batch read from disk that serves only verified blocks: one that
  fails its checksum or cannot be read is left out, named, and the rest read again.
- `unreadable_slots`: disk blocks read back and dropped, only to learn whether they
  pass their checksums (a store's prefix hit on disk stays there: attention reads it
  from the disk tier when it needs it).
- `write_keyed`: blocks copied to disk slots and keyed in its durable index once their
  bytes are there, so a restart finds them and a key never names a failed write (the
  vLLM backend's write-through on its disk thread, the store's `persist` at close).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvstrata.core.errors import TierIOError
from kvstrata.core.layout import BlockLayout
from kvstrata.core.slots import slot_runs
from kvstrata.tiers.base import Tier
from kvstrata.tiers.disk import DiskTier
from kvstrata.tiers.memory import MemoryTier

# The most raw block bytes one step of a tier-to-tier copy stages (on the GPU, when
# blocks leave it through another codec).
COPY_CHUNK_BYTES = 32 * 2**20
MAX_RUNS_IN_PLACE = 16  # more runs of memory slots than this: read into a staging tensor
VERIFY_CHUNK_BYTES = 64 << 20  # blocks read back only to check them: this much at a time

# copy(src tier, src slots, dst tier, dst slots)
CopyBlocks = Callable[[Tier, list[int], Tier, list[int]], None]


def copy_blocks(
    layout: BlockLayout,
    src: Tier,
    src_slots: list[int],
    dst: Tier,
    dst_slots: list[int],
    chunk: CopyBlocks | None = None,
) -> None:
    """Copy blocks between tiers with `chunk` (default `copy_chunk`), at most
    COPY_CHUNK_BYTES of raw blocks at a time."""
    per = max(1, COPY_CHUNK_BYTES // max(1, layout.raw_block_bytes))
    for i in range(0, len(src_slots), per):
        s, d = src_slots[i : i + per], dst_slots[i : i + per]
        if chunk is None:
            copy_chunk(layout, src, s, dst, d)
        else:
            chunk(src, s, dst, d)


def copy_chunk(
    layout: BlockLayout, src: Tier, src_slots: list[int], dst: Tier, dst_slots: list[int]
) -> None:
    """Copy blocks between tiers in one go: encoded bytes as they are between tiers of
    one codec, otherwise decoded and re-encoded (on the GPU when they leave it)."""
    if src.codec.name == dst.codec.name:  # encoded as is: quantized once, never twice
        dst.write_encoded(dst_slots, src.read_encoded(src_slots))
        return
    n = len(src_slots)
    # Blocks leaving a GPU are decoded and re-encoded there: only encoded bytes cross
    # (a memory tier's write encodes where the data is; others get the fields here).
    gpu = getattr(src, "device", None)
    gpu = gpu if gpu is not None and gpu.type == "cuda" else None
    k = torch.empty(layout.raw_shape("k", n), dtype=layout.dtype, device=gpu)
    v = torch.empty(layout.raw_shape("v", n), dtype=layout.dtype, device=gpu)
    src.read_blocks(src_slots, k, v)
    if gpu is None or getattr(dst, "device", None) is not None:
        dst.write_blocks(dst_slots, k, v)
        return
    encoded = {}
    for kind, raw in (("k", k), ("v", v)):
        specs = dst.codec.fields(kind, layout)
        lead = raw.shape[:-2]
        fields = {
            f: torch.empty((*lead, n * s.rows, s.cols), dtype=s.dtype, device=gpu)
            for f, s in specs.items()
        }
        dst.codec.encode(kind, raw, fields)
        encoded.update({f"{kind}.{f}": t.cpu() for f, t in fields.items()})
    dst.write_encoded(dst_slots, encoded)


def read_into(disk: DiskTier, disk_slots: list[int], host: Tier, host_slots: list[int]) -> None:
    """`copy_blocks` from the disk tier to the host tier; when their codecs match, the
    blocks are read straight into the host arena's rows (one read per run of
    consecutive host slots: no staging tensor, no second copy)."""
    runs = slot_runs(host_slots)
    if (
        not isinstance(host, MemoryTier)
        or disk.codec.name != host.codec.name
        or len(runs) > MAX_RUNS_IN_PLACE
    ):
        copy_blocks(host.layout, disk, disk_slots, host, host_slots)
        return
    rows = {f"{kind}.{f}": s.rows for kind, fs in host.field_specs.items() for f, s in fs.items()}
    for j, first, count in runs:
        arena = host.arenas
        views = {key: t.narrow(2, first * rows[key], count * rows[key]) for key, t in arena.items()}
        disk.read_encoded_into(disk_slots[j : j + count], views)
    host.stats.blocks_written += len(host_slots)
    host.stats.bytes_written += len(host_slots) * host.block_bytes


def read_verified(
    disk: DiskTier, disk_slots: list[int], host: Tier, host_slots: list[int]
) -> dict[int, TierIOError]:
    """`copy_blocks` of a batch from the disk tier, serving only verified blocks.

    One call reads them all (the disk tier's vectored reads; compressed slots are
    decompressed across its threads; a codec change runs in torch's threads). A
    block that fails its checksum or cannot be read is left out and the rest read
    again (the tier raises for the batch, naming the bad slots).

    Returns:
        index in `disk_slots` -> TierIOError, for the blocks not copied.

    Raises:
        TierIOError naming no slot, or anything else: the batch failed as a whole.
    """
    bad: dict[int, TierIOError] = {}
    todo = list(range(len(disk_slots)))
    while todo:
        try:
            read_into(disk, [disk_slots[i] for i in todo], host, [host_slots[i] for i in todo])
            break
        except TierIOError as exc:
            failed = set(getattr(exc, "slots", None) or ())
            refused = [i for i in todo if disk_slots[i] in failed]
            if not refused:
                raise
            for i in refused:
                bad[i] = exc
            todo = [i for i in todo if disk_slots[i] not in failed]
    return bad


def unreadable_slots(disk: DiskTier, slots: list[int]) -> set[int]:
    """Read disk blocks back (checksums), VERIFY_CHUNK_BYTES at a time, keeping nothing.

    Returns:
        The slots of the first chunk that fails, as the tier names them (the whole
        chunk when it names none); empty when every block reads.
    """
    per_read = max(1, VERIFY_CHUNK_BYTES // disk.block_bytes)
    for i in range(0, len(slots), per_read):  # bounded memory for long hits
        chunk = slots[i : i + per_read]
        try:
            disk.read_encoded(chunk)
        except TierIOError as exc:
            return set(getattr(exc, "slots", None) or chunk)
    return set()


def write_keyed(
    src: Tier,
    src_slots: list[int],
    disk: DiskTier,
    disk_slots: list[int],
    keys: Sequence[bytes],
    token_ids: Sequence[Sequence[int]] | None = None,
    parents: Sequence[bytes | None] | None = None,
    copy: CopyBlocks | None = None,
) -> None:
    """Copy blocks to disk slots the caller took, then key them in the disk tier's
    durable index (one transaction): `keys[i]` names `disk_slots[i]`, with its token
    ids (None: none known) and parent hash. Keys go in only after the copy, so a crash
    or a failed write never leaves a key on a slot without its bytes; the slots stay
    the caller's to free when this raises.

    `copy(src, src_slots, dst, dst_slots)` copies (default `copy_blocks`)."""
    if copy is None:
        copy_blocks(src.layout, src, src_slots, disk, disk_slots)
    else:
        copy(src, src_slots, disk, disk_slots)
    tokens = [[] for _ in keys] if token_ids is None else [list(t) for t in token_ids]
    disk.put_keys(list(zip(disk_slots, keys, tokens, strict=True)), parents)
