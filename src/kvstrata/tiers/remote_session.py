"""One client's session with the remote tier: the steps the store and the vLLM backend
both take, written once.

- **What recomputing costs here**: the client reports how long its prefill steps
  take (`observe_compute`), so the link model can weigh a load against a recompute.
- **Load or recompute** (`worth_loading`): for a batch of blocks and the tokens they
  would save, the link model (tiers/remote_link.py) says whether reading them is
  faster; the decision is counted, and a link not measured yet is measured in the
  background (never on a request's own read). A yes comes with the batch's deadline.
- **Batched fetch, checked** (`fetch`): one round trip within the deadline; every
  value is checked (tiers/remote_format.py: header, namespace, block hash, lengths,
  XXH3, and the token ids the caller expects). A value that fails is a miss, counted,
  deleted from the server and recomputed by the caller, never served.
- **Write-behind** (`write_behind`): blocks are copied out of a local tier now and
  encoded and sent by the tier's writer thread; a dropped write costs another server
  a recompute, nothing else.

What differs stays with the callers: which blocks to ask for and how their keys are
made (`store.remote`: the prompt's chained block hashes per layer group and salt;
`integrations.vllm.remote`: vLLM's offload keys, read a step later), and where a
fetched block is installed.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvstrata.tiers.base import Encoded, Tier
from kvstrata.tiers.remote import RemoteTier
from kvstrata.tiers.remote_format import BadValue, RemoteFormat

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Wanted:
    """One block to fetch: its server key, namespace and block hash (checked against
    the value's), and the token ids the value must carry."""

    key: bytes
    namespace: str
    block_hash: bytes
    token_ids: tuple[int, ...]


@dataclass
class Fetched:
    """A batch's answer: the checked fields of each wanted block (None: absent or
    refused), and the keys refused (corrupt, deleted from the server)."""

    fields: list[Encoded | None]
    refused: list[bytes]

    @property
    def num_found(self) -> int:
        return sum(f is not None for f in self.fields)


class RemoteSession:
    """A remote tier used with one value format (see the module docstring).

    Args:
        tier: the remote tier (connection, writer thread, stats, link model); started
            here for this format's value size.
        fmt: how blocks become values and back.
    """

    def __init__(self, tier: RemoteTier, fmt: RemoteFormat) -> None:
        self.tier = tier
        self.format = fmt
        tier.start(fmt.value_bytes)

    @property
    def available(self) -> bool:
        return self.tier.available

    def key(self, namespace: str, block_hash: bytes) -> bytes:
        return self.format.key(namespace, block_hash)

    # -- what recomputing costs here ----------------------------------------------------
    def observe_compute(self, tokens: int, seconds: float) -> None:
        self.tier.link.observe_compute(tokens, seconds)

    # -- load or recompute --------------------------------------------------------------
    def worth_loading(self, num_blocks: int, tokens: int) -> float | None:
        """The deadline (seconds) for reading `num_blocks` values instead of
        recomputing `tokens` tokens, or None when recomputing is predicted faster."""
        nbytes, link = num_blocks * self.format.value_bytes, self.tier.link
        if link.needs_measure():
            self.tier.remeasure()  # in the background: never a request's own read
        if not link.worth_loading(nbytes, tokens):
            return None
        return self.tier.deadline(nbytes, tokens)

    # -- reads --------------------------------------------------------------------------
    def fetch(self, wanted: Sequence[Wanted], deadline: float) -> Fetched | None:
        """Read `wanted` in one round trip and check every value; None when the server
        did not answer (down, in backoff or past the deadline: counted by the tier).
        Refused values are deleted and counted (`corrupt`), absent ones counted as
        misses; hits are the caller's to count (what it could use)."""
        keys = [w.key for w in wanted]
        values = self.tier.get(keys, self.format.value_bytes, deadline)
        if values is None:
            return None
        fields: list[Encoded | None] = []
        refused: list[bytes] = []
        for want, value in zip(wanted, values, strict=True):
            fields.append(None if value is None else self._check(want, value, refused))
        self.tier.delete(refused)
        stats = self.tier.stats
        stats.corrupt += len(refused)
        stats.misses += sum(v is None for v in values)
        return Fetched(fields, refused)

    def _check(self, want: Wanted, value: bytes, refused: list[bytes]) -> Encoded | None:
        try:
            tokens, fields = self.format.decode(value, want.namespace, want.block_hash)
            if tokens != want.token_ids:
                raise BadValue("token ids differ from the ones asked for")
        except BadValue as exc:
            log.warning("kvstrata: a remote block was refused (%s): recomputed", exc)
            refused.append(want.key)
            return None
        return fields

    def install(self, tier: Tier, slots: list[int], blocks: list[Encoded]) -> None:
        """Write fetched blocks into slots of a local tier."""
        self.format.write_tier(tier, slots, blocks)

    # -- writes -------------------------------------------------------------------------
    def write_behind(
        self,
        tier: Tier,
        slots: list[int],
        metas: list[tuple[str, bytes, tuple[int, ...]]],
        written: Callable[[list[bool]], object] | None = None,
    ) -> None:
        """Queue the blocks in `slots` of `tier` for the server, as (namespace, block
        hash, token ids) each: copied now, encoded and sent by the writer thread, which
        calls `written` with which of them the server stored."""
        if not slots:
            return
        if not self.tier.available:
            self.tier.stats.writes_dropped += len(slots)
            return
        data = self.format.read_tier(tier, slots)
        make = functools.partial(self._values, metas, data)
        self.tier.submit(make, len(slots) * self.format.value_bytes, len(slots), written)

    def _values(self, metas: list, data: Encoded) -> list[tuple[bytes, bytes]]:
        """(key, value) of queued blocks (on the writer thread)."""
        fmt = self.format
        return [
            (fmt.key(ns, h), fmt.encode(ns, h, tokens, fmt.split(data, i)))
            for i, (ns, h, tokens) in enumerate(metas)
        ]

    # -- lifecycle ----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return self.tier.as_dict()

    def flush(self, timeout: float = 30.0) -> bool:
        return self.tier.flush(timeout)

    def close(self, flush_timeout: float = 5.0) -> None:
        self.tier.close(flush_timeout)
