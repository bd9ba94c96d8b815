"""The ZMQ publisher of KV events, speaking vLLM's protocol (`ZmqEventPublisher`).

Per engine step one `KVEventBatch` goes out on a PUB socket as three frames: the topic,
the batch's sequence number (8 bytes, big-endian, from 0, +1 per batch) and the
msgpack payload. The last `buffer_steps` payloads are kept for replay: a DEALER / REQ
client sends [empty frame, start sequence (8 bytes big-endian)] to the ROUTER
`replay_endpoint` and gets [empty, topic, seq, payload] for every buffered batch from
that sequence on, then [empty, empty, -1 (8 bytes, signed), empty]. An endpoint with
`*` or `::`, or an ipc / inproc one, is bound, any other is connected to (vLLM's
rule); "tcp://*:0" binds a free port (`endpoint` then names it). A thread of its own
encodes and sends, so `publish` only queues (a full queue drops the batch, counted).

Unlike vLLM's, the socket is an XPUB (the same wire to a SUB): it hears each new
subscription, and the engine then announces everything again (AllBlocksCleared, then
every block held; `wants_snapshot`), so a router that starts or restarts after the
traffic learns what each replica holds without a replay (vllm-router 0.1.17 does not
ask for one when it subscribes). Consumers already following see the same state again.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections import deque
from itertools import count
from typing import Any

from kvstrata.core.errors import MissingExtraError
from kvstrata.server.kv_events.config import KVEventsConfig
from kvstrata.store.events import EventSink, KVEvent

log = logging.getLogger("kvstrata.server")
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker (vLLM's)
INT_HASHES_ENV = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"  # vLLM's switch, and its default 1


def load_fleet() -> tuple[Any, Any]:
    """(zmq, the wire module), or MissingExtraError naming the fleet extra."""
    try:
        import zmq

        import kvstrata.server.kv_events.wire as wire
    except ImportError as exc:
        raise MissingExtraError(
            f"KV events need pyzmq and msgspec ({exc}): pip install 'kvstrata[fleet]'"
        ) from None
    return zmq, wire


class NullEventPublisher:
    """Publishes nothing (vLLM's `NullEventPublisher`)."""

    def publish(self, ts: float, events: list[KVEvent]) -> None:
        return

    def shutdown(self) -> None:
        return


class ZmqEventPublisher:
    """PUB socket + replay ROUTER + a sender thread (see the module docstring).

    Args:
        config: the endpoints, buffer and queue sizes, topic (KVEventsConfig).
        int_hashes: block hashes as 64-bit ints (vLLM's default) or bytes; default
            from $VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, as vLLM reads it.
    """

    def __init__(self, config: KVEventsConfig, int_hashes: bool | None = None) -> None:
        zmq, self._wire = load_fleet()
        if int_hashes is None:
            int_hashes = os.environ.get(INT_HASHES_ENV, "1") != "0"
        self.int_hashes = int_hashes
        self.config = config
        self.dropped = 0
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode("utf-8")
        self._seq = count()
        self._zmq = zmq
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, not only the first
        self._pub.set_hwm(config.hwm)
        self._joined = threading.Event()
        self.endpoint = self._open(self._pub, config.endpoint)
        self._replay = None
        self.replay_endpoint = None
        if config.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self.replay_endpoint = self._open(self._replay, config.replay_endpoint, bind=True)
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kvstrata-kv-events", daemon=True)
        self._thread.start()

    def _open(self, sock: Any, endpoint: str, bind: bool = False) -> str:
        """Bind or connect (vLLM's rule); the endpoint a client reaches."""
        if not (
            bind or "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc:", "inproc:"))
        ):
            sock.connect(endpoint)
            return endpoint
        sock.bind(endpoint)
        return (
            sock.getsockopt_string(self._zmq.LAST_ENDPOINT) if endpoint.endswith(":0") else endpoint
        )

    def wants_snapshot(self) -> bool:
        """Whether a subscriber joined since the last call (the engine then announces
        everything it holds again)."""
        if self._joined.is_set():
            self._joined.clear()
            return True
        return False

    def publish(self, ts: float, events: list[KVEvent]) -> None:
        """Queue one step's events (never blocks: a full queue drops them, counted)."""
        if not self._running:
            raise RuntimeError("the KV event publisher is shut down")
        try:
            self._queue.put_nowait((ts, events))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                log.warning("kvstrata: the KV event queue is full; dropping event batches")

    def shutdown(self, timeout: float = 1.0) -> None:
        """Send what is queued (up to `timeout` s), stop the thread, close the sockets."""
        if not self._running:
            return
        self._running = False
        self._queue.put(None)
        self._thread.join(timeout)
        self._pub.close(linger=int(timeout * 1000))
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        encode = self._wire.msgspec.msgpack.Encoder().encode
        while True:
            while self._pub.poll(0):  # (un)subscriptions: b"\x01" + topic joins
                if self._pub.recv()[:1] == b"\x01":
                    self._joined.set()
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:  # noqa: BLE001 - replay is best effort; publishing goes on
                    log.exception("kvstrata: a KV event replay request failed")
            try:
                item = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if item is None:
                return
            try:
                payload = encode(self._wire.to_wire(item[0], item[1], self.int_hashes))
                seq = next(self._seq)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
            except Exception:  # noqa: BLE001 - one bad batch must not stop the publisher
                log.exception("kvstrata: publishing a KV event batch failed")

    def _serve_replay(self) -> None:
        """Answer one replay request with every buffered batch from its start sequence."""
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("kvstrata: invalid KV event replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                frame = (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                self._replay.send_multipart(frame)
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))


def make_publisher(config: KVEventsConfig) -> EventSink | None:
    """The publisher a config asks for; None when events are off (nothing recorded)."""
    return ZmqEventPublisher(config) if config.enabled else None
