"""KV events of a KVStore: every change to its cached blocks, tier by tier, as vLLM's
BlockStored / BlockRemoved / AllBlocksCleared (store/events.py)."""

from __future__ import annotations

import pytest
import torch

from kvstrata import CacheConfig, KVStore
from kvstrata.core.hashing import sequence_block_hashes
from kvstrata.model.geometry import KVGeometry
from kvstrata.store.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventRecorder
from redis_harness import RedisServer, needs_redis

BS = 4
BLOCK_BYTES = 128  # 1 layer x K and V x 1 head x 4 dims x 4 tokens x fp32
MEDIA = {
    "device": ("GPU", None),
    "host": ("CPU", "LOCAL"),
    "disk": ("STORAGE", "LOCAL"),
    "remote": ("STORAGE", "REMOTE"),
}


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


def _run(store: KVStore, tokens: list[int], salt: str = "") -> int:
    """One request: admitted (its cached prefix found), prefilled, freed."""
    seq, matched = store.add_sequence(tokens, salt=salt)
    store.extend([seq], len(tokens) - matched, [tokens[matched:]])
    store.step_done([seq])
    store.free(seq)
    return matched


def _held(store: KVStore) -> dict[bytes, str]:
    """Each indexed block's hash -> its tier: what a later request can hit."""
    state = store.manager.state
    return {h: state.pool.blocks[b].tier for h, b in state.hash_to_block._by_hash.items()}


def _replay(view: dict[bytes, set[str]], events: list, block_tokens: dict) -> None:
    """Apply events to a consumer's view (hash -> tiers), checking what each says."""
    for ev in events:
        if isinstance(ev, AllBlocksCleared):
            view.clear()
            continue
        assert (ev.medium, ev.locality) == MEDIA[ev.tier]
        for i, h in enumerate(ev.block_hashes):
            if isinstance(ev, BlockStored):
                tokens = ev.token_ids[i * BS : (i + 1) * BS]
                assert len(tokens) == BS and block_tokens.setdefault(h, tokens) == tokens
                assert ev.tier not in view.get(h, set()), "stored twice on one tier"
                view.setdefault(h, set()).add(ev.tier)
            else:
                view[h].remove(ev.tier)
                if not view[h]:
                    del view[h]


def test_events_follow_blocks_down_the_tiers_and_out(tmp_path):
    store = _store(tmp_path)
    rec = KVEventRecorder()
    store.record_events(rec)
    assert rec.take() == [AllBlocksCleared()]
    view: dict[bytes, set[str]] = {}
    tokens_of: dict[bytes, tuple] = {}
    seen = {"stored": set(), "removed": set()}
    for k in range(10):
        _run(store, list(range(100 * k, 100 * k + 9)))  # 2 full blocks and 1 token
        events = rec.take()
        _replay(view, events, tokens_of)
        assert view == {h: {t} for h, t in _held(store).items()}  # exactly the store's change
        for ev in events:
            if not isinstance(ev, AllBlocksCleared):
                kind = "stored" if isinstance(ev, BlockStored) else "removed"
                seen[kind].add(ev.tier)
    assert seen == {"stored": {"device", "host", "disk"}, "removed": {"device", "host", "disk"}}
    assert store.usage().evicted_cached_blocks > 0
    store.close()


def test_the_exact_sequence_of_one_block_moving_device_host_disk(tmp_path):
    store = _store(tmp_path)
    rec = KVEventRecorder()
    store.record_events(rec)
    rec.take()
    extra = store.prefix_index._extra_keys(0, "")
    a0, a1 = sequence_block_hashes(list(range(9)), BS, extra)
    b0, b1 = sequence_block_hashes(list(range(100, 109)), BS, extra)
    c0, c1 = sequence_block_hashes(list(range(200, 209)), BS, extra)

    def stored(hashes, parent, tokens, tier):
        medium, locality = MEDIA[tier]
        return BlockStored(hashes, parent, tuple(tokens), BS, medium, locality, 0, tier)

    def removed(hashes, tier):
        return BlockRemoved(hashes, *MEDIA[tier], 0, tier)

    _run(store, list(range(9)))
    assert rec.take() == [stored((a0, a1), None, range(8), "device")]  # one chain, one event
    _run(store, list(range(100, 109)))  # the device holds 4: the oldest block goes down
    assert rec.take() == [
        stored((a1,), a0, range(4, 8), "host"),
        removed((a1,), "device"),
        stored((b0, b1), None, range(100, 108), "device"),
    ]
    _run(store, list(range(200, 209)))
    assert rec.take() == [
        stored((a1,), a0, range(4, 8), "disk"),
        removed((a1,), "host"),
        stored((a0,), None, range(4), "host"),
        stored((b1,), b0, range(104, 108), "host"),
        removed((a0, b1), "device"),
        stored((c0, c1), None, range(200, 208), "device"),
    ]
    assert _run(store, list(range(9))) == 8  # a hit moves nothing back: no event
    store.close()


def _parents(events: list) -> dict[bytes, bytes | None]:
    """Each announced block's parent hash (a merged event chains its blocks)."""
    out: dict[bytes, bytes | None] = {}
    for ev in events:
        if isinstance(ev, BlockStored):
            parent = ev.parent_block_hash
            for h in ev.block_hashes:
                out.setdefault(h, parent)
                parent = h
    return out


def test_a_restarted_store_announces_what_its_disk_kept(tmp_path):
    store = _store(tmp_path)
    first = KVEventRecorder()
    store.record_events(first)
    for k in range(3):
        _run(store, list(range(100 * k, 100 * k + 13)))  # 3 full blocks each
    chained = _parents(first.take())
    store.close()  # persists every cached block to the disk tier (4 fit)
    again = _store(tmp_path)
    rec = KVEventRecorder()
    again.record_events(rec)
    events = rec.take()
    held = _held(again)
    assert events[0] == AllBlocksCleared() and len(held) == 4  # the disk budget
    assert set(held.values()) == {"disk"}

    def reachable(h: bytes | None) -> bool:  # its whole chain is held
        return h is None or (h in held and reachable(chained[h]))

    hashes = [h for ev in events[1:] for h in ev.block_hashes]
    assert sorted(hashes) == sorted(h for h in held if reachable(h))
    assert len(hashes) < len(held)  # this run kept a block whose parent went: not announced
    seen: set[bytes] = set()
    for ev in events[1:]:  # chain by chain, every block after its parent
        assert isinstance(ev, BlockStored) and ev.medium == "STORAGE" and ev.locality == "LOCAL"
        assert ev.group_idx == 0  # one layer group (the disk index keeps none)
        assert ev.parent_block_hash is None or ev.parent_block_hash in seen
        seen.update(ev.block_hashes)
    # the chains the first store hashed, kept by the disk index across the restart
    assert _parents(events) == {h: chained[h] for h in hashes}
    assert any(parent is not None for parent in _parents(events).values())
    again.close()


def test_a_tenant_salt_changes_every_hash_and_never_appears(tmp_path):
    store = _store(tmp_path)
    rec = KVEventRecorder()
    store.record_events(rec)
    rec.take()
    _run(store, list(range(9)))
    _run(store, list(range(9)), salt="tenant-secret")
    plain, salted = [ev for ev in rec.take() if len(ev.block_hashes) == 2]  # the two chains
    assert set(plain.block_hashes).isdisjoint(salted.block_hashes)
    assert plain.token_ids == salted.token_ids
    assert b"tenant-secret" not in b"".join(salted.block_hashes)
    assert "tenant-secret" not in repr(salted)
    store.close()


def test_without_a_recorder_nothing_is_recorded_and_detaching_stops_it(tmp_path):
    store = _store(tmp_path)
    state = store.manager.state
    on_move = state.on_move
    rec = KVEventRecorder()
    store.record_events(rec)
    store.record_events(None)
    assert state.on_unindex is None and state.on_move == on_move
    for k in range(4):
        _run(store, list(range(100 * k, 100 * k + 9)))
    assert rec.take() == [AllBlocksCleared()]
    store.close()


@needs_redis
def test_blocks_written_to_the_remote_tier_are_announced_remote(tmp_path):
    srv = RedisServer(tmp_path).start()
    try:
        store = _store(tmp_path / "a", remote_url=srv.url)
        rec = KVEventRecorder()
        store.record_events(rec)
        rec.take()
        _run(store, list(range(9)))
        assert store.prefix_index.remote.tier.flush()
        events = rec.take()
        remote = [ev for ev in events if ev.tier == "remote"]
        local = [ev for ev in events if ev.tier == "device"]
        written = tuple(h for ev in remote for h in ev.block_hashes)
        assert [ev.block_hashes for ev in local] == [written]
        assert all((ev.medium, ev.locality) == ("STORAGE", "REMOTE") for ev in remote)
        assert remote[0].parent_block_hash is None and remote[0].token_ids == tuple(range(8))
        store.close()
        other = _store(tmp_path / "b", remote_url=srv.url)  # another replica, empty tiers
        rec = KVEventRecorder()
        other.record_events(rec)
        rec.take()
        assert _run(other, list(range(9))) == 8  # from the server
        installed = rec.take()[0]
        assert installed.block_hashes == local[0].block_hashes and installed.tier == "device"
        assert installed.parent_block_hash is None and installed.group_idx == 0
        first, second = installed.block_hashes
        blocks = other.manager.state.pool.blocks
        held = {blocks[i].block_hash: blocks[i] for i in other.manager.state.hash_to_block.values()}
        assert (held[first].parent_hash, held[second].parent_hash) == (None, first)  # kept
        other.close()
    finally:
        srv.stop()


@pytest.mark.parametrize("where", ["truncate"])
def test_a_cut_block_is_announced_removed(tmp_path, where):
    store = _store(tmp_path)
    rec = KVEventRecorder()
    store.record_events(rec)
    rec.take()
    seq, _ = store.add_sequence(list(range(9)))
    store.extend([seq], 9, [list(range(9))])
    store.step_done([seq])
    (full,) = rec.take()
    store.truncate(seq, 6)  # the second block is cut: its hash no longer holds
    assert rec.take() == [BlockRemoved((full.block_hashes[1],), "GPU", None, 0, "device")]
    store.close()
