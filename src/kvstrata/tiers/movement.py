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
"""

from __future__ import annotations

from collections.abc import Callable

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
