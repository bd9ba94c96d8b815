"""The remote tier against a real redis-server: two stores sharing one pool, the key
rules (tenants, models), value checks, and faults (down at start, killed, restarted
empty, evicting, slow, garbage) — every output equal to transformers' DynamicCache."""

from __future__ import annotations

import time
import warnings

import pytest
import torch
from transformers import DynamicCache

from hf_models import greedy_ids, shared_prefix_case, tiny_model
from hf_models import seeded_ids as _ids
from kvstrata import CacheConfig, ConfigError, KVStore
from kvstrata.codecs.registry import get_codec
from kvstrata.core.layout import BlockLayout
from kvstrata.integrations.hf import TieredCache, enable
from kvstrata.tiers import remote_link
from kvstrata.tiers.remote_format import BadValue, RemoteFormat
from kvstrata.tiers.remote_link import LinkModel
from redis_harness import RedisServer, SlowProxy, free_port, needs_redis

PREFIX = 512
NEW = 20
BLOCKS = PREFIX // 64


def _greedy(model, ids, cache, n=NEW):
    return greedy_ids(model, ids, cache, n)


@pytest.fixture(scope="module")
def llama(one_thread):
    model = tiny_model("llama", max_position_embeddings=4096)
    prompts, refs = shared_prefix_case(model, PREFIX, 40, (8, 9, 10), NEW)
    enable(model)
    return model, prompts, refs


@pytest.fixture
def server(tmp_path):
    srv = RedisServer(tmp_path).start()
    yield srv
    srv.stop()


def _config(url: str, **kw) -> CacheConfig:
    return CacheConfig(
        **{"block_size": 64, "max_tokens": 4096, "host_budget": "16MiB", "remote_url": url, **kw}
    )


def _run(model, cfg, prompt, ref, salt: str = "", **store_kw) -> dict:
    """A fresh store (empty local tiers: another server) answers `prompt`; its output
    must equal the reference. Returns the store's stats and the matched tokens."""
    with KVStore(model.config, cfg, **store_kw) as store:
        cache = TieredCache.from_store(store, prompt, salt=salt)
        assert torch.equal(_greedy(model, prompt, cache), ref)
        cache.close()
        store.prefix_index.remote.tier.flush()
        stats = store.stats()
        stats["matched"] = cache.matched_tokens
        return stats


# -- config ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"remote_url": "http://h:6379"}, "remote_url='http://h:6379' is invalid: the scheme"),
        ({"remote_url": "redis://:s3cret@h:99999"}, "remote_url='redis://:***@h:99999'"),
        ({"remote_url": "redis://h/x"}, "the database /x must be a number"),
        ({"remote_url": ""}, "remote_url='' is invalid"),
        ({"remote_ttl": 60}, "remote_ttl=60 is invalid: set remote_url"),
        ({"remote_url": "redis://h", "remote_codec": "int3"}, "remote_codec='int3'"),
        ({"remote_url": "redis://h", "remote_ttl": 0}, "remote_ttl=0"),
        ({"remote_url": "redis://h", "remote_timeout": 0}, "remote_timeout=0"),
    ],
)
def test_bad_remote_fields_are_one_line_errors_without_the_password(fields, message):
    with pytest.raises(ConfigError) as err:
        CacheConfig(**fields)
    text = str(err.value)
    assert message in text and "\n" not in text and "s3cret" not in text


def test_a_config_repr_never_shows_the_password():
    assert "s3cret" not in repr(CacheConfig(remote_url="redis://:s3cret@h"))


# -- the value format --------------------------------------------------------------------
def test_a_value_that_fails_any_check_is_refused():
    layout = BlockLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
    fmt = RemoteFormat(layout, get_codec("int8", "remote_codec"))
    fields = {
        key: torch.randint(0, 100, (2, 2, spec.rows, spec.cols)).to(spec.dtype)
        for key, spec in fmt.specs
    }
    ns, h = "ab" * 16, bytes(range(16))
    value = fmt.encode(ns, h, (1, 2, 3, 4), fields)
    assert len(value) == fmt.value_bytes
    tokens, back = fmt.decode(value, ns, h)
    assert tokens == (1, 2, 3, 4)
    assert all(torch.equal(back[k], fields[k]) for k in fields)
    flipped = bytearray(value)
    flipped[-1] ^= 0x10
    for bad, why in [
        (bytes(flipped), "checksum"),
        (value[:-1], "truncated"),
        (b"garbage", "shorter than the header"),
        (b"X" + value[1:], "magic"),
    ]:
        with pytest.raises(BadValue, match=why):
            fmt.decode(bad, ns, h)
    with pytest.raises(BadValue, match="another namespace"):
        fmt.decode(value, "cd" * 16, h)
    with pytest.raises(BadValue, match="another namespace"):
        fmt.decode(value, ns, bytes(16))


# -- the link model ------------------------------------------------------------------------
def test_the_rule_compares_predictions_and_the_deadline_scales_with_the_bytes():
    link = LinkModel(latency_s=0.1, bytes_per_s=1e6, compute_tok_s=1000.0)
    assert link.predict_load(2_000_000) == pytest.approx(2.1)
    assert link.predict_recompute(4000) == pytest.approx(4.0)
    assert link.worth_loading(2_000_000, 4000)  # 2.1 s against 4 s
    assert not link.worth_loading(2_000_000, 1000)  # 2.1 s against 1 s
    assert (link.decisions_load, link.decisions_recompute) == (1, 1)
    assert (link.last_load_s, link.last_recompute_s) == (pytest.approx(2.1), 1.0)
    # 8x the predicted load, at most the recompute, at least a quarter of it, and
    # never under the floor (remote_timeout)
    assert link.deadline(100_000, 4000, floor=0.5) == pytest.approx(1.6)  # 8 x 0.2 s
    assert link.deadline(2_000_000, 4000, floor=0.5) == pytest.approx(4.0)  # the recompute
    assert link.deadline(100_000, 40_000, floor=0.5) == pytest.approx(10.0)  # a quarter
    assert link.deadline(0, 10, floor=0.5) == 0.5  # the floor
    assert link.last_deadline_s == 0.5
    fresh = LinkModel(latency_s=0.1, bytes_per_s=1e6)  # prefill speed not measured yet
    assert fresh.worth_loading(10**9, 10) and fresh.deadline(10**6, 10, 0.5) == pytest.approx(8.8)
    assert LinkModel().deadline(10**6, 10, floor=0.5) == 0.5  # nothing measured


def test_a_stale_link_is_never_explored_with_a_request_read():
    link = LinkModel(latency_s=1.0, bytes_per_s=1e6, compute_tok_s=1e6, last_measure=0.0)
    assert link.needs_measure()  # the tier re-measures it in the background...
    assert not link.worth_loading(10**6, 1000)  # ...and the rule still says recompute


# -- sharing -----------------------------------------------------------------------------
@needs_redis
def test_a_second_store_reuses_the_first_ones_prefix_from_the_server(llama, server):
    model, prompts, refs = llama
    cfg = _config(server.url)
    first = _run(model, cfg, prompts[0], refs[0])
    assert first["matched"] == 0 and first["remote"]["writes"] >= BLOCKS
    second = _run(model, cfg, prompts[1], refs[1])  # empty local tiers: all from Redis
    assert second["matched"] == PREFIX
    assert second["prefix"]["hit_tokens_by_tier"] == {"remote": PREFIX}
    assert second["remote"]["hits"] == BLOCKS and second["remote"]["reads"] == 1
    assert second["remote"]["link"]["decisions_load"] == 1


@needs_redis
def test_lossy_remote_codec_is_shared_too(llama, server):
    model, prompts, _ = llama
    cfg = _config(server.url, remote_codec="int8")
    with KVStore(model.config, cfg) as a:
        _greedy(model, prompts[0], TieredCache.from_store(a, prompts[0]))
        a.prefix_index.remote.tier.flush()
    with KVStore(model.config, cfg) as b:
        cache = TieredCache.from_store(b, prompts[1])
        assert cache.matched_tokens == PREFIX
        out = _greedy(model, prompts[1], cache)
        assert out.shape[1] == prompts[1].shape[1] + NEW


@needs_redis
def test_tenants_and_models_never_see_each_others_blocks(llama, server):
    model, prompts, refs = llama
    cfg = _config(server.url)
    _run(model, cfg, prompts[0], refs[0], salt="tenant-a")
    keys_a = set(server.client().keys("kvstrata:*"))
    assert len(keys_a) >= BLOCKS
    other = _run(model, cfg, prompts[1], refs[1], salt="tenant-b")
    assert other["matched"] == 0
    keys_b = set(server.client().keys("kvstrata:*")) - keys_a
    ns = {k.split(b":")[1] for k in keys_a}, {k.split(b":")[1] for k in keys_b}
    assert ns[0] and ns[1] and not ns[0] & ns[1]  # other namespace, not only other hashes
    again = _run(model, cfg, prompts[2], refs[2], salt="tenant-a")
    assert again["matched"] == PREFIX
    renamed = _run(model, cfg, prompts[2], refs[2], salt="tenant-a", model_key="another-model")
    assert renamed["matched"] == 0


# -- values that fail their checks ------------------------------------------------------
@needs_redis
def test_garbage_and_flipped_values_are_refused_counted_deleted_and_recomputed(llama, server):
    model, prompts, refs = llama
    cfg = _config(server.url)
    _run(model, cfg, prompts[0], refs[0])
    client = server.client()
    keys = sorted(client.keys("kvstrata:*"))
    for i, key in enumerate(keys):
        if i % 2:
            client.set(key, b"garbage")
        else:
            value = bytearray(client.get(key))
            value[len(value) // 2] ^= 0x01
            client.set(key, bytes(value))
    out = _run(model, cfg, prompts[1], refs[1])  # the same tokens
    assert out["matched"] == 0
    assert out["remote"]["corrupt"] >= 1 and out["remote"]["hits"] == 0
    for key in keys[:2]:  # deleted (then written again, whole, by this run)
        value = client.get(key)
        assert value is None or (value != b"garbage" and len(value) > 1000)


# -- faults ------------------------------------------------------------------------------
@needs_redis
def test_server_down_at_start_then_up_then_killed_then_restarted_empty(llama, tmp_path):
    model, prompts, refs = llama
    srv = RedisServer(tmp_path, free_port())
    cfg = _config(srv.url, remote_timeout=0.2)
    with pytest.warns(RuntimeWarning, match="unreachable at start"):
        down = _run(model, cfg, prompts[0], refs[0])  # no server: every request completes
    assert down["matched"] == 0
    srv.start()
    try:
        with KVStore(model.config, cfg) as a:  # reconnects with backoff: hits resume
            for prompt, ref in zip(prompts[:2], refs[:2], strict=True):
                assert torch.equal(_greedy(model, prompt, TieredCache.from_store(a, prompt)), ref)
            a.prefix_index.remote.tier.flush()
            assert a.stats()["remote"]["writes"] >= BLOCKS
            srv.stop()  # killed mid-run
            cache = TieredCache.from_store(a, prompts[2])  # local hit, the server is gone
            assert torch.equal(_greedy(model, prompts[2], cache), refs[2])
        with pytest.warns(RuntimeWarning, match="unreachable at start"):
            killed = _run(model, cfg, prompts[2], refs[2])  # a fresh store: nothing to read
        assert killed["matched"] == 0
        assert killed["remote"]["errors"] + killed["remote"]["skipped"] >= 1
        srv.start()  # restarted, empty
        time.sleep(0.3)
        empty = _run(model, cfg, prompts[2], refs[2])
        assert empty["matched"] == 0 and empty["remote"]["writes"] >= BLOCKS
        back = _run(model, cfg, prompts[1], refs[1])
        assert back["matched"] == PREFIX and back["remote"]["hits"] == BLOCKS
    finally:
        srv.stop()


@needs_redis
def test_a_store_reconnects_after_a_restart_and_hits_resume(llama, tmp_path):
    model, prompts, refs = llama
    srv = RedisServer(tmp_path).start()
    try:
        cfg = _config(srv.url, remote_timeout=0.2)
        _run(model, cfg, prompts[0], refs[0])
        with KVStore(model.config, cfg) as b:
            srv.stop()
            srv.start()  # the same port, empty
            cache = TieredCache.from_store(b, prompts[1])
            assert cache.matched_tokens == 0
            assert torch.equal(_greedy(model, prompts[1], cache), refs[1])
            cache.close()
            b.prefix_index.remote.tier.flush()
            assert b.stats()["remote"]["writes"] >= BLOCKS  # written to the new server
        again = _run(model, cfg, prompts[2], refs[2])
        assert again["matched"] == PREFIX
    finally:
        srv.stop()


@needs_redis
def test_a_server_evicting_under_maxmemory_gives_a_shorter_prefix_never_a_wrong_one(
    llama, tmp_path
):
    model, prompts, refs = llama
    srv = RedisServer(tmp_path, None, "--maxmemory", "3mb", "--maxmemory-policy", "allkeys-lru")
    srv.start()
    try:
        cfg = _config(srv.url)
        _run(model, cfg, prompts[0], refs[0])
        for seed in range(30, 40):  # other documents push the first one's blocks out
            filler = _ids(seed, 600)
            _run(model, cfg, filler, _greedy_ref(model, filler))
        info = srv.client().info("stats")
        assert info["evicted_keys"] > 0
        out = _run(model, cfg, prompts[1], refs[1])
        assert out["matched"] < PREFIX
    finally:
        srv.stop()


def _greedy_ref(model, ids, n=NEW):
    model.set_attn_implementation("sdpa")
    try:
        return _greedy(model, ids, DynamicCache(config=model.config), n)
    finally:
        enable(model)


@needs_redis
def test_a_slow_server_passes_its_deadline_and_the_prefix_is_recomputed(llama, server):
    model, prompts, refs = llama
    _run(model, _config(server.url), prompts[0], refs[0])
    proxy = SlowProxy(server.port, delay=0.0)
    try:
        cfg = _config(proxy.url, remote_timeout=0.1)
        with KVStore(model.config, cfg) as b:
            TieredCache.from_store(b, _ids(98, 10)).close()  # builds: starts on a fast link
            proxy.delay = 0.3  # then the server gets slow
            cache = TieredCache.from_store(b, prompts[1])
            assert cache.matched_tokens == 0
            assert torch.equal(_greedy(model, prompts[1], cache), refs[1])
            remote = b.stats()["remote"]
            # the read was cut at the deadline, not waited out at the server's pace
            assert remote["timeouts"] == 1 and remote["hits"] == 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the start-up ping times out
            slow = _run(model, cfg, prompts[2], refs[2])  # slow from the start
        assert slow["matched"] == 0 and slow["remote"]["skipped"] >= 1
    finally:
        proxy.close()


@needs_redis
def test_a_read_slower_than_remote_timeout_gets_the_deadline_its_bytes_need(llama, server):
    model, prompts, refs = llama
    first = _run(model, _config(server.url), prompts[0], refs[0])
    value_bytes = first["remote"]["bytes_written"] / first["remote"]["writes"]
    # a throttled link: the prefix's blocks take ~0.6 s, three times remote_timeout
    proxy = SlowProxy(server.port, delay=0.0, rate=BLOCKS * value_bytes / 0.6)
    try:
        cfg = _config(proxy.url, remote_timeout=0.2)
        out = _run(model, cfg, prompts[1], refs[1])  # the start-up probe measured the link
        remote = out["remote"]
        assert remote["latency_sum_s"] > cfg.remote_timeout  # the read took longer...
        assert remote["link"]["last_deadline_s"] > remote["latency_sum_s"]  # ...and was let
        assert out["matched"] == PREFIX and remote["hits"] == BLOCKS
        assert remote["timeouts"] == 0 and remote["reads"] == 1
    finally:
        proxy.close()


@needs_redis
def test_the_cost_rule_recomputes_when_loading_is_predicted_slower(llama, server, monkeypatch):
    model, prompts, refs = llama
    for salt in ("", "t2"):  # the document on the server for two tenants
        _run(model, _config(server.url), prompts[0], refs[0], salt=salt)
    proxy = SlowProxy(server.port, delay=0.25)
    try:
        cfg = _config(proxy.url, remote_timeout=5)
        with KVStore(model.config, cfg) as b:
            warm = _ids(99, 300)  # measures this store's prefill speed
            _greedy(model, warm, TieredCache.from_store(b, warm), n=2)
            for prompt, ref, salt in zip(prompts[1:], refs[1:], ("", "t2"), strict=True):
                cache = TieredCache.from_store(b, prompt, salt=salt)
                assert cache.matched_tokens == 0
                assert torch.equal(_greedy(model, prompt, cache), ref)
                cache.close()
                # a link refused for long is re-measured in the background, never by
                # loading a request's blocks over it
                monkeypatch.setattr(remote_link, "REMEASURE_S", 0.0)
            remote = b.stats()["remote"]
            link = remote["link"]
            assert link["decisions_recompute"] == 2 and link["decisions_load"] == 1  # warm
            assert remote["reads"] == 1 and remote["hits"] == 0 and remote["timeouts"] == 0
            assert link["latency_ms"] > 200 and link["compute_tok_s"] > 0
            assert link["last_load_s"] > link["last_recompute_s"] > 0  # why: in the stats
    finally:
        proxy.close()


@needs_redis
def test_an_idle_engine_reports_the_writes_that_finished_after_its_last_step(server):
    from kvstrata.engine import Engine, SamplingParams

    model = tiny_model("llama", max_position_embeddings=4096)
    proxy = SlowProxy(server.port, delay=0.3)  # each write's answer comes 0.3 s later
    try:
        fields = {"block_size": 64, "host_budget": "16MiB", "remote_url": proxy.url}
        with Engine(model, **fields) as a:
            a.generate([_ids(7, PREFIX)[0].tolist()], [SamplingParams(max_tokens=2)])
            assert a.store.prefix_index.remote.tier.flush(30)  # sent, the engine idle
            # an idle engine still refreshes its snapshot (what /metrics and stats()
            # show): the bench waits on these to see the write-behind queue drain
            for _ in range(100):
                if a.metrics.value("kvstrata_remote_writes_total") == BLOCKS:
                    break
                time.sleep(0.1)
            assert a.metrics.value("kvstrata_remote_writes_total") == BLOCKS
            assert a.metrics.value("kvstrata_remote_pending_bytes") == 0
    finally:
        proxy.close()


@needs_redis
def test_the_writer_thread_outlives_a_write_that_fails_unexpectedly(server):
    from kvstrata.tiers.remote import RemoteTier

    tier = RemoteTier(server.url)
    try:
        tier.start(1 << 10)
        # a value redis-py cannot encode fails in the client, not on the socket
        assert tier.submit(lambda: [(b"kvstrata:t:bad", {"not": "bytes"})], 10, 1)
        assert tier.submit(lambda: [(b"kvstrata:t:good", b"v" * 10)], 10, 1)
        assert tier.flush(10)
        stats = tier.as_dict()
        assert stats["write_errors"] == 1 and stats["writes"] == 1 and stats["writer_alive"]
        assert server.client().get(b"kvstrata:t:good") == b"v" * 10
    finally:
        tier.close()


@needs_redis
def test_wrong_password_and_a_too_small_server_are_refused_at_start(llama, tmp_path, monkeypatch):
    model, prompts, _ = llama
    srv = RedisServer(tmp_path, None, "--requirepass", "right").start()
    try:
        url = f"redis://:wrong@127.0.0.1:{srv.port}/0"
        with KVStore(model.config, _config(url)) as store, pytest.raises(ConfigError) as err:
            TieredCache.from_store(store, prompts[0])
        assert "remote_url=" in str(err.value) and "wrong" not in str(err.value)
        monkeypatch.setenv("KVSTRATA_REMOTE_PASSWORD", "right")
        with KVStore(model.config, _config(srv.url)) as store:
            TieredCache.from_store(store, prompts[0]).close()
            assert store.stats()["remote"]["available"]
        srv.client().config_set("maxmemory", "100kb")
        with KVStore(model.config, _config(srv.url)) as store, pytest.raises(ConfigError) as err:
            TieredCache.from_store(store, prompts[0])
        assert "maxmemory" in str(err.value)
    finally:
        srv.stop()


@needs_redis
def test_two_engines_share_one_pool_with_the_tokens_of_a_cold_run(server):
    from kvstrata.engine import Engine, SamplingParams

    model = tiny_model("llama", max_position_embeddings=4096)
    doc = _ids(7, PREFIX)[0].tolist()
    questions = [doc + _ids(s, 30)[0].tolist() for s in (40, 41)]
    params = [SamplingParams(max_tokens=24)]
    fields = {"block_size": 64, "host_budget": "16MiB", "remote_url": server.url}
    with Engine(model, prefix_caching=False, block_size=64, host_budget="16MiB") as cold:
        ref = [cold.generate([q], params)[0].token_ids for q in questions]
    model.set_attn_implementation("sdpa")  # the cold run is transformers' DynamicCache run
    ids = torch.tensor([questions[1]])
    dynamic = model.generate(
        ids, max_new_tokens=24, do_sample=False, cache=DynamicCache(config=model.config)
    )
    assert ref[1] == dynamic[0, ids.shape[1] :].tolist() and len(ref[1]) > 10
    with Engine(model, **fields) as a:  # server A reads the document
        assert a.generate([questions[0]], params)[0].token_ids == ref[0]
        a.store.prefix_index.remote.tier.flush()
    with Engine(model, **fields) as b:  # server B answers another question on it
        out = b.generate([questions[1]], params)[0]
        assert out.token_ids == ref[1] and out.cached_tokens == PREFIX
        assert b.metrics.value("kvstrata_remote_hits_total") == BLOCKS
        assert b.metrics.value("kvstrata_remote_decisions_total", choice="load") == 1
        assert b.metrics.value("kvstrata_remote_read_seconds_count") == 1
