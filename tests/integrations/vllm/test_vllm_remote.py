"""The vLLM backend's remote tier against a real redis-server: two stores (two engines'
scheduler sides) sharing one server — asynchronous reads (RETRY, one batched round
trip, then a hit in a host slot), values checked (a corrupt one refused, counted,
deleted), namespaces (another model's blocks are other keys) — and two vLLM engines,
each its own processes, where the second reuses the first's blocks with identical
greedy tokens."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.integrations.vllm.test_vllm_parts import GEOMETRY, Worker, side
from tests.integrations.vllm.tiny import VLLM_BLOCK, prompts

from kvstrata.bench._redis import REDIS_SERVER, RedisServer, SlowProxy
from kvstrata.integrations.vllm.backend_plan import make_plan
from kvstrata.integrations.vllm.options import VllmOptions
from kvstrata.integrations.vllm.remote import RETRY
from kvstrata.integrations.vllm.store import HIT, MISS, OffloadStore

pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason="needs redis-server")


@pytest.fixture
def server(tmp_path: Path):
    srv = RedisServer(tmp_path).start()
    yield srv
    srv.stop()


def _store(url: str, model: str = "m", **extra: Any) -> tuple[OffloadStore, Worker]:
    options = VllmOptions.from_extra_config({"host_budget": "1MiB", "remote_url": url, **extra})
    plan = make_plan(options, side(model), GEOMETRY)
    worker = Worker(plan)  # the worker creates the host arena first
    return OffloadStore(plan, options), worker


def _wait_fetch(store: OffloadStore) -> None:
    store.end_step()  # starts the batched read of what the lookups queued
    fetcher = store.remote._fetcher
    if fetcher is not None:
        fetcher.join(10)


def test_two_stores_share_blocks_through_the_server(server: RedisServer) -> None:
    a, wa = _store(server.url)
    b, wb = _store(server.url)
    other, _ = _store(server.url, model="another-model")
    try:
        to_store, slots = a.prepare_store([b"x", b"y"], [b"vx", b"vy"])
        data = wa.write(slots, seed=3)
        a.complete_store(to_store, success=True)
        assert a.remote.flush()
        assert a.stats()["remote"]["writes"] == 2
        # B: the first lookups queue a read and answer RETRY; one round trip at the end
        # of the step; then hits, installed in B's own host slots
        assert [b.lookup(b.plan.key(k), k) for k in (b"vx", b"vy", b"vz")] == [RETRY] * 3
        _wait_fetch(b)
        assert b.stats()["remote"]["reads"] == 1
        assert b.lookup(b.plan.key(b"vx"), b"vx") == HIT and b.source(b.plan.key(b"vx")) == "remote"
        assert b.lookup(b.plan.key(b"vy"), b"vy") == HIT
        assert b.lookup(b.plan.key(b"vz"), b"vz") == MISS  # absent: remembered, not re-asked
        loaded = wb.read(b.prepare_load([b.plan.key(b"vx"), b.plan.key(b"vy")]))
        assert torch.equal(loaded, data)
        stats = b.stats()
        assert stats["hits_remote"] == 2 and stats["remote"]["hits"] == 2
        assert stats["remote"]["misses"] == 1
        # another model: other keys, nothing found
        assert other.lookup(other.plan.key(b"vx"), b"vx") == RETRY
        _wait_fetch(other)
        assert other.lookup(other.plan.key(b"vx"), b"vx") == MISS
        assert other.remote.namespace != b.remote.namespace == a.remote.namespace
        raw = sorted(server.client().keys(b"kvstrata:*"))
        assert len(raw) == 2 and all(k.split(b":")[1] == a.remote.namespace.encode() for k in raw)
    finally:
        for s in (a, b, other):
            s.close()


def test_a_corrupt_value_is_refused_counted_and_deleted(server: RedisServer) -> None:
    a, wa = _store(server.url)
    b, _ = _store(server.url)
    try:
        to_store, slots = a.prepare_store([b"x"], [b"vx"])
        wa.write(slots, seed=4)
        a.complete_store(to_store, success=True)
        assert a.remote.flush()
        key = a.remote.remote_key(b"vx")
        value = bytearray(server.client().get(key))
        value[-1] ^= 0xFF
        server.client().set(key, bytes(value))
        assert b.lookup(b.plan.key(b"vx"), b"vx") == RETRY
        _wait_fetch(b)
        assert b.lookup(b.plan.key(b"vx"), b"vx") == MISS
        assert b.remote.flush()
        assert b.stats()["remote"]["corrupt"] == 1 and server.client().get(key) is None
    finally:
        a.close()
        b.close()


def test_the_cost_rule_recomputes_when_vllm_prefills_faster_than_the_link_loads(
    server: RedisServer,
) -> None:
    a, wa = _store(server.url)
    proxy = SlowProxy(server.port, delay=0.2)  # B's link: 0.2 s per answer
    b, _ = _store(proxy.url)
    try:
        keys = [b"va-%04d" % i for i in range(4)]
        to_store, slots = a.prepare_store([a.plan.key(k) for k in keys], keys)
        wa.write(slots, seed=5)
        a.complete_store(to_store, success=True)
        assert a.remote.flush()
        # B prefills: a step whose prepare_store names 3 new blocks of one request, timed
        # from one step's end to the next (vLLM's on_schedule_end)
        b.end_step()
        own = [b"vb-%04d\0\0\0\0" % i for i in range(3)]  # vLLM keys: hash + group
        assert b.prepare_store([b.plan.key(k) for k in own], own) is not None
        b.end_step()
        link = b.remote.tier.link
        assert link.compute_tok_s is not None and link.compute_tok_s > 0
        # A's blocks: loading them over B's link is predicted slower than recomputing
        assert [b.lookup(b.plan.key(k), k) for k in keys] == [RETRY] * 4
        _wait_fetch(b)
        assert [b.lookup(b.plan.key(k), k) for k in keys] == [MISS] * 4  # vLLM recomputes
        stats = b.stats()["remote"]
        assert stats["link"]["decisions_recompute"] == 1 and stats["link"]["decisions_load"] == 0
        assert stats["reads"] == 0 and stats["hits"] == 0  # nothing read over the slow link
        assert stats["link"]["last_load_s"] > stats["link"]["last_recompute_s"] > 0
        # a decode step (one block per request) is not a prefill: it measures nothing
        before = link.compute_tok_s
        one = [b"vc-0000\0\0\0\0"]
        b.prepare_store([b.plan.key(k) for k in one], one)
        b.end_step()
        assert link.compute_tok_s == before
    finally:
        a.close()
        b.close()
        proxy.close()


def test_a_server_that_is_down_costs_misses_never_a_failure(tmp_path: Path) -> None:
    from kvstrata.bench._redis import free_port

    with pytest.warns(RuntimeWarning, match="unreachable at start"):
        b, _ = _store(f"redis://127.0.0.1:{free_port()}/0", remote_timeout=0.2)
    try:
        assert b.lookup(b.plan.key(b"vx"), b"vx") == MISS  # in backoff: not even asked
    finally:
        b.close()


# -- two vLLM engines ----------------------------------------------------------------------
@pytest.mark.slow
def test_two_vllm_engines_share_one_redis(
    tiny_llama: Path, engine_factory: Any, server: RedisServer
) -> None:
    p1, p2 = prompts(2, 300, seed=7)  # 9 full vLLM blocks each
    fields = {"host_budget": "8MiB", "remote_url": server.url}
    a = engine_factory(tiny_llama, **fields)
    try:
        cold, cold_cached = a.generate([p1, p2])
    finally:
        a_stats = a.close()  # closing flushes the write-behind queue
    assert cold_cached == [0, 0]
    assert a_stats["remote"]["writes"] >= 18 and a_stats["remote"]["writes_dropped"] == 0
    b = engine_factory(tiny_llama, **fields)
    try:
        t0 = time.perf_counter()
        warm, warm_cached = b.generate([p1, p2])
        b_s = time.perf_counter() - t0
        b_stats = b.stats()
    finally:
        b.close()
    assert warm == cold  # identical greedy tokens
    assert warm_cached == [9 * VLLM_BLOCK, 9 * VLLM_BLOCK]
    assert b_stats["hits_remote"] == 18 and b_stats["remote"]["corrupt"] == 0
    assert b_stats["remote"]["reads"] >= 1
    print(f"engine B answered both prompts from the remote tier in {b_s:.2f} s")
