"""The ZMQ publisher of KV events: vLLM's frames on a real SUB socket over loopback TCP
(topic, 8-byte big-endian sequence, msgpack payload), its replay ROUTER, its config."""

from __future__ import annotations

import time

import pytest

from kvstrata.core.errors import ConfigError
from kvstrata.server.kv_events import KVEventsConfig, ZmqEventPublisher, make_publisher
from kvstrata.store.events import AllBlocksCleared, BlockRemoved, BlockStored

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")
wire = pytest.importorskip("kvstrata.server.kv_events.wire")

H0, H1 = bytes(range(16)), bytes(range(16, 32))
EVENTS = [
    AllBlocksCleared(),
    BlockStored((H0, H1), None, tuple(range(8)), 4, "GPU", None, 0, "device"),
    BlockRemoved((H1,), "CPU", "LOCAL", 0, "host"),
]


def _publisher(**kw) -> ZmqEventPublisher:
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0", **kw)
    return ZmqEventPublisher(config, int_hashes=kw.pop("int_hashes", True))


def _subscriber(endpoint: str, topic: bytes = b""):
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(_loopback(endpoint))
    return sub


def _loopback(endpoint: str) -> str:
    return endpoint.replace("0.0.0.0", "127.0.0.1")


def _publish_until_received(pub, sub, events) -> list[bytes]:
    """A SUB joins asynchronously (ZMQ's slow joiner): publish until a batch arrives."""
    for _ in range(100):
        pub.publish(1.5, events)
        try:
            return sub.recv_multipart(flags=zmq.NOBLOCK)
        except zmq.Again:
            time.sleep(0.05)
    raise AssertionError("no batch arrived")


def test_a_subscriber_decodes_vllms_frames():
    pub = ZmqEventPublisher(
        KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0", topic="kv"),
        int_hashes=True,
    )
    assert not pub.endpoint.endswith(":0")  # "tcp://*:0" binds a free port and names it
    sub = _subscriber(pub.endpoint, b"kv")
    try:
        topic, seq, payload = _publish_until_received(pub, sub, EVENTS)
        last = int.from_bytes(seq, "big")
        pub.publish(2.5, EVENTS[1:])
        while True:  # the 1.5 batches still in flight, then the 2.5 one: seq + 1 each
            _, seq2, payload2 = sub.recv_multipart()
            assert int.from_bytes(seq2, "big") == last + 1
            last += 1
            if msgspec.msgpack.decode(payload2)[0] == 2.5:
                break
        assert topic == b"kv" and len(seq) == 8
        raw = msgspec.msgpack.decode(payload)  # the layout itself: an array, tagged maps
        assert raw[0] == 1.5 and raw[2] == 0 and raw[1][0] == {"type": "AllBlocksCleared"}
        stored = raw[1][1]
        assert stored["type"] == "BlockStored" and stored["medium"] == "GPU"
        assert stored["block_hashes"] == [
            int.from_bytes(H0[8:], "big"),
            int.from_bytes(H1[8:], "big"),
        ]
        assert stored["parent_block_hash"] is None and stored["token_ids"] == list(range(8))
        assert stored["lora_id"] is None and stored["lora_name"] is None
        assert "locality" not in stored and "extra_keys" not in stored  # omitted defaults
        assert raw[1][2] == {
            "type": "BlockRemoved",
            "block_hashes": [int.from_bytes(H1[8:], "big")],
            "medium": "CPU",
            "group_idx": 0,
            "locality": "LOCAL",
        }
        batch = msgspec.msgpack.decode(payload2, type=wire.KVEventBatch)
        assert batch.ts == 2.5 and [type(e).__name__ for e in batch.events] == [
            "BlockStored",
            "BlockRemoved",
        ]
    finally:
        sub.close(linger=0)
        pub.shutdown()


def test_replay_sends_the_buffered_batches_then_the_end_marker():
    pub = _publisher(replay_endpoint="tcp://*:0", buffer_steps=3)
    sub = _subscriber(pub.endpoint)
    try:
        _publish_until_received(pub, sub, EVENTS)
        for _ in range(5):
            pub.publish(3.0, EVENTS[1:2])
        seen = 0
        while seen < 5:  # past the 1.5 batches still in flight, to the fifth 3.0 one
            _, seq, payload = sub.recv_multipart()
            seen += msgspec.msgpack.decode(payload)[0] == 3.0
        newest = int.from_bytes(seq, "big")
        req = zmq.Context.instance().socket(zmq.DEALER)
        req.setsockopt(zmq.RCVTIMEO, 5000)
        req.connect(_loopback(pub.replay_endpoint))
        req.send_multipart((b"", (newest - 1).to_bytes(8, "big")))
        got = []
        while True:
            empty, topic, seq, payload = req.recv_multipart()
            assert empty == b""
            if seq == (-1).to_bytes(8, "big", signed=True):
                assert topic == b"" and payload == b""
                break
            got.append(int.from_bytes(seq, "big"))
            assert msgspec.msgpack.decode(payload, type=wire.KVEventBatch).ts == 3.0
        assert got == [newest - 1, newest]
        req.send_multipart((b"", (0).to_bytes(8, "big")))  # older than the buffer: its 3
        got = []
        while (frames := req.recv_multipart())[2] != (-1).to_bytes(8, "big", signed=True):
            got.append(int.from_bytes(frames[2], "big"))
        assert got == [newest - 2, newest - 1, newest]
        req.close(linger=0)
    finally:
        sub.close(linger=0)
        pub.shutdown()


def test_bytes_hashes_when_vllms_switch_says_so(monkeypatch):
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0")
    pub = ZmqEventPublisher(config)
    sub = _subscriber(pub.endpoint)
    try:
        _, _, payload = _publish_until_received(pub, sub, EVENTS)
        assert msgspec.msgpack.decode(payload)[1][1]["block_hashes"] == [H0, H1]
    finally:
        sub.close(linger=0)
        pub.shutdown()


def test_the_config_takes_vllms_keys_and_defaults():
    config = KVEventsConfig.from_json('{"enable_kv_cache_events": true}')
    assert config.publisher == "zmq" and config.endpoint == "tcp://*:5557" and config.enabled
    assert config.buffer_steps == 10_000 and config.hwm == 100_000 and config.topic == ""
    assert KVEventsConfig.from_json("{}").publisher == "null"
    assert make_publisher(KVEventsConfig.from_json('{"publisher": "null"}')) is None
    with pytest.raises(ConfigError, match="max_queue_size=0 is invalid"):
        KVEventsConfig.from_json('{"max_queue_size": 0}')


def test_a_new_subscriber_asks_for_a_snapshot():
    """The XPUB hears each subscription: `wants_snapshot` turns True once per joining
    subscriber (the engine then announces everything again), not otherwise."""
    pub = _publisher()
    try:
        assert not pub.wants_snapshot()
        subs = []
        for _ in range(2):
            subs.append(_subscriber(pub.endpoint))
            deadline = time.monotonic() + 5
            while not pub.wants_snapshot():
                assert time.monotonic() < deadline, "the subscription was not heard"
                time.sleep(0.02)
            assert not pub.wants_snapshot()  # once per subscriber
        for sub in subs:
            sub.close(linger=0)
    finally:
        pub.shutdown()
