"""RemoteTier: a Redis / Valkey server that many stores, processes and machines share.

Not a slot arena like the other tiers: a content-addressed map from block keys to
block values (tiers/remote_format.py) on a server this process does not own. The
store reads it at admission — the missing blocks of a prompt's prefix in one round
trip (a pipeline of MGETs) with a deadline (`timeout`) — and writes every full block
it computes, asynchronously: a background thread encodes and sends queued blocks, and
a full queue (`max_pending_bytes`) drops new writes (counted), never blocks a step.

Faults never fail a request, they cost a recompute: a server that is down, refuses a
read, passes its deadline or drops a connection makes the read a miss and starts a
backoff (0.2 s doubling to 10 s) during which the tier is skipped; the first request
after it reconnects (an empty restarted server gives misses, then hits again as
blocks are written). What the store does with values (checks, the cost rule) is
store/remote.py; the link model is tiers/remote_link.py.

Start-up (`start`) refuses, with one line naming remote_url: a password the server
rejects, and a server whose maxmemory holds fewer than MIN_BLOCKS blocks. A server
that cannot be reached at start is a RuntimeWarning: the store runs without it until
it answers.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvstrata.config import check_remote_url, redact_url
from kvstrata.core.errors import ConfigError, MissingExtraError
from kvstrata.core.units import format_bytes
from kvstrata.tiers.remote_link import LinkModel

PASSWORD_ENV = "KVSTRATA_REMOTE_PASSWORD"
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.2, 10.0
MIN_BLOCKS = 16  # a server that cannot hold this many blocks is refused at start
DEFAULT_PENDING_BYTES = 256 << 20
READ_CHUNK_BYTES = 32 << 20  # one MGET of the pipeline asks for at most this much
PROBE_BYTES = 256 << 10  # the start-up bandwidth probe
# Round-trip latency histogram buckets (seconds), Prometheus style (cumulative).
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

# (make the (key, value) pairs, bytes held, blocks) — `make` runs on the writer thread
WriteJob = tuple[Callable[[], list[tuple[bytes, bytes]]], int, int]


def load_redis() -> Any:
    """The `redis` client package (the `remote` extra), or MissingExtraError."""
    try:
        import redis
    except ModuleNotFoundError as exc:
        raise MissingExtraError(
            "the remote tier (remote_url) needs the redis client: pip install 'kvstrata[remote]'"
        ) from exc
    return redis


@dataclass
class RemoteStats:
    """Counters of a remote tier (blocks unless named otherwise)."""

    hits: int = 0
    misses: int = 0
    corrupt: int = 0  # values that failed a check: refused, deleted, recomputed
    timeouts: int = 0  # reads past their deadline
    errors: int = 0  # reads that failed (server down, connection lost)
    skipped: int = 0  # lookups that did not ask a server in backoff
    reads: int = 0  # round trips that answered
    bytes_read: int = 0
    bytes_written: int = 0
    writes: int = 0
    writes_dropped: int = 0  # queue full or server down
    write_errors: int = 0  # refused by the server (e.g. out of memory) or failed to send
    reconnects: int = 0
    no_room: int = 0  # hits not installed: no local tier had room for them
    latency_counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    latency_sum_s: float = 0.0

    def observe_latency(self, seconds: float) -> None:
        i = next((i for i, b in enumerate(LATENCY_BUCKETS) if seconds <= b), len(LATENCY_BUCKETS))
        self.latency_counts[i] += 1
        self.latency_sum_s += seconds


class RemoteTier:
    """A shared Redis-protocol server holding encoded blocks (see the module docstring).

    Args:
        url: redis://[:password@]host[:port][/db] or rediss:// (TLS); without a
            password in the URL, $KVSTRATA_REMOTE_PASSWORD is used if set.
        ttl: seconds a written block lives (None: until the server evicts it).
        timeout: the deadline of one read, seconds.
        max_pending_bytes: writes queued beyond this are dropped (counted).
    """

    name = "remote"

    def __init__(
        self,
        url: str,
        *,
        ttl: int | None = None,
        timeout: float = 0.5,
        max_pending_bytes: int = DEFAULT_PENDING_BYTES,
    ) -> None:
        redis = load_redis()
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        parts = check_remote_url(url)
        self.url = redact_url(url)
        self.ttl, self.timeout, self.max_pending_bytes = ttl, timeout, max_pending_bytes
        self._errors = (redis.ConnectionError, redis.TimeoutError, OSError)
        self._redis = redis
        password = None if parts.password else os.environ.get(PASSWORD_ENV) or None

        def client(socket_timeout: float) -> Any:
            # one immediate retry on a dropped connection (a pooled socket the server
            # closed when it restarted), none on a timeout: the deadline is the deadline
            retry = Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,))
            return redis.Redis.from_url(
                url,
                password=password,
                socket_timeout=socket_timeout,
                socket_connect_timeout=timeout,
                retry=retry,
                health_check_interval=0,
            )

        self._reader = client(timeout)
        self._writer = client(max(5.0, 4 * timeout))
        self.stats = RemoteStats()
        self.link = LinkModel()
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._backoff = 0.0
        self._cond = threading.Condition()
        self._queue: deque[WriteJob] = deque()
        self._pending_bytes = 0
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(
            target=self._run, name="kvstrata-remote-writer", daemon=True
        )
        self._thread.start()

    # -- health -------------------------------------------------------------------------
    @property
    def available(self) -> bool:
        """Not in a backoff after a failure."""
        return time.monotonic() >= self._down_until

    def _ok(self) -> None:
        with self._lock:
            if self._backoff:
                self.stats.reconnects += 1
            self._backoff, self._down_until = 0.0, 0.0

    def _fail(self) -> None:
        with self._lock:
            self._backoff = min(max(2 * self._backoff, BACKOFF_MIN_S), BACKOFF_MAX_S)
            self._down_until = time.monotonic() + self._backoff

    def start(self, value_bytes: int) -> None:
        """Check the server once (see the module docstring) and measure the link."""
        redis = self._redis
        try:
            self._reader.ping()  # connects: the second one measures the round trip
            t0 = time.perf_counter()
            self._reader.ping()
            self.link.observe_ping(time.perf_counter() - t0)
            maxmemory = self._maxmemory()
        except redis.AuthenticationError as exc:
            raise ConfigError.field(
                "remote_url",
                self.url,
                f"the server refused the credentials ({exc}): put the password in the URL "
                f"(redis://:PASSWORD@host) or ${PASSWORD_ENV}",
            ) from None
        except self._errors as exc:
            warnings.warn(
                f"remote tier {self.url} is unreachable at start ({exc}): running without it, "
                "retrying with backoff",
                RuntimeWarning,
                stacklevel=2,
            )
            self._fail()
            return
        if maxmemory and maxmemory < MIN_BLOCKS * value_bytes:
            raise ConfigError.field(
                "remote_url",
                self.url,
                f"the server's maxmemory ({format_bytes(maxmemory)}) holds fewer than "
                f"{MIN_BLOCKS} blocks of {format_bytes(value_bytes)}: raise it (CONFIG SET "
                "maxmemory) or store fewer bytes per block (block_size, remote_codec)",
            )
        self._probe()

    def _maxmemory(self) -> int:
        try:
            return int(self._reader.config_get("maxmemory").get("maxmemory", 0))
        except self._redis.ResponseError:  # CONFIG is disabled on many managed servers
            return 0

    def _probe(self) -> None:
        """One real read of PROBE_BYTES: the link's first bandwidth figure."""
        key = b"kvstrata:probe:" + secrets.token_hex(8).encode()
        try:
            self._writer.set(key, b"\0" * PROBE_BYTES, px=10_000)
            t0 = time.perf_counter()
            self._reader.get(key)
            self.link.observe_read(time.perf_counter() - t0, PROBE_BYTES)
            self._writer.delete(key)
        except (*self._errors, self._redis.ResponseError):
            pass  # no figure yet: the first real read gives one

    def ping(self) -> float | None:
        """Round-trip seconds of a PING, or None (the tier then backs off)."""
        try:
            t0 = time.perf_counter()
            self._reader.ping()
        except self._errors:
            self._fail()
            return None
        elapsed = time.perf_counter() - t0
        self.link.observe_ping(elapsed)
        self._ok()
        return elapsed

    # -- reads --------------------------------------------------------------------------
    def get(self, keys: list[bytes], value_bytes: int) -> list[bytes | None] | None:
        """The values of `keys` (None where absent) in one round trip, or None when the
        server is in backoff, down, or past the deadline (each counted)."""
        if not keys:
            return []
        if not self.available:
            self.stats.skipped += 1
            return None
        per_get = max(1, READ_CHUNK_BYTES // max(1, value_bytes))
        t0 = time.perf_counter()
        try:
            pipe = self._reader.pipeline(transaction=False)
            for i in range(0, len(keys), per_get):
                pipe.mget(keys[i : i + per_get])
            values = [v for chunk in pipe.execute() for v in chunk]
        except self._redis.TimeoutError:
            elapsed = time.perf_counter() - t0
            self.stats.timeouts += 1
            self.stats.observe_latency(elapsed)
            # what it cost, as latency: crediting the bytes asked for to the time it
            # took to give up would make a link that never delivered look fast
            self.link.observe_read(elapsed, 0)
            self._fail()
            return None
        except (*self._errors, self._redis.ResponseError):
            self.stats.errors += 1
            self._fail()
            return None
        elapsed = time.perf_counter() - t0
        nbytes = sum(len(v) for v in values if v is not None)
        self.stats.reads += 1
        self.stats.bytes_read += nbytes
        self.stats.observe_latency(elapsed)
        self.link.observe_read(elapsed, nbytes)
        self._ok()
        return values

    # -- writes -------------------------------------------------------------------------
    def submit(
        self, make: Callable[[], list[tuple[bytes, bytes]]], nbytes: int, blocks: int
    ) -> bool:
        """Queue a write of `blocks` blocks (`make` builds their (key, value) pairs on the
        writer thread); False when dropped: the queue is full or the server down."""
        with self._cond:
            if self._closed or not self.available:
                self.stats.writes_dropped += blocks
                return False
            if self._pending_bytes + nbytes > self.max_pending_bytes:
                self.stats.writes_dropped += blocks
                return False
            self._queue.append((make, nbytes, blocks))
            self._pending_bytes += nbytes
            self._cond.notify_all()
            return True

    def delete(self, keys: list[bytes]) -> None:
        """Delete keys (values that failed their checks), asynchronously."""
        if keys:
            with self._cond:
                if not self._closed:
                    self._queue.append((lambda: [(k, b"") for k in keys], 0, 0))
                    self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                make, nbytes, blocks = self._queue.popleft()
                self._busy = True
            try:
                self._send(make, blocks)
            finally:
                with self._cond:
                    self._pending_bytes -= nbytes
                    self._busy = False
                    self._cond.notify_all()

    def _send(self, make: Callable[[], list[tuple[bytes, bytes]]], blocks: int) -> None:
        if not self.available:
            self.stats.writes_dropped += blocks
            return
        try:
            items = make()
        except Exception:  # noqa: BLE001 - a block that cannot be encoded is not written
            self.stats.write_errors += blocks
            return
        try:
            pipe = self._writer.pipeline(transaction=False)
            for key, value in items:
                if blocks == 0:
                    pipe.delete(key)
                else:
                    pipe.set(key, value, ex=self.ttl)
            results = pipe.execute(raise_on_error=False)
        except self._errors:
            self.stats.writes_dropped += blocks
            self._fail()
            return
        self._ok()
        if blocks:
            failed = sum(isinstance(r, Exception) for r in results)
            self.stats.write_errors += failed
            self.stats.writes += len(items) - failed
            self.stats.bytes_written += sum(
                len(v) for (_, v), r in zip(items, results, strict=True) if r is True
            )

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued write is sent (or dropped); False on timeout."""
        end = time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in vars(self.stats).items() if not k.startswith("latency")}
        out["latency_buckets_s"] = list(LATENCY_BUCKETS)
        out["latency_counts"] = list(self.stats.latency_counts)
        out["latency_sum_s"] = self.stats.latency_sum_s
        out["pending_bytes"] = self._pending_bytes
        out["available"] = self.available
        out["link"] = self.link.as_dict()
        out["url"] = self.url
        return out

    def close(self, flush_timeout: float = 5.0) -> None:
        """Send what is queued (up to `flush_timeout` s), stop the writer, disconnect.
        Idempotent."""
        if self._closed:
            return
        self.flush(flush_timeout)
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join(timeout=flush_timeout)
        for client in (self._reader, self._writer):
            with contextlib.suppress(*self._errors):
                client.close()
