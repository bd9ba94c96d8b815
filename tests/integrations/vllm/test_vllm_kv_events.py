"""kvstrata's KV event stream decoded by vLLM's own classes: a real SUB socket on the
ZMQ publisher (tcp loopback), every payload read by `vllm.distributed.kv_events`'
KVEventBatch decoder, and the decoded events replayed against the store's changes on
every tier (device GPU, host CPU, disk STORAGE; the shared remote tier STORAGE /
REMOTE when a redis-server is installed)."""

from __future__ import annotations

import time

import msgspec
import pytest
import torch
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockStored, KVEventBatch

from kvstrata import CacheConfig, KVStore
from kvstrata.bench._redis import REDIS_SERVER, RedisServer
from kvstrata.model.geometry import KVGeometry
from kvstrata.server.kv_events import KVEventsConfig, ZmqEventPublisher
from kvstrata.store.events import KVEventRecorder

BS = 4
BLOCK_BYTES = 128  # 1 layer x K and V x 1 head x 4 dims x 4 tokens x fp32
MEDIA = {
    "device": ("GPU", None),
    "host": ("CPU", "LOCAL"),
    "disk": ("STORAGE", "LOCAL"),
    "remote": ("STORAGE", "REMOTE"),
}


def _int(block_hash: bytes) -> int:
    return int.from_bytes(block_hash[-8:], "big")  # vLLM's int form: the low 64 bits


class Subscriber:
    """A vLLM-side consumer: SUB socket, vLLM's decoder, a view hash -> (medium, locality)."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.RCVTIMEO, 100)  # 5 s once joined
        self.sock.connect(endpoint.replace("0.0.0.0", "127.0.0.1"))
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.view: dict[int, set[tuple[str, str | None]]] = {}
        self.tokens: dict[int, list[int]] = {}
        self.seq = -1

    def receive(self) -> KVEventBatch:
        _, seq, payload = self.sock.recv_multipart()
        assert int.from_bytes(seq, "big") == self.seq + 1 or self.seq == -1
        self.seq = int.from_bytes(seq, "big")
        batch = self.decoder.decode(payload)
        assert msgspec.msgpack.encode(batch) == payload  # byte for byte what vLLM would send
        assert batch.data_parallel_rank == 0
        for ev in batch.events:
            if isinstance(ev, AllBlocksCleared):
                self.view.clear()
                continue
            where = (ev.medium, ev.locality)
            for i, h in enumerate(ev.block_hashes):
                assert isinstance(h, int)
                if isinstance(ev, BlockStored):
                    assert ev.block_size == BS and ev.lora_name is None and ev.extra_keys is None
                    self.tokens[h] = ev.token_ids[i * BS : (i + 1) * BS]
                    self.view.setdefault(h, set()).add(where)
                else:
                    self.view[h].remove(where)
                    if not self.view[h]:
                        del self.view[h]
        return batch


def _store(tmp_path, **kw) -> KVStore:
    geometry = KVGeometry(
        model_type="toy", num_layers=1, num_heads=1, num_kv_heads=1, head_dim=4, v_head_dim=4,
        dtype="fp32",
    )  # fmt: skip
    fields = {"block_size": BS, "max_tokens": 64, "device_budget": 4 * BLOCK_BYTES}
    fields |= {"host_budget": 2 * BLOCK_BYTES, "disk_dir": tmp_path, "disk_budget": 4 * BLOCK_BYTES}
    store = KVStore(geometry, CacheConfig(**{**fields, **kw}))
    store.build(torch.float32)
    return store


def _held(store: KVStore) -> dict[int, set[tuple[str, str | None]]]:
    state = store.manager.state
    return {
        _int(h): {MEDIA[state.pool.blocks[b].tier]} for h, b in state.hash_to_block._by_hash.items()
    }


@pytest.mark.parametrize("remote", [False, True], ids=["local", "remote"])
def test_vllms_decoder_reads_kvstratas_events_on_every_tier(tmp_path, remote):
    if remote and REDIS_SERVER is None:
        pytest.skip("needs redis-server (apt-get install -y redis-server)")
    srv = RedisServer(tmp_path).start() if remote else None
    extra = {"remote_url": srv.url} if srv else {}
    store = _store(tmp_path / "disk", **extra)
    pub = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0"))
    sub = Subscriber(pub.endpoint)
    rec = KVEventRecorder()
    try:
        store.record_events(rec)
        first = rec.take()
        for _ in range(100):  # ZMQ's slow joiner: announce the start until it is heard
            pub.publish(time.time(), first)
            try:
                sub.receive()
                break
            except zmq.Again:
                continue
        sub.sock.setsockopt(zmq.RCVTIMEO, 5000)
        remote_seen: set[int] = set()
        media: set[tuple[str, str | None]] = set()
        for k in range(8):
            tokens = list(range(100 * k, 100 * k + 9))
            seq, matched = store.add_sequence(tokens)
            store.extend([seq], len(tokens) - matched, [tokens[matched:]])
            store.step_done([seq])
            store.free(seq)
            if srv is not None:
                assert store.prefix_index.remote.tier.flush()
            pub.publish(time.time(), rec.take())
            while True:  # past the repeated start announcements
                batch = sub.receive()
                if any(not isinstance(ev, AllBlocksCleared) for ev in batch.events):
                    break
            for ev in batch.events:
                media.add((ev.medium, ev.locality))
            remote_now = {h for h, w in sub.view.items() if ("STORAGE", "REMOTE") in w}
            remote_seen |= remote_now
            local = {h: w - {("STORAGE", "REMOTE")} for h, w in sub.view.items()}
            assert {h: w for h, w in local.items() if w} == _held(store)
        assert {("GPU", None), ("CPU", "LOCAL"), ("STORAGE", "LOCAL")} <= media
        if srv is not None:  # every block hashed was written to the server, none removed
            assert ("STORAGE", "REMOTE") in media and len(remote_seen) == 16
            assert all(len(sub.tokens[h]) == BS for h in remote_seen)
    finally:
        sub.sock.close(linger=0)
        pub.shutdown()
        store.close()
        if srv is not None:
            srv.stop()
