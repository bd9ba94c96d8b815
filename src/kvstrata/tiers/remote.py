"""RemoteTier: a Redis / Valkey server that many stores, processes and machines share.

Not a slot arena like the other tiers: a content-addressed map from block keys to
block values (tiers/remote_format.py) on a server this process does not own. The
store reads it at admission — the missing blocks of a prompt's prefix in one round
trip (a pipeline of MGETs) with a deadline — and writes every full block it computes,
asynchronously: a background thread encodes and sends queued blocks, and a full queue
(`max_pending_bytes`) drops new writes (counted), never blocks a step.

Deadlines are whole-read deadlines, not socket timeouts: a watchdog disconnects the
read's connection when its time is up, however the bytes trickle in. A read of many
blocks gets the link model's deadline for its bytes (tiers/remote_link.py:
`deadline`), at least `timeout` (remote_timeout, the floor); a PING gets `timeout`.

Faults never fail a request, they cost a recompute: a server that is down, refuses a
read, passes its deadline or drops a connection makes the read a miss and starts a
backoff (0.2 s doubling to 10 s) during which the tier is skipped; the first request
after it reconnects (an empty restarted server gives misses, then hits again as
blocks are written). What the store does with values (checks, the cost rule) is
store/remote.py; the link model is tiers/remote_link.py. The link is measured at
start (two PINGs, then a probe read of about one block) and again in the background
when a lookup finds the figures older than REMEASURE_S (`remeasure`) — never with a
request's own read.

Start-up (`start`) refuses, with one line naming remote_url: a password the server
rejects, and a server whose maxmemory holds fewer than MIN_BLOCKS blocks. A server
that cannot be reached at start (or does not answer a PING within `timeout`) is a
RuntimeWarning: the store runs without it until it answers.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
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

log = logging.getLogger(__name__)
PASSWORD_ENV = "KVSTRATA_REMOTE_PASSWORD"
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.2, 10.0
MIN_BLOCKS = 16  # a server that cannot hold this many blocks is refused at start
DEFAULT_PENDING_BYTES = 256 << 20
READ_CHUNK_BYTES = 32 << 20  # one MGET of the pipeline asks for at most this much
# The bandwidth probe reads one block's worth of bytes, within these bounds; in the
# background it may take PROBE_TIMEOUT_S (at least remote_timeout). At start, the
# connecting PING, the CONFIG GET and the probe get CONNECT_TIMEOUT_S (a TLS or AUTH
# handshake is more than a round trip; a slow link delays start-up at most that).
PROBE_MIN_BYTES, PROBE_MAX_BYTES = 256 << 10, 8 << 20
PROBE_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 2.0
# Round-trip latency histogram buckets (seconds), Prometheus style (cumulative).
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

Make = Callable[[], list[tuple[bytes, bytes]]]  # a write's (key, value) pairs
Written = Callable[[list[bool]], object]  # told which of a write's pairs the server stored
# (make, bytes held, blocks, written) — `make` and `written` run on the writer thread
WriteJob = tuple[Make, int, int, Written | None]


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


class _Cut(Exception):
    """A call passed its deadline (the watchdog disconnected it)."""


class RemoteTier:
    """A shared Redis-protocol server holding encoded blocks (see the module docstring).

    Args:
        url: redis://[:password@]host[:port][/db] or rediss:// (TLS); without a
            password in the URL, $KVSTRATA_REMOTE_PASSWORD is used if set.
        ttl: seconds a written block lives (None: until the server evicts it).
        timeout: the shortest deadline of a read (remote_timeout), seconds: a PING's,
            and a read's whenever the link model gives less.
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

        # no CLIENT SETINFO round trips on every connect (redis-py >= 7: driver_info)
        quiet = (
            {"driver_info": None}
            if "driver_info" in inspect.signature(redis.Redis.__init__).parameters
            else {"lib_name": None, "lib_version": None}
        )

        def client(socket_timeout: float | None, retries: int) -> Any:
            # the writer: one immediate retry on a dropped connection (a pooled socket
            # the server closed when it restarted); reads retry that themselves (_timed)
            retry = Retry(NoBackoff(), retries, supported_errors=(redis.ConnectionError,))
            return redis.Redis.from_url(
                url,
                password=password,
                socket_timeout=socket_timeout,
                socket_connect_timeout=max(timeout, CONNECT_TIMEOUT_S),
                retry=retry,
                health_check_interval=0,
                **quiet,
            )

        # reads block in recv until their watchdog cuts them (_timed): no socket timeout
        self._reader = client(None, 0)
        self._prober = client(None, 0)  # background measurements: never cut with a read
        self._writer = client(max(5.0, 4 * timeout), 1)
        self.stats = RemoteStats()
        self.link = LinkModel()
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._backoff = 0.0
        self._probe_bytes = PROBE_MIN_BYTES
        self._measurer: threading.Thread | None = None
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

    def _timed(self, client: Any, deadline: float, call: Callable[[], Any]) -> Any:
        """`call()` (a command of `client`) cut at `deadline` seconds: a watchdog
        disconnects the client's connections (ConnectionPool.disconnect, in use
        included), which ends a recv however slowly the bytes came. Raises _Cut past
        the deadline (or on a connect timeout), else what the call raised; a
        connection the server closed (a restart) is tried once more."""
        cut = threading.Event()

        def fire() -> None:
            cut.set()
            # the reading thread may be disconnecting it too: either one suffices
            with contextlib.suppress(Exception):
                client.connection_pool.disconnect(inuse_connections=True)

        watchdog = threading.Timer(deadline, fire)
        watchdog.daemon = True
        watchdog.start()
        try:
            for attempt in (0, 1):
                try:
                    return call()
                except Exception as exc:  # noqa: BLE001 - a cut read fails in many ways
                    if cut.is_set() or isinstance(exc, self._redis.TimeoutError):
                        raise _Cut from exc
                    if attempt or not isinstance(exc, self._redis.ConnectionError):
                        raise
            raise AssertionError("unreachable")
        finally:
            watchdog.cancel()

    def start(self, value_bytes: int) -> None:
        """Check the server once (see the module docstring) and measure the link."""
        redis = self._redis
        self._probe_bytes = min(max(value_bytes, PROBE_MIN_BYTES), PROBE_MAX_BYTES)
        slow = max(self.timeout, CONNECT_TIMEOUT_S)
        try:
            self._timed(self._reader, slow, self._reader.ping)  # connects
            t0 = time.perf_counter()
            self._timed(self._reader, self.timeout, self._reader.ping)
            self.link.observe_ping(time.perf_counter() - t0)
            maxmemory = self._timed(self._reader, slow, self._maxmemory)
        except redis.AuthenticationError as exc:
            raise ConfigError.field(
                "remote_url",
                self.url,
                f"the server refused the credentials ({exc}): put the password in the URL "
                f"(redis://:PASSWORD@host) or ${PASSWORD_ENV}",
            ) from None
        except (_Cut, *self._errors) as exc:
            why = f"no answer within {self.timeout:g} s" if isinstance(exc, _Cut) else exc
            warnings.warn(
                f"remote tier {self.url} is unreachable at start ({why}): running without "
                "it, retrying with backoff",
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
        # the first bandwidth figure, before the first lookup needs it
        with contextlib.suppress(_Cut, *self._errors, self._redis.ResponseError):
            self._probe(slow)

    def _maxmemory(self) -> int:
        try:
            return int(self._reader.config_get("maxmemory").get("maxmemory", 0))
        except self._redis.ResponseError:  # CONFIG is disabled on many managed servers
            return 0

    # -- measuring the link ---------------------------------------------------------------
    def remeasure(self) -> bool:
        """Measure the link in the background — a PING (within `timeout`), then a probe
        read of about one block (within PROBE_TIMEOUT_S) — unless a measurement is
        under way, the tier is closed or in backoff. True when one was started."""
        with self._lock:
            busy = self._measurer is not None and self._measurer.is_alive()
            if busy or self._closed or not self.available:
                return False
            self._measurer = threading.Thread(
                target=self._measure, name="kvstrata-remote-measure", daemon=True
            )
            self._measurer.start()
        return True

    def _measure(self) -> None:
        prober = self._prober
        t0 = time.perf_counter()
        try:
            self._timed(prober, self.timeout, prober.ping)
        except _Cut:  # slower than the floor: it cost at least that
            self.link.observe_ping(time.perf_counter() - t0)
            return
        except self._errors:
            self._fail()
            return
        self.link.observe_ping(time.perf_counter() - t0)
        self._ok()
        with contextlib.suppress(_Cut, *self._errors, self._redis.ResponseError):
            self._probe(max(self.timeout, PROBE_TIMEOUT_S))

    def _probe(self, wait: float) -> None:
        """One real read of about a block, within `wait` seconds: the link's bandwidth.
        A probe cut at its deadline is credited with its bytes: a bound the real
        bandwidth is below."""
        prober = self._prober
        key = b"kvstrata-probe:" + secrets.token_hex(8).encode()  # no block namespace
        self._timed(prober, wait, lambda: prober.set(key, b"\0" * self._probe_bytes, px=60_000))
        t0, value = time.perf_counter(), b""
        with contextlib.suppress(_Cut):
            value = self._timed(prober, wait, lambda: prober.get(key))
        if value is not None:  # None: evicted at once (a full server), nothing measured
            self.link.observe_read(time.perf_counter() - t0, self._probe_bytes)
        with contextlib.suppress(_Cut, *self._errors):
            self._timed(prober, wait, lambda: prober.delete(key))

    # -- reads --------------------------------------------------------------------------
    def deadline(self, nbytes: int, tokens: int) -> float:
        """The deadline of a read of `nbytes` that saves recomputing `tokens` tokens
        (the link model's, at least `timeout`)."""
        return self.link.deadline(nbytes, tokens, self.timeout)

    def get(
        self, keys: list[bytes], value_bytes: int, deadline: float | None = None
    ) -> list[bytes | None] | None:
        """The values of `keys` (None where absent) in one round trip, or None when the
        server is in backoff, down, or past `deadline` seconds (default: `timeout`);
        each counted."""
        if not keys:
            return []
        if not self.available:
            self.stats.skipped += 1
            return None
        per_get = max(1, READ_CHUNK_BYTES // max(1, value_bytes))

        def read() -> list[bytes | None]:
            pipe = self._reader.pipeline(transaction=False)
            for i in range(0, len(keys), per_get):
                pipe.mget(keys[i : i + per_get])
            return [v for chunk in pipe.execute() for v in chunk]

        t0 = time.perf_counter()
        try:
            values = self._timed(self._reader, deadline or self.timeout, read)
        except _Cut:
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
    def submit(self, make: Make, nbytes: int, blocks: int, written: Written | None = None) -> bool:
        """Queue a write of `blocks` blocks (`make` builds their (key, value) pairs on the
        writer thread); False when dropped: the queue is full or the server down.
        `written` is called on the writer thread with which pairs the server stored."""
        with self._cond:
            if self._closed or not self.available:
                self.stats.writes_dropped += blocks
                return False
            if self._pending_bytes + nbytes > self.max_pending_bytes:
                self.stats.writes_dropped += blocks
                return False
            self._queue.append((make, nbytes, blocks, written))
            self._pending_bytes += nbytes
            self._cond.notify_all()
            return True

    def delete(self, keys: list[bytes]) -> None:
        """Delete keys (values that failed their checks), asynchronously."""
        if keys:
            with self._cond:
                if not self._closed:
                    self._queue.append((lambda: [(k, b"") for k in keys], 0, 0, None))
                    self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                make, nbytes, blocks, written = self._queue.popleft()
                self._busy = True
            try:
                self._send(make, blocks, written)
            except Exception:  # noqa: BLE001 - the writer thread outlives any one write
                self.stats.write_errors += blocks
                log.exception("kvstrata: a remote write failed unexpectedly; writing goes on")
            finally:
                with self._cond:
                    self._pending_bytes -= nbytes
                    self._busy = False
                    self._cond.notify_all()

    def _send(self, make: Make, blocks: int, written: Written | None) -> None:
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
            if written is not None:
                written([r is True for r in results])

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
        out["writer_alive"] = self._thread.is_alive()
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
        measurer = self._measurer
        if measurer is not None:
            measurer.join(timeout=flush_timeout)
        for client in (self._reader, self._prober, self._writer):
            with contextlib.suppress(*self._errors):
                client.close()
