"""The remote tier's keys and values: what a block looks like on a shared server.

Key (bytes): `kvstrata:<namespace digest>:<block hash hex>`. The block hash is the
store's chained content hash (kvstrata.core.hashing.block_hash, whose extra keys name
the model and its weights, dtype, codecs, layout version, layer group and tenant
salt); the namespace digest (`core.hashing.namespace_digest`) names the same keys plus
what a reader in another process must agree on: this format's version, the remote
codec, and the block's shape. Another model's or tenant's blocks are another key.

Value: a fixed header, the block's token ids, then its encoded fields:

    magic "KVSR" | version u16 | reserved u16 | namespace 16 B | block hash 16 B |
    tokens u32 | payload bytes u64 | XXH3-64 u64 |
    token ids (int64 LE, `tokens` of them) | payload

The payload is the remote codec's fields of one block, kind by kind (K then V), in
the codec's field order, each as its [layers, kv heads, rows, cols] array. The
checksum covers the header before it, the token ids and the payload. `decode` checks
every header field against what the reader expects and the checksum: a value that
fails any check is refused (`BadValue`, with the reason), never served.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from kvstrata.codecs.base import Codec
from kvstrata.core.hashing import HASH_BYTES
from kvstrata.core.layout import KINDS, BlockLayout, FieldSpec
from kvstrata.tiers.base import Encoded, Tier

FORMAT_VERSION = 1  # bump when the header or the payload layout changes
MAGIC = b"KVSR"
KEY_PREFIX = b"kvstrata:"
_HEAD = struct.Struct("<4sHH16s16sIQ")  # everything the checksum follows
_SUM = struct.Struct("<Q")
HEADER_BYTES = _HEAD.size + _SUM.size


class BadValue(ValueError):
    """A remote value that failed a check (the message says which)."""


@dataclass(frozen=True)
class RemoteFormat:
    """Keys and values of one store's blocks on a remote server.

    Args:
        layout: the block layout.
        codec: the remote codec (what the payload holds).
    """

    layout: BlockLayout
    codec: Codec

    @property
    def specs(self) -> list[tuple[str, FieldSpec]]:
        """(field key "k.data", spec) in payload order."""
        return [
            (f"{kind}.{name}", spec)
            for kind in KINDS
            for name, spec in self.codec.fields(kind, self.layout).items()
        ]

    @property
    def shape_names(self) -> dict[str, str | int]:
        """What a reader must agree on beyond the block hash (namespace digest input)."""
        lay = self.layout
        return {
            "format": FORMAT_VERSION,
            "remote_codec": self.codec.name,
            "shape": f"{lay.num_layers}x{lay.num_kv_heads}x{lay.head_dim}x{lay.dim_v}",
            "block_size": lay.block_size,
            "dtype": str(lay.dtype).removeprefix("torch."),
        }

    @property
    def payload_bytes(self) -> int:
        lead = self.layout.num_layers * self.layout.num_kv_heads
        return sum(lead * spec.nbytes for _, spec in self.specs)

    @property
    def value_bytes(self) -> int:
        return HEADER_BYTES + 8 * self.layout.block_size + self.payload_bytes

    @staticmethod
    def key(namespace: str, block_hash: bytes) -> bytes:
        return KEY_PREFIX + namespace.encode() + b":" + block_hash.hex().encode()

    # -- values -------------------------------------------------------------------------
    def encode(
        self, namespace: str, block_hash: bytes, token_ids: tuple[int, ...], fields: Encoded
    ) -> bytes:
        """One block's value. `fields`: field key -> [L, Hkv, rows, cols] of one block."""
        tokens = np.asarray(token_ids, dtype="<i8").tobytes()
        parts = [
            fields[key].contiguous().view(torch.uint8).numpy().tobytes() for key, _ in self.specs
        ]
        payload = b"".join(parts)
        head = _HEAD.pack(
            MAGIC,
            FORMAT_VERSION,
            0,
            bytes.fromhex(namespace),
            block_hash,
            len(token_ids),
            len(payload),
        )
        h = xxhash.xxh3_64()
        for part in (head, tokens, payload):
            h.update(part)
        return b"".join((head, _SUM.pack(h.intdigest()), tokens, payload))

    def decode(
        self, value: bytes, namespace: str, block_hash: bytes
    ) -> tuple[tuple[int, ...], Encoded]:
        """(token ids, fields of one block) of a value, after every check (BadValue)."""
        if len(value) < HEADER_BYTES:
            raise BadValue(f"{len(value)} bytes: shorter than the header")
        magic, version, _, ns, stored_hash, num_tokens, payload_len = _HEAD.unpack_from(value)
        if magic != MAGIC:
            raise BadValue("not a kvstrata block (magic)")
        if version != FORMAT_VERSION:
            raise BadValue(f"format version {version}, this reader reads {FORMAT_VERSION}")
        if ns != bytes.fromhex(namespace) or stored_hash != block_hash:
            raise BadValue("the value names another namespace or block")
        if num_tokens != self.layout.block_size or payload_len != self.payload_bytes:
            raise BadValue(f"lengths {num_tokens} tokens / {payload_len} bytes do not match")
        if len(value) != HEADER_BYTES + 8 * num_tokens + payload_len:
            raise BadValue(f"{len(value)} bytes: truncated or padded")
        (stored_sum,) = _SUM.unpack_from(value, _HEAD.size)
        view = memoryview(value)
        h = xxhash.xxh3_64()
        h.update(view[: _HEAD.size])
        h.update(view[HEADER_BYTES:])
        if h.intdigest() != stored_sum:
            raise BadValue("checksum mismatch")
        start = HEADER_BYTES + 8 * num_tokens
        tokens = tuple(np.frombuffer(value, dtype="<i8", count=num_tokens, offset=HEADER_BYTES))
        lay = self.layout
        fields: Encoded = {}
        for key, spec in self.specs:
            n = lay.num_layers * lay.num_kv_heads * spec.nbytes
            raw = torch.frombuffer(bytearray(view[start : start + n]), dtype=torch.uint8)
            fields[key] = raw.view(spec.dtype).reshape(
                lay.num_layers, lay.num_kv_heads, spec.rows, spec.cols
            )
            start += n
        return tuple(int(t) for t in tokens), fields

    # -- moving blocks between a local tier and values ------------------------------------
    def read_tier(self, tier: Tier, slots: list[int]) -> Encoded:
        """A copy of `slots` of a local tier as remote-codec fields, each
        [L, Hkv, n * rows, cols] (the tier's own bytes when its codec is the remote one,
        else decoded to raw and encoded again)."""
        if tier.codec.name == self.codec.name:
            return {k: t.cpu() for k, t in tier.read_encoded(slots).items()}  # copies
        lay, n, out = self.layout, len(slots), {}
        raw = {kind: torch.empty(lay.raw_shape(kind, n), dtype=lay.dtype) for kind in KINDS}
        tier.read_blocks(slots, raw["k"], raw["v"])
        for kind in KINDS:
            fields = {
                f: torch.empty(
                    (lay.num_layers, lay.num_kv_heads, n * s.rows, s.cols), dtype=s.dtype
                )
                for f, s in self.codec.fields(kind, lay).items()
            }
            self.codec.encode(kind, raw[kind], fields)
            out.update({f"{kind}.{f}": t for f, t in fields.items()})
        return out

    def split(self, data: Encoded, i: int) -> Encoded:
        """Block `i` of fields read for several blocks (`read_tier`)."""
        return {key: data[key].narrow(2, i * spec.rows, spec.rows) for key, spec in self.specs}

    def write_tier(self, tier: Tier, slots: list[int], blocks: list[Encoded]) -> None:
        """Write decoded values (one `Encoded` per slot) into a local tier."""
        data = {key: torch.cat([b[key] for b in blocks], dim=2) for key, _ in self.specs}
        if tier.codec.name == self.codec.name:
            tier.write_encoded(slots, data)
            return
        lay, codec = self.layout, self.codec
        raw = {
            kind: torch.empty(lay.raw_shape(kind, len(slots)), dtype=lay.dtype) for kind in KINDS
        }
        for kind in KINDS:
            codec.decode(kind, {f: data[f"{kind}.{f}"] for f in codec.fields(kind, lay)}, raw[kind])
        tier.write_blocks(slots, raw["k"], raw["v"])


assert HASH_BYTES == 16, "the header holds 16-byte hashes and namespaces"
