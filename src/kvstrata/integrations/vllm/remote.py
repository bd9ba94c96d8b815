"""The remote tier in the vLLM backend: vLLM servers sharing one Redis / Valkey.

Keys: vLLM's offload key of a block (its prompt's chained block hash, plus the KV
group; equal in every vLLM process started with the same PYTHONHASHSEED) hashed again
under a namespace digest — `core.hashing.block_namespace` of the plan's model identity
(model, weights, dtype, vLLM's config digests, layout, page reading; not the local
host / disk codecs: servers with other local tiers share remote blocks) and
`namespace_digest` with the remote format's version, codec and block shape. Another
model, weights or layout is another key. Values are tiers/remote_format.py's (header,
namespace, block hash, lengths, XXH3-64, checked on every read); vLLM's keys do not
carry the token ids, so a value's token ids are zeros and the chained content hash
is what ties it to a prompt.

Reads are asynchronous, as vLLM's OffloadingManager allows: a lookup of a block no
local tier holds answers RETRY (vLLM defers the request a step) and queues the key; at
the end of the scheduler's step the queued keys are fetched in one batched round trip
on a thread, within its deadline (below); the next lookup of a key takes the
checked value (the store installs it in a host slot: a hit) or its absence (a miss,
remembered for ABSENT_S). A value failing a check is a miss, counted and deleted from
the server; a server that is down, in backoff or past the deadline costs misses,
never a failed request.

The session (tiers/remote_session.py, shared with the store) holds the link model,
the load-or-recompute decision, the checked batched read and the write-behind; this
adapter keeps what is vLLM's: its keys, the deferred lookups and the step timing.
The load-or-recompute rule (tiers/remote_link.py) decides each step's batch: its bytes
against its tokens. The scheduler sees vLLM's prefill speed through the store calls
it makes: `prepare_store` names the blocks a step completes, and the time from one
step's end (`end_step`, at vLLM's on_schedule_end) to the next is that step's
execution. A step in which a request completes two or more blocks is a prefill (a
decode step completes at most one per request) and measures tokens per second; a
refused batch is a miss at once (vLLM recomputes), counted as a recompute decision.
The deadline of a read is the link model's for its bytes and tokens (at least
remote_timeout).

Writes: every block vLLM stores is copied out of its host slot on the scheduler
thread and sent by the tier's writer thread (a full queue drops writes, counted).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import threading
import time
from typing import Any

from kvstrata.core.hashing import block_namespace, namespace_digest
from kvstrata.integrations.vllm.backend_plan import (
    NAMESPACE_VERSION,
    BackendPlan,
    _digest,
    remote_codec,
)
from kvstrata.integrations.vllm.options import VllmOptions
from kvstrata.tiers.base import Encoded, Tier
from kvstrata.tiers.remote import RemoteTier
from kvstrata.tiers.remote_format import RemoteFormat
from kvstrata.tiers.remote_session import RemoteSession, Wanted

log = logging.getLogger(__name__)
ABSENT_S = 2.0  # a key the server did not have is a miss for this long (no re-asking)
LOCAL_ONLY = ("host_codec", "disk_codec", "disk_compress")  # not part of the remote namespace
RETRY, FOUND, ABSENT = "retry", "found", "absent"
STEP_WAIT_S = 0.005  # a step's end waits this long for a remote read in flight
CLOSE_FLUSH_S = 30.0  # closing sends the queued writes for at most this long


class VllmRemote:
    """One vLLM engine's view of the remote tier (scheduler process).

    Args:
        plan: the engine's plan, named with the model identity.
        options: the backend's settings (remote_url, remote_codec, remote_ttl,
            remote_timeout: the floor of a read's deadline).
        tier: the RemoteTier to use (tests); default: one built from the options.
    """

    def __init__(self, plan: BackendPlan, options: VllmOptions, tier: RemoteTier | None = None):
        cache = options.cache
        assert cache.remote_url is not None
        self.format = RemoteFormat(plan.layout, remote_codec(cache, plan.layout, plan.page_layout))
        model = {k: v for k, v in plan.namespace.items() if k not in LOCAL_ONLY}
        extra = block_namespace(
            _digest(model, b"kvstrata.model"), {"backend": "vllm"}, NAMESPACE_VERSION, "0", ""
        )
        self.namespace = namespace_digest(extra, **self.format.shape_names)
        self._zeros = (0,) * plan.layout.block_size
        self.tier = tier or RemoteTier(
            cache.remote_url, ttl=cache.remote_ttl, timeout=cache.remote_timeout
        )
        self.session = RemoteSession(self.tier, self.format)
        self._lock = threading.Lock()
        self._queued: dict[bytes, bytes] = {}  # our key -> remote block hash, not yet asked
        self._asked: set[bytes] = set()  # in a round trip now
        self._found: dict[bytes, Encoded] = {}  # checked values, not yet installed
        self._absent: dict[bytes, float] = {}  # our key -> until when it is a miss
        self._fetcher: threading.Thread | None = None
        self._seen: tuple[int, ...] = ()
        self._block_tokens = plan.layout.block_size
        self._step_began: float | None = None  # perf_counter() of the last step's end
        self._step_blocks = 0  # blocks prefilled by the step since then
        self.counters = dict.fromkeys(("remote_hits", "remote_misses", "remote_corrupt"), 0)
        self._written: list[bytes] = []  # vLLM keys the server stored, for KV events

    def block_hash(self, vllm_key: bytes) -> bytes:
        """The remote tier's block hash of a vLLM offload key (under the namespace)."""
        h = hashlib.blake2b(digest_size=16, person=b"kvstrata.vrem")
        h.update(bytes.fromhex(self.namespace))
        h.update(vllm_key)
        return h.digest()

    def remote_key(self, vllm_key: bytes) -> bytes:
        return self.session.key(self.namespace, self.block_hash(vllm_key))

    # -- reads --------------------------------------------------------------------------
    def lookup(self, key: bytes, vllm_key: bytes) -> tuple[str, Encoded | None]:
        """(FOUND, the block's fields) — taken: the caller installs them —, (RETRY,
        None): asked or about to be, or (ABSENT, None)."""
        with self._lock:
            fields = self._found.pop(key, None)
            if fields is not None:
                self.counters["remote_hits"] += 1
                return FOUND, fields
            if key in self._asked or key in self._queued:
                return RETRY, None
            until = self._absent.get(key)
            if until is not None:
                if time.monotonic() < until:
                    return ABSENT, None
                del self._absent[key]
            if not self.tier.available:
                return ABSENT, None
            self._queued[key] = self.block_hash(vllm_key)
            return RETRY, None

    def computed(self, vllm_keys: list[bytes]) -> None:
        """A request's blocks this step completes (vLLM's prepare_store of keys not
        stored yet): two or more are a prefill, timed at the next end_step. vLLM's
        keys end in a 4-byte KV group index (make_offload_key): a block stored for
        two groups is one block of tokens."""
        blocks = len({bytes(k)[:-4] for k in vllm_keys})
        if blocks >= 2:
            self._step_blocks += blocks

    def _time_step(self) -> None:
        now = time.perf_counter()
        if self._step_blocks and self._step_began is not None:
            tokens = self._step_blocks * self._block_tokens
            self.session.observe_compute(tokens, now - self._step_began)
        self._step_began, self._step_blocks = now, 0

    def end_step(self) -> bool:
        """Fetch what this step's lookups queued, in one round trip on a thread (or
        refuse it: the cost rule); True when something changed since the last step
        (the stats file is rewritten)."""
        self._time_step()
        stats = self.tier.stats
        seen = (stats.writes, stats.writes_dropped, stats.hits, stats.misses, stats.corrupt)
        changed, self._seen = seen != self._seen, seen
        fetcher = self._fetcher
        if fetcher is not None and fetcher.is_alive():
            # vLLM steps again at once while a deferred request waits: give the read
            # the CPU (and the GIL) for a moment instead of spinning
            fetcher.join(STEP_WAIT_S)
        with self._lock:
            if not self._queued or (self._fetcher is not None and self._fetcher.is_alive()):
                return changed
            batch, self._queued = self._queued, {}
            now = time.monotonic()
            self._absent = {k: t for k, t in self._absent.items() if t > now}
            deadline = self.session.worth_loading(len(batch), len(batch) * self._block_tokens)
            if deadline is None:  # recomputing is faster
                self._absent.update(dict.fromkeys(batch, now + ABSENT_S))
                return True
            self._asked.update(batch)
        self._fetcher = threading.Thread(
            target=self._fetch,
            args=(batch, deadline),
            name="kvstrata-vllm-remote-read",
            daemon=True,
        )
        self._fetcher.start()
        return True

    def _fetch(self, batch: dict[bytes, bytes], deadline: float) -> None:
        ns = self.namespace
        wanted = [Wanted(self.session.key(ns, h), ns, h, self._zeros) for h in batch.values()]
        found: dict[bytes, Encoded] = {}
        refused = 0
        try:
            answer = self.session.fetch(wanted, deadline)
            if answer is None:  # the server did not answer: every block is a miss
                self.tier.stats.misses += len(batch)
            else:
                refused = len(answer.refused)
                found = {
                    ours: fields
                    for ours, fields in zip(batch, answer.fields, strict=True)
                    if fields is not None
                }
        except Exception:  # noqa: BLE001 - a failed read is a miss, never a failed step
            log.exception("kvstrata: a remote read failed: the blocks are recomputed")
            self.tier.stats.misses += len(batch)
        until = time.monotonic() + ABSENT_S
        with self._lock:
            self._asked.difference_update(batch)
            self._found.update(found)
            for ours in batch:
                if ours not in found:
                    self._absent[ours] = until
            self.counters["remote_misses"] += len(batch) - len(found) - refused
            self.counters["remote_corrupt"] += refused
            self.tier.stats.hits += len(found)

    def write_into(self, host: Tier, slot: int, fields: Encoded) -> None:
        """Install a fetched block in a host slot."""
        self.session.install(host, [slot], [fields])

    # -- writes -------------------------------------------------------------------------
    def offer(self, host: Tier, entries: list[tuple[int, bytes]]) -> None:
        """Queue blocks just stored on the host tier, as (host slot, vLLM key), for the
        server (copied now, encoded and sent by the writer thread)."""
        metas = [(self.namespace, self.block_hash(k), self._zeros) for _, k in entries]
        written = functools.partial(self._stored, [k for _, k in entries])
        self.session.write_behind(host, [slot for slot, _ in entries], metas, written)

    def _stored(self, vllm_keys: list[bytes], results: list[bool]) -> None:
        """The writer thread's report: which offered blocks the server stored."""
        with self._lock:
            self._written += [k for k, ok in zip(vllm_keys, results, strict=True) if ok]

    def take_written(self) -> list[bytes]:
        """The vLLM keys the server stored since the last call (each block on the shared
        tier is announced once; the server's own evictions are never reported)."""
        with self._lock:
            out, self._written = self._written, []
        return out

    # -- lifecycle ----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        out = self.session.stats()
        out.pop("latency_counts", None)
        out.pop("latency_buckets_s", None)
        out["namespace"] = self.namespace
        out["codec"] = self.format.codec.name
        return out

    def flush(self, timeout: float = 30.0) -> bool:
        return self.session.flush(timeout)

    def close(self) -> None:
        fetcher = self._fetcher
        if fetcher is not None:
            fetcher.join(timeout=max(1.0, 2 * self.tier.timeout))
        self.session.close(CLOSE_FLUSH_S)
